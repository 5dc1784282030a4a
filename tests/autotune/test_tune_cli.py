"""`ckrun tune` end to end with real probes: a tiny BERT, a cap below its no-plan peak."""

from pathlib import Path

import pytest
import yaml

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.cli import main
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.measure.probe import probe
from tune_helpers import launches, report, survivors


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned")
    no_plan_peak = probe(load_recipe(BERT_TINY, TINY_BERT), 1, 1).peak_mem_bytes
    cap = int(no_plan_peak * 0.85)  # the recipe as written does not fit: the tuner must find a plan that does
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # the probe children, like this process (conftest), use one thread
        code = _tune(out, cap)
    return out / "tune", cap, no_plan_peak, code


def _tune(out, cap):
    return main(["tune", BERT_TINY, *TINY_BERT, f"output.dir={out / 'run'}", "--max-mem", str(cap),
                 "--output", str(out / "tune"), "--trials", "3", "--finalists", "0", "--warmup-steps", "1",
                 "--timed-steps", "1", "--no-train"])  # a fit is what is tested here, not the ranking


def test_the_winner_fits_under_a_cap_the_recipe_does_not(study):
    directory, cap, no_plan_peak, code = study
    assert code == 0
    found = report(directory)
    trials = {t["number"]: t for t in found["trials"]}
    solver = [t for t in trials.values() if t.get("proposed_by") == "solver"]
    assert [t["number"] for t in solver] == list(range(len(solver)))  # the solver's plans are probed first
    first = trials[len(solver)]  # the no-plan starting point
    assert first["plan"]["checkpointing"]["policy"] == "none"
    if first["plan"]["micro_batch"] == 8:  # without predictions the whole batch is tried, and is over
        assert first["state"] in ("over_cap", "over_limit")
    else:  # runner's estimator moved it to the largest micro-batch predicted to fit
        assert first["state"] == "feasible"
    winner = trials[found["winner"]]
    assert winner["state"] == "feasible"
    assert winner["measured_peak"] <= found["limit_bytes"] < cap < no_plan_peak
    assert not survivors([launch["pid"] for launch in launches(directory)])


def test_tuned_yaml_validates_and_trains_under_the_cap(study, ckrun, tmp_path):
    directory, cap, _, _ = study
    tuned = directory / "tuned.yaml"
    header = tuned.read_text().split("\n\n")[0]
    assert "Tuned by `ckrun tune`" in header and "device:" in header and "samples/s" in header
    recipe_lines = Path(BERT_TINY).read_text().splitlines()
    assert recipe_lines[0] in tuned.read_text().splitlines()  # the recipe's own comments are kept
    winner = report(directory)["trials"][report(directory)["winner"]]
    data = yaml.safe_load(tuned.read_text())
    assert data["memory"]["micro_batch"] == winner["plan"]["micro_batch"]
    assert data["memory"]["max_mem"] == str(cap)
    assert ckrun("validate", tuned)[0] == 0
    code, _, err = ckrun(tuned, "train.steps=3", f"output.dir={tmp_path}")
    assert code == 0, err
    assert max(m["peak_mem_bytes"] for m in read_metrics(tmp_path)) <= cap


def test_report_reprints_the_front_and_the_plot(study, ckrun):
    directory = study[0]
    (directory / "pareto.png").unlink()
    code, out, _ = ckrun("report", directory)
    assert code == 0
    assert "Pareto front" in out and "winner: trial" in out
    assert any(line.lstrip().startswith("*") for line in out.splitlines())
    assert (directory / "pareto.png").stat().st_size > 1000


def test_report_of_a_directory_without_a_study(ckrun, tmp_path):
    code, _, err = ckrun("report", tmp_path)
    assert code == 2 and "no study (no study.journal)" in err and len(err.strip().splitlines()) == 1


def test_a_run_in_the_recipes_output_dir_is_refused_saying_which_flag_moves_what(tmp_path, ckrun):
    """--output moves the study, not the training that follows it: the line says so, before any search."""
    run = tmp_path / "run"
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={run}")[0] == 0
    code, _, err = ckrun("tune", BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={run}", "--max-mem", "1GB",
                         "--output", str(tmp_path / "study"), "--trials", "1")
    lines = [line for line in err.splitlines() if "output.dir:" in line]
    assert code == 2 and len(lines) == 1, err
    assert f"{run} already holds a run" in lines[0] and "--output moves only the study" in lines[0] and \
        "output.dir=..." in lines[0] and "--no-train" in lines[0]
    assert not (tmp_path / "study" / "tuned.yaml").exists()
