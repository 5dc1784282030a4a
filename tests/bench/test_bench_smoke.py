"""The CPU benchmarks of the tuner and the solver run end to end at toy size (--quick), so that the
scripts the lead runs for the real numbers cannot rot in between. Minutes each: marked slow."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import children

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, *args: str) -> str:
    done = children.run([sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out), *args],
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_per_block_quick_compares_the_solver_with_the_rules_that_fit(tmp_path):
    text = _run("per_block.py", tmp_path)
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["peaks"]["full"] <= result["limit"] < result["peaks"]["every:2"]
    assert "solver" in result["measured"] and "full" in result["measured"]
    assert "every:2" not in result["measured"]  # over the limit by construction
    assert "solver faster than every uniform rule that fits:" in text


@pytest.mark.slow
def test_tune_vs_grid_quick_reports_the_solvers_first_plan(tmp_path):
    text = _run("tune_vs_grid.py", tmp_path, "--cases", "gpt2")
    result = json.loads((tmp_path / "gpt2" / "results.json").read_text())
    grid = json.loads((tmp_path / "gpt2" / "grid.json").read_text())
    assert result["grid_probes"] == len(grid) and result["tuner_probes"] >= 1
    assert "solver's first plan" in text and (tmp_path / "benchmarks_tune.md").exists()
