"""A tuner killed with SIGKILL mid-study: no probe outlives it, a second tuner is refused while it
runs, and `--resume` finishes the study without re-running finished trials, ending with the same
winner as an uninterrupted run with the same seed. Probes use the deterministic fake child."""

import os
import signal
import subprocess
import sys

import pytest

import children
from conftest import BERT_TINY, ROOT, TINY_BERT
from tune_helpers import launches, report, survivors, use_fake_child, wait_for

TRIALS = "8"


def _args(directory, *extra):
    return ["tune", BERT_TINY, *TINY_BERT, "model.config.num_hidden_layers=4", f"output.dir={directory}",
            "--output", str(directory), "--max-mem", "2.5MB", "--trials", TRIALS, "--seed", "3", "--no-train",
            "--no-screen", *extra]  # the fake child measures a formula, not what the estimator predicts


def _probed(directory):
    return [launch for launch in launches(directory) if launch["what"] == "probe"]


def _first_evaluations(directory):
    trials = report(directory)["trials"]
    return [t["key"] for t in trials if t["state"] not in ("duplicate", "interrupted")]


@pytest.mark.slow  # 25 s: a study killed and resumed
def test_killed_study_resumes_to_the_same_winner(ckrun, monkeypatch, tmp_path):
    env = {**os.environ, **use_fake_child(monkeypatch, seconds=1.5)}
    cut = tmp_path / "cut"
    tuner = subprocess.Popen([sys.executable, "-m", "ckrun", *_args(cut)], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        children.wait_until(lambda: len(_probed(cut)) >= 3, tuner, "its third probe")
        code, _, err = ckrun(*_args(cut, "--resume"))
        assert code == 2 and f"another `ckrun tune` (pid {tuner.pid}) is running this study" in err
    finally:
        os.killpg(tuner.pid, signal.SIGKILL)  # no chance to clean up: its probe must go by itself
        tuner.wait()
    before = _probed(cut)
    wait_for(lambda: not survivors([launch["pid"] for launch in before]), timeout=10)
    monkeypatch.setenv("FAKE_PROBE_SECONDS", "0")  # slow probes were only needed to catch the tuner mid-study

    code, _, err = ckrun(*_args(cut, "--resume"))
    assert code == 0, err
    finished = {t["number"] for t in report(cut)["trials"] if t["state"] not in ("interrupted", "running")
                and t["number"] < len(before)}
    rerun = {launch["trial"] for launch in _probed(cut)[len(before):]}
    assert finished and not finished & rerun

    code, _, err = ckrun(*_args(tmp_path / "whole"))
    assert code == 0, err
    assert _first_evaluations(cut) == _first_evaluations(tmp_path / "whole")
    whole, resumed = report(tmp_path / "whole"), report(cut)
    assert resumed["trials"][resumed["winner"]]["key"] == whole["trials"][whole["winner"]]["key"]


def test_a_study_killed_before_its_first_trial_resumes_as_a_new_one(tmp_path, monkeypatch):
    """A tune stopped while it chose its starting points (an 8B's first 20 s) left a study with no trial: resumed, it
    starts as a new one (the solver, the starting points), where it went on with the sampler alone, 4.5 times
    slower to the same winner."""
    from ckrun.autotune.search.tuner import Tuner
    from ckrun.runner.cli import main
    from test_tune_predict import FOR_GPU

    def args(directory, *extra):
        return ["tune", BERT_TINY, *FOR_GPU, f"output.dir={directory / 'run'}", "--max-mem", "1GB", "--predict",
                "--gpu", "a100-40gb", "--output", str(directory / "tune"), "--trials", "8", *extra]

    class Killed(Exception):
        pass

    def killed(*_args, **_kwargs):
        raise Killed("the tuner's process ends here")

    with monkeypatch.context() as patch:
        patch.setattr(Tuner, "start", killed)
        assert main(args(tmp_path / "cut")) != 0  # said in one line, as any crash of the tuner is
    assert not report_trials(tmp_path / "cut")
    assert main(args(tmp_path / "cut", "--resume")) == 0
    assert main(args(tmp_path / "whole")) == 0
    cut, whole = report(tmp_path / "cut" / "tune"), report(tmp_path / "whole" / "tune")
    assert [t["key"] for t in cut["trials"]] == [t["key"] for t in whole["trials"]]
    assert any(t.get("proposed_by") != "sampler" for t in cut["trials"][:2])  # the starting points came first


def report_trials(directory) -> list:
    """The trials a stopped tune's journal holds."""
    import optuna

    from ckrun.autotune.search.study import STUDY_NAME, _Journal

    storage = optuna.storages.JournalStorage(_Journal(str(directory / "tune" / "study.journal")))
    return optuna.load_study(study_name=STUDY_NAME, storage=storage).trials
