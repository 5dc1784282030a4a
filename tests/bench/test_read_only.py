"""bench/read_only.py's own code path at toy size (--quick: bert_tiny, one run of three commands), so the
script the lead runs for the real numbers cannot rot in between. Times are printed, never asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import read_only
from bench.doc_sections import markers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 20 s of CPU timing a bench script, not the product
def test_the_quick_run_times_each_command_and_writes_its_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    results = read_only.main(["--quick", "--docs", str(doc)])
    assert [(r["command"], r["cache"], r["goal"]) for r in results] == [
        ("ckrun --help", "-", None), ("ckrun validate bert_tiny", "cold", 2.0), ("ckrun validate bert_tiny", "warm", 2.0)]
    assert all(len(r["walls"]) == len(r["cpus"]) == 1 and r["walls"][0] > 0 and r["cpus"][0] > 0 for r in results)
    text = doc.read_text()
    start, end = markers("read_only")
    section = text[text.index(start):text.index(end)]
    assert "| `ckrun validate bert_tiny` | warm |" in section and "< 2 s: " in section
    assert "torch " in section and "transformers " in section and "cores" in section
    assert text.endswith("# Benchmarks\n")  # the page's own text is kept


def test_a_command_that_fails_stops_the_benchmark_with_its_message(tmp_path):
    with pytest.raises(SystemExit, match="no such recipe file or library recipe"):
        read_only.run_once(["validate", "no_such_recipe"], ROOT, tmp_path)
