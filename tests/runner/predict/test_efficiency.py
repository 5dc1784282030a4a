"""The calibration table: every figure is a row with its own source, the most specific entry's figure wins
over the less specific ones', and a campaign's measured entry replaces the one it measures without touching
the others."""

from __future__ import annotations

import json
import shutil

import pytest

from ckrun.runner.predict.efficiency import (CALIBRATION_PATH, OP_CLASSES, Calibration, CalibrationEntry, Efficiency,
                                             Figure, calibration, write_entry)
from ckrun.runner.predict.gpus import ROWS


def test_every_figure_is_a_row_with_its_source():
    table = calibration()
    assert "*" in {entry.applies_to for entry in table.entries}
    for entry in table.entries:
        assert entry.source and entry.device and entry.date and entry.versions
        assert entry.figures and all(f.source and f.figure.split(".")[0] in Efficiency.model_fields for f in entry.figures)
    merged = table.entry_for("h100", (9, 0)).efficiency
    for op_class in OP_CLASSES:
        assert 0 < (merged.compute(op_class, "bf16", "flash") if op_class in ("matmul", "conv", "attention")
                    else merged.traffic(op_class)) <= 1


def test_the_most_specific_figure_applies():
    table = calibration()
    hopper, ampere = table.entry_for("h100", (9, 0)), table.entry_for("a10", (8, 6))
    assert hopper.applies_to == "sm90" and ampere.applies_to == "*"
    assert hopper.efficiency.attention["flash"] != ampere.efficiency.attention["flash"]  # sm90's own figure
    assert hopper.efficiency.optimizer == ampere.efficiency.optimizer  # sm90 gives none: '*''s
    own = CalibrationEntry(applies_to="h100", figures=(Figure(figure="memory", value=0.5, source="a test"),),
                           source="test", device="d", date="2026-12-01", versions="v")
    mine = Calibration(entries=[*table.entries, own]).entry_for("h100", (9, 0))
    assert mine.applies_to == "h100" and mine.efficiency.memory == 0.5
    assert mine.efficiency.attention == hopper.efficiency.attention


def test_each_gpu_row_carries_its_entry():
    for row in ROWS:
        entry = calibration().entry_for(row.key, row.facts.capability)
        assert row.facts.efficiency == entry.efficiency and entry.label() in row.facts.source


def test_a_measured_entry_replaces_only_its_own(tmp_path):
    path = tmp_path / "calibration.json"
    shutil.copy(CALIBRATION_PATH, path)
    before = Calibration.model_validate(json.loads(path.read_text()))
    measured = CalibrationEntry(applies_to="h100", figures=(Figure(figure="memory", value=0.85, source="campaign"),),
                                device="NVIDIA H100 80GB HBM3", date="2026-12-01", versions="torch 2.11.0, CUDA 12.8",
                                source="bench/gpu campaign")
    try:
        write_entry(measured, path)
        write_entry(measured, path)  # again: still one entry for h100
        after = Calibration.model_validate(json.loads(path.read_text()))
    finally:
        calibration.cache_clear()
    assert [e.applies_to for e in after.entries].count("h100") == 1
    assert after.entry_for("h100", (9, 0)).efficiency.memory == 0.85
    assert {e.applies_to: e for e in after.entries if e.applies_to != "h100"} == \
        {e.applies_to: e for e in before.entries}


def test_a_bad_share_or_a_figure_twice_is_refused():
    entry = calibration().entries[0].model_dump()
    entry["figures"] = [{**f, "value": 1.5} if f["figure"] == "memory" else f for f in entry["figures"]]
    with pytest.raises(ValueError):
        CalibrationEntry.model_validate(entry).efficiency  # noqa: B018 - building it is the check
    twice = calibration().entries[0].model_dump()
    twice["figures"] = [*twice["figures"], twice["figures"][0]]
    with pytest.raises(ValueError, match="given twice"):
        CalibrationEntry.model_validate(twice)
    unknown = {**calibration().entries[0].model_dump(), "figures": [{"figure": "speed", "value": 1, "source": "x"}]}
    with pytest.raises(ValueError, match="no such figure"):
        CalibrationEntry.model_validate(unknown)
