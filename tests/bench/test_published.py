"""bench/published.py kept from rotting: every setup's recipe and overrides still validate and cite their
source, the headline figures come out of made-up predictions as the goals define them, and (slow) two toy
setups run through the real `ckrun estimate` subprocesses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is no installed package; a bare `pytest` does not put the root on the path
    sys.path.insert(0, str(ROOT))

from bench import published  # noqa: E402
from ckrun.runner.recipe.load import load_recipe  # noqa: E402
from ckrun.runner.predict.hardware import resolve_device  # noqa: E402


@pytest.mark.parametrize("setup", [*published.SETUPS, *published.RATIO_SETUPS, *published.QUICK, *published.HELDOUT],
                         ids=lambda setup: setup.key)
def test_every_setup_is_a_valid_recipe_with_its_source(setup):
    recipe = load_recipe(ROOT / "bench" / "published" / f"{setup.recipe}.yaml", list(setup.overrides))
    assert resolve_device(str(ROOT / setup.gpu) if setup.gpu.endswith(".json") else setup.gpu).kind == "cuda"
    assert setup.source.startswith("https://") and setup.quote
    if setup.nproc:
        groups = recipe.distributed.data_parallel(setup.nproc)
        assert recipe.train.batch_size % groups == 0 and recipe.distributed.strategy in ("fsdp", "hsdp", "tp")


def test_the_held_out_mpt_rows_are_the_tables_model_sizes():
    """The MPT recipe is GPT-2's architecture at MPT's sizes: its parameter count is the table's NumParams."""
    from ckrun.runner.builders.model import build_model

    for setup in (s for s in published.HELDOUT if s.key in ("mpt-760m-a100", "mpt-1b-h100")):
        recipe = load_recipe(ROOT / "bench" / "published" / f"{setup.recipe}.yaml", list(setup.overrides))
        model = build_model(recipe.model, "meta", weights=False)  # shapes only: nothing allocated
        count = sum(p.numel() for p in model.parameters())
        assert count == int(setup.quote.split("|")[-2]), setup.key
    command = setup.command()
    assert command[:3] == ["ckrun", "estimate", f"bench/published/{setup.recipe}.yaml"] and "--json" in command


def test_every_overhead_pairs_two_setups_that_differ_only_in_checkpointing():
    keys = {setup.key: setup for setup in (*published.SETUPS, *published.RATIO_SETUPS)}
    for overhead in published.OVERHEADS:
        base, plan = keys[overhead.base], keys[overhead.plan]
        assert base.recipe == plan.recipe and base.gpu == plan.gpu and base.nproc == plan.nproc
        differ = set(base.overrides) ^ set(plan.overrides)
        assert all(item.startswith("memory.checkpointing=") for item in differ), differ


def _result(key: str, published_value: float, predicted: float, seconds: float, mismatch: str = ""):
    setup = published.Setup(key, published.TITAN, "row", published_value, "tokens/s", "llama2_13b", "a100",
                            mismatch=mismatch)
    return published.Result(setup, predicted, seconds)


def test_the_headline_is_the_faithful_setups_median_and_the_overheads_are_step_time_ratios():
    results = {r.setup.key: r for r in (
        _result("a", 100, 110, 1.0), _result("b", 200, 180, 1.0), _result("c", 400, 500, 1.0),
        _result("d", 50, 200, 1.0, mismatch="another kernel"))}
    base, plan = _result("base", 0, 1, 2.0), _result("plan", 0, 1, 2.5)  # overheads only: no throughput row
    base.compute_s = 1.25  # the rest of its step is no layer's (the optimizer's step)
    results.update({"base": base, "plan": plan})
    overhead = published.Overhead("x", "base", "plan", 0.2, published.TITAN, "row")
    per_layer = published.Overhead("y", "base", "plan", 0.4, published.KORTHIKANTI, "row", per_layer=True)
    figures = published.summary(results, (overhead, per_layer))
    assert figures["faithful"] == 3 and figures["setups"] == 4
    assert figures["median_abs_error"] == pytest.approx(0.1)  # of +10 %, -10 %, +25 %
    assert figures["worst_abs_error"] == pytest.approx(0.25)
    assert figures["worst_any"] == pytest.approx(3.0)  # the mismatched row counts among all, not the faithful
    assert figures["median_all"] == pytest.approx((0.1 + 0.25) / 2)  # the headline keeps every row: all four
    assert figures["spearman_faithful"] == pytest.approx(1.0) and figures["spearman_all"] == pytest.approx(0.4)
    assert figures["overheads"][0]["predicted"] == pytest.approx(0.25)
    assert figures["overheads"][0]["points"] == pytest.approx(5.0)
    assert figures["overheads"][1]["predicted"] == pytest.approx(0.4)  # 0.5 s more over 1.25 s of layers
    text = published.table(results, figures, ["- gpu"], "versions", 60.0)
    assert "| d |" in text and "no: another kernel" in text and "+5.0 points" in text
    assert "Over all 4 setups, the 1 ckrun cannot express faithfully included" in text and "median 17.5 %" in text


@pytest.mark.slow
def test_the_quick_run_goes_through_ckrun_estimate(tmp_path):
    assert published.main(["--quick", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    assert set(record["results"]) == {"quick-bert", "quick-llama"}
    for result in record["results"].values():
        assert result["predicted"] > 0 and result["seconds"] > 0 and result["breakdown"]


def test_recorded_predictions_are_read_back_against_the_current_setups(tmp_path):
    from dataclasses import asdict

    setup = published.SETUPS[0]
    result = published.Result(setup, 123.0, 0.5, 0.4, 7.0, 60.0, "", {"activations": 1.0})
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": {setup.key: {**asdict(result), "setup": asdict(setup)}}}))
    back = published.recorded(path, published.SETUPS)
    assert list(back) == [setup.key] and back[setup.key] == result
