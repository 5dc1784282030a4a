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
