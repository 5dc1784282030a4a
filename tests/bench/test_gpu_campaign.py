"""The GPU campaign (bench/gpu/) run with --dry-run at toy size on the CPU, so that the scripts a
lent GPU gets a few minutes for cannot rot in between; tune.py's verdict from given probe results;
and the allocator replay, fed a step whose real reserved bytes are known."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import children

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is no installed package; a bare `pytest` does not put the root on the path
    sys.path.insert(0, str(ROOT))

from bench.gpu import snapshot  # noqa: E402

MiB = 1 << 20


def _command(script: str, *args) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "gpu" / script), *map(str, args)]


def _run(*args) -> subprocess.CompletedProcess:
    done = children.run(_command(*args), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    """Calls 1 and 2 dry: facts, the committed predictions (--predict-only), then the plans judged by them."""
    out = tmp_path_factory.mktemp("gpu-campaign")
    _run("facts.py", out, "--dry-run")
    _run("plans.py", out / "committed", "--dry-run", "--predict-only")
    _run("plans.py", out, "--dry-run", "--predicted", out / "committed" / "predicted.json")
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_facts_dry_run_reports_versions_and_no_cuda_facts(campaign):
    facts = _json(campaign / "facts.json")
    assert facts["dry_run"] is True
    assert {"date", "python", "torch", "transformers", "optuna", "pydantic", "device"} <= set(facts["versions"])
    assert all(facts[probe] is None for probe in ("context", "cublas", "attention", "bandwidth"))


def test_plans_dry_run_measures_counts_and_predicts_every_cpu_plan(campaign):
    plans = _json(campaign / "plans.json")
    entries = {(p["name"], p["micro_batch"]): p for p in plans["plans"]}
    assert len(entries) == 14  # 6 plans and the repeat of none, at micro-batches 4 and 8
    for (name, _micro), plan in entries.items():
        if "offload" in name:
            assert plan["status"] == "skipped" and "needs CUDA" in plan["reason"]
            continue
        assert plan["status"] == "ok", plan
        assert len(plan["losses"]) == 2 and plan["step_time_s"] > 0 and plan["samples_per_s"] > 0
        assert plan["mfu"] is None and plan["flops"] > 0
        # the committed (predict-only) run and the re-prediction agree, and CPU predictions are exact
        assert plan["predicted_bytes"] == plan["predicted_here_bytes"]
        assert abs(plan["error"]) < 0.01
        assert plan.get("loss_within_noise", name == "none") is True  # none is the reference itself
    # counted, not assumed: full checkpointing recomputes every block's forward
    assert entries[("full", 4)]["flops"] > entries[("every 2", 4)]["flops"] > entries[("none", 4)]["flops"]
    assert plans["noise_floor"] == {"4": 0.0, "8": 0.0}  # CPU steps are deterministic
    assert plans["predictions_from"].startswith("predicted.json")
    assert plans["summary"]["plans"] == 8 and plans["snapshot"]["status"] == "skipped"
    assert set(_json(campaign / "committed" / "predicted.json")["predictions"]) == {
        f"{name} @ {micro}" for name in ("none", "full", "every 2", "selective") for micro in (4, 8)}


def test_tables_turn_the_results_into_markdown(campaign):
    markdown = _run("tables.py", campaign).stdout
    for heading in ("# ckrun on a GPU", "## Memory facts", "## Plans on recipes/bert_tiny.yaml"):
        assert heading in markdown
    assert "Dry run" in markdown and "| full | 4 |" in markdown and "skipped: needs CUDA" in markdown
    assert "Allocator replay: dry run" in markdown and "## Tuning" not in markdown


def _probed(candidate: dict, *samples_per_s: float) -> dict:
    runs = [{"status": "ok", "samples_per_s": s, "card_peak_bytes": 50_000_000} for s in samples_per_s]
    return {**candidate, "runs": runs}


def test_tune_verdict_compares_medians_with_the_goals():
    """tune.py's ratios and table from given probe results (the dry run itself: below)."""
    from bench.gpu import tables, tune

    full, none_whole, none_half, every_2 = tune.other_candidates(tune.DRY_RUN)
    tuned = {**none_half, "name": "tuned", "role": "tuned", "source": "tuned.yaml"}
    candidates = [_probed(tuned, 90, 100), _probed(full, 70, 80), _probed(none_whole, 95, 105),
                  _probed(none_half, 100, 98), _probed(every_2, 60, 60)]
    results = {"recipe": "r.yaml", "cap_text": "100MB", "cap_bytes": 100_000_000, "time_budget": "20s",
               "tune": {"exit_code": 0, "seconds": 20.0, "trials": 4}}
    tune.conclude(results, candidates)
    assert results["ratios"]["tuned_vs_fastest_unconstrained"] == pytest.approx(95 / 100)  # none @ 8: median 100
    assert results["ratios"]["tuned_vs_full_checkpointing"] == pytest.approx(95 / 75)
    assert results["tuned_peak"] == {"card_peak_bytes": 50_000_000, "cap_bytes": 100_000_000, "within_cap": True}
    table = tables.tune_table(results)
    assert "0.95 (goal >= 0.97: MISSED)" in table and "1.27 (goal >= 1.25: met)" in table
    assert "| tuned | micro-batch 4, checkpointing none | 90.0, 100.0 | 95.0 | 0.05 |" in table


# about 75 s on 2 cores (`ckrun tune` and five probes, each a fresh process importing torch): in the default
# run all the same, so that CI keeps the whole campaign's dry run alive
def test_tune_dry_run_tunes_then_compares_the_tuned_plan(tmp_path, campaign):
    _run("tune.py", tmp_path, "--dry-run")
    tune = _json(tmp_path / "tune.json")
    assert tune["tune"]["exit_code"] == 0 and not tune["tune"]["timed_out"]
    assert (tmp_path / "tuned.yaml").exists() and (tmp_path / "tune_report.json").exists()
    names = [c["name"] for c in tune["candidates"]]
    assert names == ["tuned", "full checkpointing, one pass", "none @ 8", "none @ 4", "every 2 @ 8"]
    assert all(r["status"] == "ok" for c in tune["candidates"] for r in c["runs"])
    assert tune["ratios"]["tuned_vs_fastest_unconstrained"] > 0 and tune["ratios"]["tuned_vs_full_checkpointing"] > 0
    assert tune["tuned_peak"]["within_cap"] is True and tune["cap_bytes"] == 100_000_000
    markdown = _run("tables.py", campaign, tmp_path).stdout
    assert "## Plans on" in markdown and "## Tuning recipes/bert_tiny.yaml under 100MB" in markdown


# --- the allocator replay, on a step whose real reserved bytes are known ----------------------------


BASE = 0x7F0000000000


def _known_step() -> dict:
    """At start: a 20 MiB large segment (4 MiB live, 16 MiB free) and a 2 MiB small one (512 B live).
    The step puts 8 MiB in the free space, needs a new 30 MiB segment, then frees both."""
    small = BASE + 64 * MiB
    return {"start_segments": [
        {"address": BASE, "total_size": 20 * MiB, "segment_type": "large", "stream": 0,
         "blocks": [[BASE, 4 * MiB, "active_allocated"], [BASE + 4 * MiB, 16 * MiB, "inactive"]]},
        {"address": small, "total_size": 2 * MiB, "segment_type": "small", "stream": 0,
         "blocks": [[small, 512, "active_allocated"], [small + 512, 2 * MiB - 512, "inactive"]]}],
        "events": [["alloc", BASE + 4 * MiB, 8 * MiB, 0], ["segment_alloc", BASE + 32 * MiB, 30 * MiB, 0],
                   ["alloc", BASE + 32 * MiB, 30 * MiB - 100, 0], ["free_requested", BASE + 32 * MiB, 30 * MiB, 0],
                   ["free_completed", BASE + 32 * MiB, 30 * MiB, 0], ["free_requested", BASE, 4 * MiB, 0],
                   ["free_completed", BASE, 4 * MiB, 0]]}


def test_replay_of_a_known_step_matches_its_real_reserved_bytes():
    found = snapshot.replay(_known_step())
    assert found["real_reserved_start_bytes"] == found["model_reserved_start_bytes"] == 22 * MiB
    assert found["real_reserved_peak_bytes"] == found["model_reserved_peak_bytes"] == 52 * MiB
    assert found["replay_error"] == 0.0 and found["freed_on"] == "free_completed"
    # live at start 4 MiB + 512 B; the step adds 8 MiB and 30 MiB (rounded up to 512 B) before any free
    assert found["model_peak_allocated_bytes"] == 4 * MiB + 512 + 8 * MiB + 30 * MiB


def test_seeded_model_reuses_the_free_blocks_it_was_given():
    model = snapshot.seed_model(_known_step()["start_segments"])
    assert (model.reserved, model.allocated) == (22 * MiB, 4 * MiB + 512)
    model.alloc("fits", 16 * MiB)  # exactly the large segment's free block
    model.alloc("small", 2 * MiB - 512 - 1024)  # the large pool: over 1 MiB
    assert model.reserved == 22 * MiB + 20 * MiB


def test_reduce_keeps_the_steps_events_and_block_addresses():
    trace = [{"action": "snapshot", "addr": 0, "size": 0, "stream": 0, "frames": []}]
    start = {"segments": [{"device": 0, "address": BASE, "total_size": 20 * MiB, "segment_type": "large",
                           "stream": 0, "blocks": [{"size": 4 * MiB, "state": "active_allocated"},
                                                   {"size": 16 * MiB, "state": "inactive"}]}],
             "device_traces": [list(trace)]}
    step = [{"action": "alloc", "addr": BASE + 4 * MiB, "size": 2 * MiB, "stream": 0, "frames": [], "time_us": 1}]
    end = {"segments": [], "device_traces": [trace + step + trace]}
    compact = snapshot.reduce(start, end, 0)
    assert compact["events"] == [["alloc", BASE + 4 * MiB, 2 * MiB, 0], ["snapshot", 0, 0, 0]]
    assert compact["start_segments"][0]["blocks"] == [[BASE, 4 * MiB, "active_allocated"],
                                                      [BASE + 4 * MiB, 16 * MiB, "inactive"]]
    replayed = snapshot.replay(compact)
    assert replayed["model_reserved_peak_bytes"] == replayed["real_reserved_peak_bytes"] == 20 * MiB
    assert replayed["other_actions"] == ["snapshot"]
