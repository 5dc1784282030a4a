"""The GPU campaign (bench/gpu/) kept from rotting between lent GPUs: the whole call, `bash
bench/gpu/call.sh --dry-run`, runs every step's real script at toy size on the CPU; its accounting must
fit the 9-minute call with the machine's start included, and each step's results must be on disk when
the step ends. The driver's budget rules run on stand-in steps (sleeping children) in seconds. Then
the pieces fed known inputs: tune's verdict, MFU and HFU, the knob detection, the allocator replay."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from filelock import FileLock
from hypothesis import given, settings
from hypothesis import strategies as st

import children

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # bench/ is no installed package; a bare `pytest` does not put the root on the path
    sys.path.insert(0, str(ROOT))

from bench.gpu import budget, campaign, sections, snapshot  # noqa: E402

MiB = 1 << 20
STEP_ORDER = ["facts", "plans", "knobs", "tune", "cuda_tests"]


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def call(tmp_path_factory, worker_id) -> tuple[Path, str]:
    """The whole campaign dry, as a lent GPU's call runs it: (its $OUT, what it printed). Run once for all
    of pytest-xdist's workers (it takes 80-90 s of CPU, and each worker given one of these tests ran it):
    the first to ask runs it under a lock in the run's shared temporary folder, the others read it. The
    tests only read what it wrote."""
    if worker_id == "master":  # no xdist: this process's own folder
        return _dry_call(tmp_path_factory.mktemp("gpu-campaign"))
    shared = tmp_path_factory.getbasetemp().parent / "gpu-campaign"  # pytest-N/: this run's, every worker's
    with FileLock(f"{shared}.lock"):
        if not (shared / "printed.txt").is_file():
            shared.mkdir(exist_ok=True)
            _, printed = _dry_call(shared / "out")
            (shared / "printed.txt").write_text(printed, encoding="utf-8")
    return shared / "out", (shared / "printed.txt").read_text(encoding="utf-8")


def _dry_call(out: Path) -> tuple[Path, str]:
    out.mkdir(parents=True, exist_ok=True)
    kept = out.with_name(out.name + "-kept")
    done = children.run(["bash", str(ROOT / "bench" / "gpu" / "call.sh"), "--dry-run"], cwd=ROOT,
                        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT),
                             "CKRUN_CAMPAIGN_KEPT": str(kept)})
    assert done.returncode == 0, f"call.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out, done.stdout


# --- the accounting -------------------------------------------------------------------------------


def test_the_first_call_fits_nine_minutes_with_the_machine_start_and_a_second_fits_the_session():
    plan = campaign.accounting()
    assert plan["fits"] and plan["call_total_s"] <= 540 == budget.CALL_S
    assert plan["machine_start_s"] >= 60 and plan["transfers_s"] > 0 and plan["install_s"] > 0
    assert plan["machine_start_s"] + plan["transfers_s"] + plan["run_timeout_s"] <= budget.CALL_S
    assert budget.RUN_TIMEOUT_S <= 600  # the device tool's most for one command
    for name in campaign.FIRST_CALL:  # each starts even when every step before it took its most
        assert plan["steps"][name]["gets_at_least_s"] >= plan["steps"][name]["usual_s"], name
    spent = budget.CALL_S + budget.IDLE_S + budget.REACTION_S + budget.TRANSFERS_S + budget.SECOND_CALL_S \
        + budget.BACKSTOP_S
    assert spent <= budget.SESSION_S == 900


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 200), st.one_of(st.none(), st.integers(1, 300))), min_size=1, max_size=6))
def test_accounting_gives_no_step_more_than_is_left(table):
    steps = tuple(campaign.Step(f"s{i}", "", usual, most, (), lambda *a: []) for i, (usual, most) in enumerate(table))
    plan = campaign.accounting(steps)
    given_out = [plan["steps"][s.name]["gets_at_least_s"] for s in steps]
    assert sum(given_out) <= budget.COMMAND_S - budget.INSTALL_S
    for step, gets in zip(steps, given_out, strict=True):
        assert plan["steps"][step.name]["starts"] == (gets >= step.usual_s)
        assert step.most_s is None or gets <= step.most_s


# --- the dry run ----------------------------------------------------------------------------------


def test_dry_run_runs_every_step_in_order_and_writes_each_ones_results_as_it_ends(call):
    out, printed = call
    record = _json(out / "campaign.json")
    assert record["dry_run"] is True and record["accounting"]["fits"] is True
    steps = {s["step"]: s for s in record["steps"]}
    assert [s["step"] for s in record["steps"]] == STEP_ORDER
    for name in ("facts", "plans", "tune", "cuda_tests"):
        assert steps[name]["status"] == "done", steps[name]
    assert steps["knobs"]["status"] == "done" or steps["knobs"]["reason"].startswith("not present")
    for name, files in (("facts", {"facts.json", "calibration.json"}), ("plans", {"plans.json"}),
                        ("tune", {"tune.json"})):
        assert set(steps[name]["files"]) == files  # on disk when the step ended ...
        for file in files:  # ... and last written then, not at the campaign's end
            assert (out / file).stat().st_mtime <= steps[name]["ended_at"] + 1
    ends = [s["ended_at"] for s in record["steps"]]
    assert ends == sorted(ends)
    # a call brings back at most 8 files, no deeper than 2 folders, named in letters, digits, '.', '_', '-'
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.parent == out and re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert all(p.stat().st_size < 16 * MiB for p in files)
    assert "campaign summary (one line per figure):" in printed


def test_dry_run_prints_one_summary_line_per_figure(call):
    out, printed = call
    summary = printed.split("campaign summary (one line per figure):", 1)[1].strip().splitlines()
    names = [line.split(":", 1)[0] for line in summary if not line.startswith("next")]
    assert names == ["device", "bf16 matmul", "calibration", "CUDA context", "P4", "step time", "P6", "knobs", "P1",
                     "P2", "P5", "cap", "cuda tests", "steps"]
    assert _json(out / "campaign.json")["summary"] == summary[:len(names)]
    assert "DRY RUN" in summary[0] and "cuda_tests done" in summary[-1]


def test_facts_dry_run_measures_every_op_class_for_the_calibration_table(call):
    out, _ = call
    facts, calibration = _json(out / "facts.json"), _json(out / "calibration.json")
    assert facts["dry_run"] is True
    assert {"date", "python", "torch", "transformers", "device", "alloc_conf", "alloc_in_effect"} <= set(facts["versions"])
    assert all(facts[probe] is None for probe in ("context", "cublas", "attention", "bandwidth"))
    assert facts["matmul"]["bf16_flops_per_s"] > 0
    classes = {row["op_class"] for row in calibration["rows"]}
    assert classes == {"matmul", "conv", "attention", "norm", "memory", "optimizer", "host", "launch"}
    measured = [row for row in calibration["rows"] if "error" not in row]
    assert all(row["seconds"] > 0 for row in measured) and len(measured) >= len(calibration["rows"]) - 6
    # the kernel classes the time model prices apart: attention forward and backward, fp32 attention (3xTF32),
    # normalisation forward and backward, the host's AdamW (memory.optimizer_offload's update)
    attention = [r for r in calibration["rows"] if r["op_class"] == "attention"]
    assert {r["kernel"] for r in attention} == {"flash", "efficient", "cudnn"}  # each family tried (a CPU has flash)
    for family in {r["kernel"] for r in attention if "error" not in r}:
        assert {r["direction"] for r in attention if r["kernel"] == family and "error" not in r} == \
            {"forward", "backward"}, family
    assert any(r["dtype"] == "fp32" and r["kernel"] == "efficient" for r in attention)
    assert {r.get("direction") for r in calibration["rows"] if r["op_class"] == "norm"} == {"forward", "backward"}
    adamw = next(r for r in calibration["rows"] if r["kernel"] == "adamw" and r["op_class"] == "host")
    assert adamw["params_per_s"] > 0
    entry = calibration["entry"]
    assert {"applies_to", "figures", "source", "device", "date", "versions"} <= set(entry)
    assert all(row["source"].startswith("measured by the GPU campaign") for row in entry["figures"])
    shares = sections.entry_figures(entry)
    assert set(shares["matmul"]) == {"bf16", "fp16", "tf32", "fp32"} and shares["launch_us"] > 0
    assert {"forward", "backward"} <= set(shares["norm"])
    efficient = [r for r in attention if r["kernel"] == "efficient" and "error" not in r]  # a CPU has none
    assert ("efficient_fp32_slowdown" in shares) == bool(efficient) and shares.get("efficient_fp32_slowdown", 1) >= 1
    assert all(0 < value <= 1 for value in [*shares["matmul"].values(), shares["memory"], shares["optimizer"]])
    assert calibration.get("entry_problem") is None  # runner/predict's table takes it, where it has one
    assert calibration["device_facts"]["kind"] == "cpu"


def test_plans_dry_run_measures_counts_and_predicts_in_order_of_value(call):
    out, _ = call
    plans = _json(out / "plans.json")
    order = [(p["name"], p["micro_batch"]) for p in plans["plans"]]
    assert order[:3] == [("none", 8), ("none", 4), ("full", 4)] and order[-2:] == [("compile", 4), ("compile", 8)]
    entries = {key: p for key, p in zip(order, plans["plans"], strict=True)}
    for (name, _micro), plan in entries.items():
        if "offload" in name or name == "compile":
            assert plan["status"] == "skipped" and ("needs CUDA" in plan["reason"] or "dry run" in plan["reason"])
            continue
        assert plan["status"] == "ok", plan
        assert len(plan["losses"]) == 2 and plan["step_time_s"] > 0 and plan["samples_per_s"] > 0
        assert plan["mfu"] is None and plan["hfu"] is None and plan["hardware_flops"] > 0  # no peak rate on a CPU
        assert plan["predicted_step_s"] > 0  # this CPU's time model, as a GPU's run gets its card's
        assert plan.get("loss_within_noise", name == "none") is True  # none is the reference itself
    for name in ("none", "full", "every 2", "selective", "solver"):  # the CPU estimate is exact for eager plans
        assert all(abs(entries[(name, micro)]["error"]) < 0.01 for micro in (4, 8))
    flops = {name: entries[(name, 4)]["hardware_flops"] for name in ("none", "every 2", "full")}
    assert flops["full"] > flops["every 2"] > flops["none"] == plans["model_flops"]
    assert entries[("full", 8)]["hardware_flops"] == flops["full"]  # counted once: the same global batch
    assert plans["noise_floor"] == {"4": 0.0, "8": 0.0}  # CPU steps are deterministic
    assert plans["predictions_from"] == "this machine's CPU, in the same call"
    assert all(solved["memory"]["checkpointing"]["policy"] == "layers" for solved in plans["solver"].values())


def test_tune_dry_run_tunes_then_compares_with_the_plans_steps_fastest(call):
    out, _ = call
    tune = _json(out / "tune.json")
    assert tune["tune"]["exit_code"] == 0 and not tune["tune"]["timed_out"], tune["tune"]
    assert "--max-mem" in tune["tune"]["command"] and "uncapped_tune" not in tune
    assert tune["tune"]["report"]["winner"] is not None and "memory:" in tune["tune"]["tuned_yaml"]
    assert tune["uncapped_reference"].startswith("the plans step's fastest eager plan")
    assert [c["role"] for c in tune["candidates"]] == ["tuned", "uncapped", "hf_full_checkpointing",
                                                      "full_checkpointing"]
    assert all(r["status"] == "ok" for c in tune["candidates"] for r in c["runs"]), tune["candidates"]
    assert all(tune["ratios"][k] > 0 for k in ("tuned_vs_fastest_uncapped", "tuned_vs_hf_full_checkpointing"))
    assert tune["tuned_peak"]["within_cap"] is True and tune["cap_bytes"] == 100_000_000


def test_tables_turn_the_calls_results_into_markdown_with_every_figure(call, tmp_path):
    out, _ = call
    target = tmp_path / "benchmarks_gpu.md"
    done = children.run([sys.executable, str(ROOT / "bench" / "gpu" / "tables.py"), str(out), "--out", str(target)],
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    markdown = target.read_text(encoding="utf-8")
    for heading in ("# ckrun on a GPU", "## Figures", "## The call", "## Memory facts", "## The time model's calibration",
                    "## Plans on recipes/bert_tiny.yaml", "## Tuning recipes/bert_tiny.yaml under 100MB"):
        assert heading in markdown, heading
    for figure in ("P1", "P2", "P4", "P5", "P6", "step time", "cap"):
        assert f"| {figure} |" in markdown
    assert "Dry run" in markdown and "| full | 4 |" in markdown and "skipped: needs CUDA" in markdown
    assert "- device: cpu" in markdown and "torch " in markdown and "fits" in markdown
    assert "| step time | predicted vs measured step time over the plans: rank correlation; error | Spearman" in markdown


def test_a_calls_plans_are_predicted_again_afterwards_with_the_checkouts_model(call, tmp_path):
    out, _ = call
    copy = tmp_path / "plans.json"
    copy.write_text((out / "plans.json").read_text(encoding="utf-8"), encoding="utf-8")
    done = children.run([sys.executable, str(ROOT / "bench" / "gpu" / "plans.py"), "--repredict", str(copy)], cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    again, before = _json(copy), _json(out / "plans.json")
    assert again["predictions_from"].startswith("re-predicted after the call on a CPU")
    for old, new in zip(before["plans"], again["plans"], strict=True):
        assert {k: new[k] for k in ("status", "step_time_s", "losses") if k in old} == \
            {k: old[k] for k in ("status", "step_time_s", "losses") if k in old}  # the measurements stay
        if old["status"] == "ok":
            assert new["predicted_here_bytes"] == old["predicted_here_bytes"] and new["predicted_step_s"] > 0
            assert "predicted_note" not in new  # the same recipe as measured
    assert again["figures"]["P4"]["plans"] == before["figures"]["P4"]["plans"]


def test_a_recipes_hash_leaves_out_what_is_at_its_default():
    """So that a knob the schema gains, off by default, keeps the committed predictions valid."""
    from bench.gpu import plans, predictions

    base = [*plans.DRY_RUN.base, "memory.micro_batch=4"]
    assert predictions.recipe_hash(plans.DRY_RUN, base) == predictions.recipe_hash(plans.DRY_RUN,
                                                                                   [*base, "memory.compile=false"])
    assert predictions.recipe_hash(plans.DRY_RUN, base) != predictions.recipe_hash(plans.DRY_RUN,
                                                                                   [*base, "memory.compile=true"])


def test_the_committed_predictions_are_for_the_recipes_the_plans_step_measures():
    """A lent GPU's plans are judged by bench/gpu/predicted_bert_large.json: where the recipe or a plan
    changed, remake it (`python bench/gpu/plans.py /tmp/p --predict-only`, then copy /tmp/p/predicted.json
    over it), or the call predicts them on its own CPU only if its budget leaves time."""
    from bench.gpu import plans

    committed = _json(plans.COMMITTED)
    entries = [e for e in plans.plan_entries(plans.GPU, None, committed["solver"]) if e.get("status") != "skipped"]
    stale = [e["key"] for e in entries
             if (committed["predictions"].get(e["key"]) or {}).get("recipe_hash") != e["recipe_hash"]]
    assert not stale, f"stale committed predictions: {stale}"


def test_tables_without_results_say_every_figure_waits():
    done = children.run([sys.executable, str(ROOT / "bench" / "gpu" / "tables.py")], cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = [line for line in done.stdout.splitlines() if line.startswith("| P") or line.startswith("| cap")
            or line.startswith("| step time")]
    assert len(rows) == 7 and all("not measured" in row for row in rows)
    assert "every figure waits for a lent GPU" in done.stdout


# --- the driver's budget, on stand-in steps ---------------------------------------------------------


def _stand_in(name: str, usual: float, most: float | None, code: str) -> campaign.Step:
    """A step whose child runs `code` (OUT is sys.argv[1]) and writes NAME.json first where the code says so."""
    return campaign.Step(name, f"stand-in {name}", usual, most, (f"{name}.json",),
                         lambda out, seconds, dry: [sys.executable, "-c", code, str(out)])


WRITES_THEN_HANGS = "import sys, time, pathlib; pathlib.Path(sys.argv[1], '{name}.json').write_text('{{}}'); time.sleep(60)"


def test_a_step_is_killed_at_its_share_and_one_without_its_usual_time_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CKRUN_CAMPAIGN_KEPT", str(tmp_path / "kept"))
    steps = (_stand_in("hangs", 0.1, 1.5, WRITES_THEN_HANGS.format(name="hangs")),
             _stand_in("too_long", 500, 600, "raise SystemExit('must not run')"),
             _stand_in("quick", 0.1, None, WRITES_THEN_HANGS.format(name="quick").replace("time.sleep(60)", "")))
    started = time.monotonic()
    record = campaign.run_steps(tmp_path, ["hangs", "too_long", "quick"], budget.Budget(30), False, steps)
    assert time.monotonic() - started < 20  # the hung step cost its 1.5 s share, not 60
    hangs, too_long, quick = record["steps"]
    assert hangs["status"] == "timed out" and hangs["limit_s"] == 2 and hangs["files"] == {"hangs.json": 2}
    assert too_long["status"] == "skipped" and "it usually takes 500 s" in too_long["reason"]
    assert quick["status"] == "done" and quick["files"] == {"quick.json": 2}
    assert _json(tmp_path / "campaign.json")["steps"] == record["steps"]
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["hangs.json", "quick.json"]  # for a second call
    assert record["next"].startswith("bash bench/gpu/call.sh hangs too_long")


def test_the_calls_watchdog_ends_a_stuck_campaign_and_keeps_what_was_measured(tmp_path):
    """The driver itself stuck (here: building a step's command) past the call's deadline: the watchdog
    writes campaign.json with what the steps before measured, prints the summary and leaves with 3."""
    script = f"""
import pathlib, sys, time
sys.path.insert(0, {str(ROOT)!r})
from bench.gpu import budget, campaign
writes = lambda out, seconds, dry: [sys.executable, "-c", "import sys, pathlib; pathlib.Path(sys.argv[1], 'first.json')"
                                    ".write_text('{{}}')", str(out)]
stuck = lambda out, seconds, dry: time.sleep(60) or []
steps = (campaign.Step("first", "", 0.1, 5, ("first.json",), writes), campaign.Step("stuck", "", 0.1, None, (), stuck))
campaign.run_steps(pathlib.Path({str(tmp_path)!r}), ["first", "stuck"], budget.Budget(4), False, steps)
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CKRUN_CAMPAIGN_KEPT": str(tmp_path / "kept")})
    assert done.returncode == budget.DEADLINE_EXIT, done.stderr[-2000:]
    assert time.monotonic() - started < 60
    record = _json(tmp_path / "campaign.json")
    assert record["stopped"] == "at the call's deadline" and [s["step"] for s in record["steps"]] == ["first"]
    assert record["steps"][0]["files"] == {"first.json": 2}
    assert "campaign summary (one line per figure):" in done.stdout


def test_a_campaign_done_in_time_leaves_no_watchdog_behind(tmp_path):
    """run_steps returns before its deadline: whatever runs on in that process is not ended at the
    deadline (a watchdog left armed took the test run's worker down 30 s later)."""
    script = f"""
import pathlib, sys, time
sys.path.insert(0, {str(ROOT)!r})
from bench.gpu import budget, campaign
quick = lambda out, seconds, dry: [sys.executable, "-c", "pass"]
left = budget.Budget(15)  # room for a loaded machine: only a campaign that ended before its deadline tells
campaign.run_steps(pathlib.Path({str(tmp_path)!r}), ["quick"], left, False, (campaign.Step("quick", "", 0.1, 1, (), quick),))
if left.left() > 0:
    time.sleep(left.left() + 1)
    print("still here")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "CKRUN_CAMPAIGN_KEPT": str(tmp_path / "kept")})
    assert done.returncode == 0 and "still here" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_the_campaign_refuses_a_step_it_does_not_have(tmp_path, capsys):
    assert campaign.main([str(tmp_path), "plans", "tuen"]) == 2
    assert "no step tuen" in capsys.readouterr().err


def test_knobs_dry_run_goes_through_every_pool_knob_and_the_experts(call):
    """Each knob of the plan, lossy ones too, and both experts kernels get an entry with its overrides: measured,
    or refused with the reason (the CPU refuses what is CUDA only), and predicted beside it."""
    from bench.gpu import knobs

    out, _ = call
    found = _json(out / "knobs.json")
    labels = {k["label"] for k in knobs.present()[0]}
    assert {"optimizer_state 8bit", "optimizer_state 4bit", "weights bf16", "optimizer_offload cpu",
            "optimizer_step in_backward", "loss chunked"} <= labels
    entries = {p["knob"]["label"]: p for p in found["plans"] if p.get("knob")}
    assert labels <= set(entries)
    for label, entry in entries.items():
        assert entry["status"] in ("ok", "skipped", "oom", "error"), (label, entry)
        assert entry["status"] == "ok" or entry.get("reason"), (label, entry)
        assert (knobs.LOSSY in entry["overrides"]) == entry["knob"].get("lossy", False), label
    measured = [e for e in entries.values() if e["status"] == "ok"]
    assert measured and all(e.get("predicted_here_bytes") or e.get("predicted_bytes") for e in measured)
    experts = {p["name"]: p for p in found["experts"]["plans"]}
    assert set(experts) == set(knobs.EXPERTS) and all(p["status"] == "ok" for p in experts.values()), experts
    assert "experts.json" not in {p.name for p in out.iterdir()}


# --- the knobs of issue 33, found by what the plan's types say ---------------------------------------


def test_knobs_are_the_plans_new_exact_policies_and_flags():
    from typing import Annotated, ClassVar, Literal

    from pydantic import Field

    from bench.gpu import knobs
    from ckrun.runner.plan.memory_plan import MemoryPlan
    from ckrun.runner.plan.policy_base import Policy

    class After(Policy):
        policy: Literal["after"] = "after"

    class InBackward(Policy):
        policy: Literal["in_backward"]

    class EightBit(Policy):
        policy: Literal["8bit"]
        lossy: ClassVar[bool] = True

    class WithKnobs(MemoryPlan):
        optimizer_step: Annotated[After | InBackward | EightBit, Field(discriminator="policy")] = \
            Field(default_factory=After)
        fuse_loss: bool = False
        notes: str = ""

    found, left = knobs.present(WithKnobs)
    ours = ("optimizer_step", "fuse_loss", "notes")  # the plan's own pool knobs are found beside them
    found, left = [k for k in found if k["field"] in ours], [k for k in left if k["field"] in ours]
    assert found == [{"field": "optimizer_step", "label": "optimizer_step in_backward", "policy": "InBackward",
                      "lossy": False, "override": "memory.optimizer_step={policy: in_backward}", "extra": []},
                     {"field": "optimizer_step", "label": "optimizer_step 8bit", "policy": "EightBit", "lossy": True,
                      "override": "memory.optimizer_step={policy: 8bit}", "extra": ["memory.allow_lossy=true"]},
                     {"field": "fuse_loss", "label": "fuse_loss", "override": "memory.fuse_loss=true"}]
    assert [(item["field"], item.get("policy")) for item in left] == [("notes", None)]
    assert knobs.present(MemoryPlan)[0] == [] or all(k["field"] not in knobs.MEASURED_ELSEWHERE
                                                     for k in knobs.present(MemoryPlan)[0])


def test_each_knob_is_shown_beside_the_same_plan_without_it():
    from bench.gpu import sections

    def plan(name, knob=None, **measured):
        found = {"name": name, "knob": knob and {"label": knob}, "status": "ok", "losses": [2.0, 1.5]}
        return {**found, **measured}
    knobs = {"status": "measured", "left_out": [{"field": "weights", "policy": "bf16", "reason": "lossy"}], "plans": [
        plan("none", step_time_s=1.0, measured_peak_bytes=10 * 10**9),
        plan("loss chunked", "loss chunked", step_time_s=1.1, measured_peak_bytes=8 * 10**9, predicted_here_bytes=8 * 10**9,
             losses=[2.0, 1.5000001]),
        {"name": "optimizer_offload cpu", "knob": {"label": "optimizer_offload cpu"}, "status": "skipped",
         "reason": "skipped: needs CUDA"},
        plan("none (train.grad_clip=null)", step_time_s=1.0, measured_peak_bytes=10 * 10**9, losses=[2.0, 1.4]),
        plan("optimizer_step in_backward (train.grad_clip=null)", "optimizer_step in_backward", step_time_s=0.9,
             measured_peak_bytes=9 * 10**9, losses=[2.0, 1.4])]}
    table = sections.knobs_table(knobs)
    assert "| loss chunked | ok | 1.100 | n/a | 1.10x | 8.00 GB | -2.00 GB | 8.00 GB | 1.0e-07 |" in table
    assert "| optimizer_offload cpu | skipped: needs CUDA |" in table
    # held to the plan without gradient clipping, as it ran: not to the clipped `none`
    assert "| optimizer_step in_backward (train.grad_clip=null) | ok | 0.900 | n/a | 0.90x | 9.00 GB | -1.00 GB | n/a | "\
        "0.0e+00 |" \
        in table
    assert "Left out: weights bf16: lossy." in table
    assert sections.knobs_summary(knobs).startswith("loss chunked peak -2.00 GB, step 1.10x; optimizer_offload cpu skipped")
    assert sections.knobs_summary({"status": "none present"}) == "none present in this checkout"


# --- the pieces, fed known inputs ---------------------------------------------------------------------


def test_committed_predictions_count_only_for_the_recipe_they_were_made_for():
    from bench.gpu import plan_results

    results = {"versions": {"device": "NVIDIA H200"}, "plans": [
        {"key": "full @ 16", "recipe_hash": "aaa"}, {"key": "none @ 16", "recipe_hash": "bbb"}]}
    committed = {"full @ 16": {"recipe_hash": "aaa", "peak_bytes": 10, "predicted_step_s": {"NVIDIA H200": 0.2}},
                 "none @ 16": {"recipe_hash": "old", "peak_bytes": 20}}
    here = {"none @ 16": {"peak_bytes": 21, "predicted_step_s": {"NVIDIA H200": 0.1}}}
    plan_results.attach_predictions(results, committed, here)
    full, none = results["plans"]
    assert (full["predicted_bytes"], full["predicted_step_s"]) == (10, 0.2)
    assert "predicted_bytes" not in none and "another recipe" in none["predicted_note"]
    assert (none["predicted_here_bytes"], none["predicted_step_s"]) == (21, 0.1)


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
    from bench.gpu import figures, tables, tune, tune_verdict

    setup = tune.DRY_RUN
    recipe = tune.full_checkpointing(setup)["recipe"]
    tuned = {"name": "tuned", "role": "tuned", "source": "tuned.yaml", "recipe": recipe, "search_samples_per_s": 99}
    uncapped = {**tuned, "name": "fastest uncapped", "role": "uncapped", "search_samples_per_s": 100}
    candidates = [_probed(tuned, 90, 100), _probed(uncapped, 100, 98), _probed(tune.full_checkpointing(setup), 70, 80),
                  _probed(tune.hf_candidate(setup), 60, 80)]
    results = {"recipe": "r.yaml", "cap_text": "100MB", "cap_bytes": 100_000_000,
               "tune": {"exit_code": 0, "timed_out": False, "seconds": 200.0, "command": ["-m", "ckrun", "tune"]}}
    tune_verdict.conclude(results, candidates)
    ratios = results["ratios"]
    assert ratios["tuned_vs_fastest_uncapped"] == pytest.approx(95 / 99)
    assert ratios["tuned_vs_fastest_uncapped_in_the_searches"] == pytest.approx(0.99)
    assert ratios["tuned_vs_hf_full_checkpointing"] == pytest.approx(95 / 70)
    assert ratios["tuned_vs_full_checkpointing"] == pytest.approx(95 / 75)
    assert results["tuned_peak"]["within_cap"] and results["tuned_peak"]["cap_used"] == pytest.approx(0.95)
    table, figures = tables.tune_table(results), figures.figures_table({"tune": results})
    assert "tuned / fastest uncapped: 0.96 (goal >= 0.97: MISSED)" in table
    assert "tuned / HF gradient checkpointing: 1.36 (goal >= 1.25: met)" in table
    assert "| tuned | micro-batch 8, checkpointing full, fp32 | 90.0, 100.0 | 95.0 | 99.0 | 0.10 |" in table
    assert "| P5 | `ckrun tune` under 40 GB, wall time | 3.3 min (goal <= 10 min: met) |" in figures
    assert "95.0% used (goal >= 90%: met)" in figures


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
    from bench.gpu.figures import step_time_text

    assert step_on({"NVIDIA H100 80GB HBM3": 0.2, "NVIDIA H200": 0.18}, "NVIDIA H200") == 0.18
    assert step_on({"NVIDIA H100 80GB HBM3": 0.2}, "NVIDIA L4") is None and step_on(0.3, "any") == 0.3
    plans = [{"status": "ok", "step_time_s": m, "predicted_step_s": p} for m, p in ((1.0, 0.9), (2.0, 2.4), (3.0, 2.7))]
    line = step_time_text(plans + [{"status": "oom"}])
    assert "over 3 plans" in line and "Spearman 1.00" in line and "median error 10.0%" in line
    assert "not measured" in step_time_text(plans[:1])
