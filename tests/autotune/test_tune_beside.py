"""`ckrun tune --predict` with a second pricer (autotune/probes/beside.py): the same search, plan for plan and byte
for byte, as without one; only where its traces were made differs. Run through the CLI, as a user runs it."""

from __future__ import annotations

import os

import pytest

from ckrun.autotune.probes.beside import SWITCH_ENV
from ckrun.runner.cli import main
from conftest import BERT_TINY
from test_tune_predict import FOR_GPU
from tune_helpers import launches, report, survivors

CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
SEEN = ("number", "key", "state", "measured_peak", "step_s", "samples_per_s", "proposed_by")


def _tune(tmp_path, monkeypatch, switch: str) -> dict:
    monkeypatch.setenv(SWITCH_ENV, switch)
    out = tmp_path / switch
    code = main(["tune", BERT_TINY, *FOR_GPU, f"output.dir={out / 'run'}", "--max-mem", "1GB", "--predict", "--gpu",
                 "a100-40gb", "--output", str(out / "tune"), "--trials", "20", "--allow-lossy"])
    assert code == 0
    return report(out / "tune")


@pytest.mark.skipif(CPUS < 2, reason="a second pricer needs a second CPU")
def test_a_search_with_a_second_pricer_prices_every_plan_as_one_without(tmp_path, monkeypatch, caplog):
    alone = _tune(tmp_path, monkeypatch, "off")
    with caplog.at_level("INFO", logger="ckrun.autotune"):
        beside = _tune(tmp_path, monkeypatch, "on")
    assert "traced_beside" not in alone["screening"] and "traced_beside" in beside["screening"]
    assert any("a second process makes traces beside this one" in r.getMessage() for r in caplog.records)
    assert not any("second pricer stopped" in r.getMessage() for r in caplog.records)
    assert [[t.get(k) for k in SEEN] for t in beside["trials"]] == [[t.get(k) for k in SEEN] for t in alone["trials"]]
    assert beside["winner"] == alone["winner"] and len(alone["trials"]) >= 20
    started = [launch["pid"] for launch in launches(tmp_path / "on" / "tune") if launch["what"] == "beside"]
    assert len(started) == 1 and not survivors(started)  # gone with the search
