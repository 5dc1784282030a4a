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
    assert {"date", "python", "torch", "transformers", "optuna", "pydantic", "device", "alloc_conf",
            "alloc_conf_generic", "alloc_in_effect"} <= set(facts["versions"])
    assert all(facts[probe] is None for probe in ("context", "cublas", "attention", "bandwidth", "matmul"))
    assert facts["cuda_tests"] == {"status": "not run", "reason": "dry run"}
    assert facts["budget"]["spent_s"] < facts["budget"]["budget_s"]


PLAN_NAMES = ("none", "none (repeat)", "full", "every 2", "selective", "offload all", "offload all + full", "solver",
              "compile")


def test_plans_dry_run_measures_counts_and_predicts_every_cpu_plan(campaign):
    plans = _json(campaign / "plans.json")
    entries = {(p["name"], p["micro_batch"]): p for p in plans["plans"]}
    assert set(entries) == {(name, micro) for name in PLAN_NAMES for micro in (4, 8)}
    assert [p["name"] for p in plans["plans"]][-1] == "compile"  # last at each micro-batch: the budget's first victim
    for (name, _micro), plan in entries.items():
        if "offload" in name:
            assert plan["status"] == "skipped" and "needs CUDA" in plan["reason"]
            continue
        assert plan["status"] == "ok", plan
        assert len(plan["losses"]) == 2 and plan["step_time_s"] > 0 and plan["samples_per_s"] > 0
        assert plan["mfu"] is None and plan["hfu"] is None and plan["hardware_flops"] > 0  # no peak rate on a CPU
        assert plan["predicted_bytes"] == plan["predicted_here_bytes"]  # committed and re-predicted agree
        assert "predicted_step_s" not in plan  # no time model has filled the committed predictions yet
        assert plan.get("loss_within_noise", name == "none") is True  # none is the reference itself
    for name in ("none", "full", "every 2", "selective", "solver"):  # the CPU estimate is exact for eager plans
        assert all(abs(entries[(name, micro)]["error"]) < 0.01 for micro in (4, 8))
    # counted, not assumed: full checkpointing recomputes every block's forward; MFU's FLOPs are none's
    flops = {name: entries[(name, 4)]["hardware_flops"] for name in ("none", "every 2", "full", "compile")}
    assert flops["full"] > flops["every 2"] > flops["none"] == flops["compile"] == plans["model_flops"]
    assert entries[("full", 8)]["hardware_flops"] == flops["full"]  # counted once: the same global batch
    assert plans["noise_floor"] == {"4": 0.0, "8": 0.0}  # CPU steps are deterministic
    assert plans["predictions_from"].startswith("predicted.json")
    assert plans["summary"]["plans"] == 12 and plans["snapshot"]["status"] == "skipped"
    committed = _json(campaign / "committed" / "predicted.json")
    assert set(committed["predictions"]) == {f"{name} @ {micro}" for name in PLAN_NAMES[2:]
                                            for micro in (4, 8) if "offload" not in name} | {"none @ 4", "none @ 8"}
    # the solver's plan recomputes some blocks, not all and not none (its limit lies between the two)
    assert all(solved["memory"]["checkpointing"]["policy"] == "layers" for solved in committed["solver"].values())
    assert plans["solver"] == committed["solver"]


def test_plans_keeps_to_its_budget(tmp_path, campaign):
    """A budget shorter than a plan: every plan is left out with the reason, or, where even the setup
    outlasts it, the watchdog writes plans.json and leaves with 124 (as `timeout` does); nothing runs."""
    done = children.run(_command("plans.py", tmp_path, "--dry-run", "--only", "none,compile", "--budget-s", "2",
                                 "--predicted", campaign / "committed" / "predicted.json"),
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode in (0, 124), done.stderr[-3000:]
    plans = _json(tmp_path / "plans.json")
    assert not [p for p in plans["plans"] if p["status"] == "ok"]
    if done.returncode == 124:
        assert plans["budget"]["stopped"] == "at the deadline, in the middle of a plan"
    else:
        assert plans["plans"] and all("of the call's budget left" in p["reason"] for p in plans["plans"])


def test_tables_turn_the_results_into_markdown_with_every_figure(campaign, tmp_path):
    target = tmp_path / "benchmarks_gpu.md"
    _run("tables.py", campaign, "--out", target)
    markdown = target.read_text(encoding="utf-8")
    for heading in ("# ckrun on a GPU", "## Figures", "## Memory facts", "## Plans on recipes/bert_tiny.yaml"):
        assert heading in markdown
    for figure in ("P1", "P2", "P4", "P5", "P6", "cap"):
        assert f"| {figure} |" in markdown
    assert "Dry run" in markdown and "| full | 4 |" in markdown and "skipped: needs CUDA" in markdown
    assert "| P4 | predicted vs measured peak (reserved), absolute error: median; worst | 0.0% (goal <= 3.0%: met)" \
        in markdown
    assert "not predicted" in markdown and "Allocator replay: dry run" in markdown and "## Tuning" not in markdown


def test_tables_without_results_say_every_figure_waits():
    markdown = _run("tables.py").stdout
    rows = [line for line in markdown.splitlines() if line.startswith("| P") or line.startswith("| cap")]
    assert len(rows) == 6 and all(row.endswith("| not measured |") or "eager not measured; compiled not measured"
                                  in row for row in rows)
    assert "every figure waits for a lent GPU" in markdown


def test_mfu_counts_the_models_flops_and_hfu_the_plans():
    """Full checkpointing runs 4/3 of the model's FLOPs: its HFU is 4/3 of its MFU, not its MFU."""
    from bench.gpu import plan_results

    plan = lambda name, seconds, flops=None: {"name": name, "key": f"{name} @ 16", "micro_batch": 16,  # noqa: E731
                                               "status": "ok", "step_time_s": seconds, "flops": flops}
    results = {"peak_flops_per_s": 1000.0, "plans": [plan("none", 1.0, 300), plan("full", 1.2, 400),
                                                      plan("compile", 0.6), plan("full", 1.5)]}
    results["plans"][-1]["micro_batch"] = 64  # not counted again: the same global batch
    plan_results.attach_rates(results)
    none, full, compiled, full_64 = results["plans"]
    assert (none["mfu"], none["hfu"]) == (pytest.approx(0.3), pytest.approx(0.3))
    assert (full["mfu"], full["hfu"]) == (pytest.approx(0.25), pytest.approx(1 / 3))
    assert (compiled["mfu"], compiled["hfu"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (full_64["mfu"], full_64["hfu"]) == (pytest.approx(0.2), pytest.approx(400 / 1.5 / 1000))
    results["summary"] = {}
    assert plan_results.figures(results)["P6"] == {"eager_mfu": pytest.approx(0.3), "eager_plan": "none @ 16",
                                                   "compiled_mfu": pytest.approx(0.5), "compiled_plan": "compile @ 16",
                                                   "goals": (0.35, 0.45)}


def _probed(candidate: dict, *samples_per_s: float) -> dict:
    runs = [{"status": "ok", "samples_per_s": s, "card_peak_bytes": 95_000_000} for s in samples_per_s]
    return {**candidate, "runs": runs}


def test_tune_verdict_compares_medians_with_the_goals():
    """tune_verdict's ratios and tables' lines from given probe results (the dry run itself: below)."""
    from bench.gpu import tables, tune, tune_verdict

    setup = tune.DRY_RUN
    recipe = tune.full_checkpointing(setup)["recipe"]
    tuned = {"name": "tuned", "role": "tuned", "source": "tuned.yaml", "recipe": recipe, "search_samples_per_s": 99}
    uncapped = {**tuned, "name": "fastest uncapped", "role": "uncapped", "search_samples_per_s": 100}
    candidates = [_probed(tuned, 90, 100), _probed(uncapped, 100, 98), _probed(tune.full_checkpointing(setup), 70, 80),
                  _probed(tune.hf_candidate(setup), 60, 80)]
    results = {"recipe": "r.yaml", "cap_text": "100MB", "cap_bytes": 100_000_000,
               "tune": {"exit_code": 0, "timed_out": False, "seconds": 200.0, "command": ["-m", "runner", "tune"]}}
    tune_verdict.conclude(results, candidates)
    ratios = results["ratios"]
    assert ratios["tuned_vs_fastest_uncapped"] == pytest.approx(95 / 99)
    assert ratios["tuned_vs_fastest_uncapped_in_the_searches"] == pytest.approx(0.99)
    assert ratios["tuned_vs_hf_full_checkpointing"] == pytest.approx(95 / 70)
    assert ratios["tuned_vs_full_checkpointing"] == pytest.approx(95 / 75)
    assert results["tuned_peak"]["within_cap"] and results["tuned_peak"]["cap_used"] == pytest.approx(0.95)
    table, figures = tables.tune_table(results), tables.figures_table({"tune": results})
    assert "tuned / fastest uncapped: 0.96 (goal >= 0.97: MISSED)" in table
    assert "tuned / HF gradient checkpointing: 1.36 (goal >= 1.25: met)" in table
    assert "| tuned | micro-batch 8, checkpointing full, fp32 | 90.0, 100.0 | 95.0 | 99.0 | 0.10 |" in table
    assert "| P5 | `ckrun tune` under 40 GB, wall time | 3.3 min (goal <= 10 min: met) |" in figures
    assert "95.0% used (goal >= 90%: met)" in figures


# about 100 s on 2 busy cores (two `ckrun tune` searches, four measurements, each a fresh process importing
# torch): in the default run all the same, so that CI keeps the whole campaign's dry run alive
def test_tune_dry_run_tunes_twice_then_compares_the_tuned_plan(tmp_path, campaign):
    _run("tune.py", tmp_path, "--dry-run")
    tune = _json(tmp_path / "tune.json")
    for search in ("tune", "uncapped_tune"):
        assert tune[search]["exit_code"] == 0 and not tune[search]["timed_out"], tune[search]
    assert "--search-compile" in tune["tune"]["command"] and tune["uncapped_tune"]["cap"] == "100GB"
    assert {"tuned_tuned.yaml", "tuned_report.json", "uncapped_tuned.yaml", "uncapped_report.json",
            "tuned_search.log", "uncapped_search.log"} <= {p.name for p in tmp_path.iterdir()}
    assert [c["role"] for c in tune["candidates"]] == ["tuned", "uncapped", "hf_full_checkpointing",
                                                      "full_checkpointing"]
    assert all(r["status"] == "ok" for c in tune["candidates"] for r in c["runs"]), tune["candidates"]
    assert all(tune["ratios"][k] > 0 for k in ("tuned_vs_fastest_uncapped", "tuned_vs_hf_full_checkpointing"))
    assert tune["tuned_peak"]["within_cap"] is True and tune["cap_bytes"] == 100_000_000
    assert tune["budget"]["spent_s"] < tune["budget"]["budget_s"]
    markdown = _run("tables.py", campaign, tmp_path).stdout
    assert "## Plans on" in markdown and "## Tuning recipes/bert_tiny.yaml under 100MB" in markdown
    assert "| P1 | tuned under 40 GB / fastest uncapped plan of the same search | not measured |" not in markdown


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


def test_predicted_step_times_are_compared_with_the_measured_ones():
    """The plans table puts the time model beside the measured steps: per card, ranked and as an error."""
    from bench.gpu.plan_results import step_on
    from bench.gpu.tables import _step_time_lines

    assert step_on({"NVIDIA H100 80GB HBM3": 0.2, "NVIDIA H200": 0.18}, "NVIDIA H200") == 0.18
    assert step_on({"NVIDIA H100 80GB HBM3": 0.2}, "NVIDIA L4") is None and step_on(0.3, "any") == 0.3
    plans = [{"status": "ok", "step_time_s": m, "predicted_step_s": p} for m, p in ((1.0, 0.9), (2.0, 2.4), (3.0, 2.7))]
    line = _step_time_lines(plans + [{"status": "oom"}])[-1]
    assert "over 3 plans" in line and "rank correlation 1.00" in line and "median error 10.0%" in line
    assert "not compared" in _step_time_lines(plans[:1])[-1]
