"""`ckrun tune --predict --gpu NAME`: the search with predictions in place of probes, on a CPU."""

from __future__ import annotations

import json
import logging
import os

import pytest
import yaml

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.cli import main
from ckrun.autotune.probes.beside import SWITCH_ENV
from tune_helpers import launches, report, survivors

# the tiny BERT for a GPU: bf16, 4 blocks, batch 16; its peaks sit just above the CUDA context
FOR_GPU = [*[o for o in TINY_BERT if not o.startswith(("train.device", "train.batch_size"))],
           "model.config.num_hidden_layers=4", "train.batch_size=16", "precision=bf16", "train.device=auto"]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    out, lines = tmp_path_factory.mktemp("predicted"), Lines()
    logger = logging.getLogger("ckrun.autotune")
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(lines)
    try:
        code = main(["tune", BERT_TINY, *FOR_GPU, f"output.dir={out / 'run'}", "--max-mem", "1GB", "--predict",
                     "--gpu", "a100-40gb", "--output", str(out / "tune"), "--trials", "6"])
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return out, code, lines.lines


def test_predict_searches_without_probing_and_writes_a_tuned_yaml_marked_predicted(predicted, capsys):
    out, code, _ = predicted
    assert code == 0
    found = report(out / "tune")
    measured = [t for t in found["trials"] if t["state"] == "feasible"]
    assert measured and all(t["predicted"] and t["step_s"] > 0 and 0 < t["mfu"] <= 1 for t in measured)
    assert all(t["device"]["device"] == "NVIDIA A100-SXM4-40GB" for t in measured)
    assert not [launch for launch in launches(out / "tune") if launch["what"] == "probe"]  # nothing ran for real
    assert not (out / "run" / "metrics.jsonl").exists()  # nor trained
    text = (out / "tune" / "tuned.yaml").read_text()
    assert "PREDICTED, not measured: NVIDIA A100-SXM4-40GB" in text and "#   predicted:" in text
    winner = found["trials"][found["winner"]]
    assert yaml.safe_load(text)["memory"]["micro_batch"] == winner["plan"]["micro_batch"]
    assert winner["samples_per_s"] == max(t["samples_per_s"] for t in measured if t["measured_peak"] <= found["limit_bytes"])


def test_a_predicted_tuned_yaml_is_where_the_next_tune_starts(predicted, tmp_path):
    """On the GPU, `ckrun tune tuned.yaml` tries the recipe's own plan (the predicted winner) first."""
    out, _, _ = predicted
    tuned = out / "tune" / "tuned.yaml"
    winner = report(out / "tune")["trials"][report(out / "tune")["winner"]]
    code = main(["tune", str(tuned), f"output.dir={tmp_path / 'run'}", "--max-mem", "1GB", "--predict", "--gpu",
                 "a100-40gb", "--output", str(tmp_path / "again"), "--trials", "1", "--no-solver"])
    assert code == 0
    first = report(tmp_path / "again")["trials"][0]
    assert first["key"] == winner["key"]


@pytest.mark.parametrize("flags, says", [
    (["--predict"], "--predict: predicting needs the device: name it with --gpu h100"),
    (["--gpu", "h100"], "--gpu: the probes run on this machine, which has no GPU; add --predict"),
    (["--predict", "--gpu", "h300"], "--gpu: unknown GPU 'h300'; known: "),
    (["--predict", "--gpu", "h100", "--no-screen"], "--no-screen: --predict answers every probe with a prediction"),
    (["--predict", "--gpu", "l4", "train.device=cpu"], "train.device: the recipe trains on cpu but NVIDIA L4 is a GPU"),
    (["--predict", "--gpu", "l4", "--max-mem", "30GB"], "--max-mem 30GB: more than the NVIDIA L4 has"),
])
def test_predict_refuses_what_it_cannot_do_in_one_line(tmp_path, capsys, flags, says):
    pytest.importorskip("torch").cuda.is_available() and pytest.skip("these refusals are for a machine without a GPU")
    cap = [] if "--max-mem" in flags else ["--max-mem", "1GB"]
    code = main(["tune", BERT_TINY, *FOR_GPU, f"output.dir={tmp_path / 'run'}", "--output", str(tmp_path / "t"),
                 *cap, *flags])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if not line[:2].isdigit()]) == 1  # one line, besides log lines


def test_estimate_gives_time_on_a_named_gpu(ckrun):
    code, out, err = ckrun("estimate", BERT_TINY, *FOR_GPU, "--gpu", "h100", "--json")
    assert code == 0
    step = json.loads(out)["time"]
    assert step["device"] == "NVIDIA H100 80GB HBM3" and step["seconds"] > 0
    assert 0 < step["mfu"] <= step["hfu"] <= 1 and step["tokens_per_s"] == pytest.approx(32 * step["samples_per_s"])
    code, out, err = ckrun("estimate", BERT_TINY, *FOR_GPU, "--gpu", "h100")
    assert code == 0 and "step time" in out and "MFU" in out and "not a promise" in out



def test_a_predicted_search_says_predicted_never_probing_or_measured(predicted):
    """--predict logs "predicting" and "predicted to fit", never "probing" or a bare "feasible"."""
    lines = predicted[2]
    trials = [line for line in lines if line.startswith("trial ")]
    assert trials and not [line for line in trials if "probing" in line or ": feasible:" in line]
    assert any(": predicted to fit:" in line and "predicted peak" in line for line in trials)
    assert not [line for line in lines if "measured" in line and line.startswith(("tune: searched", "tune: stopping"))]


def _again(directory, *extra) -> list[str]:
    """The module's predicted tune (`predicted`), into `directory`."""
    return ["tune", BERT_TINY, *FOR_GPU, f"output.dir={directory / 'run'}", "--max-mem", "1GB", "--predict", "--gpu",
            "a100-40gb", "--output", str(directory / "tune"), "--trials", "6", *extra]


def _trials(directory) -> list[list]:
    return [[t.get(k) for k in ("number", "key", "state", "measured_peak", "step_s", "proposed_by")]
            for t in report(directory)["trials"]]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="a second pricer needs a second CPU")
def test_a_search_with_a_second_pricer_prices_every_plan_as_the_search_without(predicted, tmp_path, monkeypatch,
                                                                               caplog):
    """`predicted` is a small model's: it had no second pricer (autotune/probes/beside.py). The same tune with one
    (CKRUN_BESIDE=on) prices the same plans in the same order to the byte, and leaves no process behind."""
    out, _, _ = predicted
    monkeypatch.setenv(SWITCH_ENV, "on")
    with caplog.at_level("INFO", logger="ckrun.autotune"):
        assert main(_again(tmp_path)) == 0
    alone, beside = report(out / "tune"), report(tmp_path / "tune")
    assert "traced_beside" not in alone["screening"] and "traced_beside" in beside["screening"]
    assert any("a second process makes traces beside this one" in r.getMessage() for r in caplog.records)
    assert not any("second pricer stopped" in r.getMessage() for r in caplog.records)
    assert _trials(tmp_path / "tune") == _trials(out / "tune") and beside["winner"] == alone["winner"]
    started = [launch["pid"] for launch in launches(tmp_path / "tune") if launch["what"] == "beside"]
    assert len(started) == 1 and not survivors(started)  # gone with the search


def test_a_study_killed_before_its_first_trial_resumes_as_a_new_one(predicted, tmp_path, monkeypatch):
    """A tune stopped while it chose its starting points (an 8B's first 20 s) left a study with no trial: resumed, it
    starts as a new one (the solver, the starting points), where it went on with the sampler alone (290 s to the
    8B's winner where 65 s): the trials of `predicted`, which was not stopped."""
    from ckrun.autotune.search.tuner import Tuner

    out, _, _ = predicted

    def killed(*_args, **_kwargs):
        raise RuntimeError("the tuner's process ends here")

    with monkeypatch.context() as patch:
        patch.setattr(Tuner, "start", killed)
        assert main(_again(tmp_path)) != 0  # said in one line, as any crash of the tuner is
    assert not (tmp_path / "tune" / "report.json").exists()
    assert main(_again(tmp_path, "--resume")) == 0
    assert _trials(tmp_path / "tune") == _trials(out / "tune")
