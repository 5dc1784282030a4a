"""The search judged against an oracle (`-m slow`: 75 s on 2 cores): a 4-block BERT whose 30
plans the predictor scores once, then `ckrun tune`'s own search with a quarter of the probes, at a
tight, a middle and a loose cap, with and without noise. A change that makes the search choose
worse fails here, whatever the machine is doing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def oracle_bench():
    spec = importlib.util.spec_from_file_location("tune_oracle", ROOT / "bench" / "tune_oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 75 s: the grid scored, then six searches
def test_the_search_reaches_the_oracles_best_within_a_quarter_of_the_grid(tmp_path, oracle_bench):
    results = oracle_bench.main(["--quick", "--out", str(tmp_path)])
    assert [r["cap_name"] for r in results] == ["tight", "middle", "loose"]
    for row in results:
        for run in (row["quiet"], row["noisy"]):
            assert run["ratio"] >= 0.98, row
            assert 0 < run["probes"] * oracle_bench.SHARE <= row["grid"], row
    caps = [row["cap"] for row in results]
    assert caps == sorted(caps) and len(set(caps)) == 3
    tight = results[0]
    assert tight["quiet"]["best_speed"] < tight["uncapped"]  # the tight cap binds: the search had to choose
    assert (tmp_path / "oracle-tiny_bert.json").exists() and (tmp_path / "results.json").exists()


def test_caps_lie_between_the_smallest_and_largest_peak_and_never_past_the_card(oracle_bench):
    rows = [{"peak": 100}, {"peak": 300}, {"invalid": "x"}, {"peak": 500}]
    caps = oracle_bench.caps(rows, memory_bytes=10_000)
    assert [c.limit for c in caps.values()] == [159, 299, 439]  # 15 %, 50 %, 85 % of the way (rounded down)
    small = oracle_bench.caps(rows, memory_bytes=400)
    assert all(c.bytes <= 400 for c in small.values())


def test_a_section_between_markers_is_replaced_in_place(tmp_path):
    from bench.doc_sections import markers, write_section

    path = tmp_path / "doc.md"
    start, end = markers("x")
    path.write_text(f"# head\n{start}\nold\n{end}\n## tail\n")
    write_section(path, "x", "new")
    assert path.read_text() == f"# head\n{start}\nnew\n{end}\n## tail\n"
    write_section(path, "y", "other")
    assert path.read_text().startswith(f"{markers('y')[0]}\nother\n{markers('y')[1]}\n\n# head")
