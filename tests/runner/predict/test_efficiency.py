"""The calibration table: every entry says where its figures come from, the most specific entry wins,
and a campaign's measured entry replaces the one it measures without touching the others."""

from __future__ import annotations

import json
import shutil

import pytest

from ckrun.runner.predict.efficiency import (CALIBRATION_PATH, OP_CLASSES, Calibration, CalibrationEntry, calibration,
                                       write_entry)
from ckrun.runner.predict.gpus import ROWS


def test_every_entry_says_where_its_figures_come_from():
    table = calibration()
    assert "*" in {entry.applies_to for entry in table.entries}
    for entry in table.entries:
        assert entry.source and entry.device and entry.date and entry.versions
        for op_class in OP_CLASSES:
            assert 0 < (entry.efficiency.compute(op_class, "bf16", "flash") if op_class in ("matmul", "conv", "attention")
                        else entry.efficiency.traffic(op_class)) <= 1


def test_the_most_specific_entry_applies():
    table = calibration()
    assert table.entry_for("h100", (9, 0)).applies_to == "sm90"
    assert table.entry_for("a10", (8, 6)).applies_to == "*"
    own = CalibrationEntry(**{**table.entry_for("h100", (9, 0)).model_dump(), "applies_to": "h100"})
    assert Calibration(entries=[*table.entries, own]).entry_for("h100", (9, 0)) is own


def test_each_gpu_row_carries_its_entry():
    for row in ROWS:
        entry = calibration().entry_for(row.key, row.facts.capability)
        assert row.facts.efficiency == entry.efficiency and entry.label() in row.facts.source


def test_a_measured_entry_replaces_only_its_own(tmp_path):
    path = tmp_path / "calibration.json"
    shutil.copy(CALIBRATION_PATH, path)
    before = Calibration.model_validate(json.loads(path.read_text()))
    base = before.entry_for("h100", (9, 0))
    measured = base.model_copy(update={"applies_to": "h100", "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01",
                                       "versions": "torch 2.11.0, CUDA 12.8", "source": "bench/gpu campaign",
                                       "efficiency": base.efficiency.model_copy(update={"memory": 0.85})})
    try:
        write_entry(measured, path)
        write_entry(measured, path)  # again: still one entry for h100
        after = Calibration.model_validate(json.loads(path.read_text()))
    finally:
        calibration.cache_clear()
    assert [e.applies_to for e in after.entries].count("h100") == 1
    assert after.entry_for("h100", (9, 0)) == measured
    assert {e.applies_to: e for e in after.entries if e.applies_to != "h100"} == \
        {e.applies_to: e for e in before.entries}


def test_a_bad_share_is_refused():
    entry = calibration().entries[0].model_dump()
    entry["efficiency"]["memory"] = 1.5
    with pytest.raises(ValueError):
        CalibrationEntry.model_validate(entry)
