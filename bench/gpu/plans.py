"""Call 2 of the GPU campaign: every memory plan of BERT-large measured, counted and predicted.

    python bench/gpu/plans.py OUT_DIR [--dry-run] [--steps N] [--only none,full] [--predicted FILE]
    python bench/gpu/plans.py OUT_DIR --predict-only          # CPU: OUT_DIR/predicted.json

Plans none / full / every 2 / selective / offload all / offload all + full on recipes/bert_large.yaml
(bf16, seq 512, batch 64), each at micro-batch 16 and in one pass of 64. Per plan: median step
time of the timed steps, samples/s, the largest reserved and allocated peaks and the CUDA context
over all steps, every step's loss, the FLOPs of one step counted by torch's FlopCounterMode (so
recompute shows up), achieved TFLOP/s and MFU. A plan that runs out of memory is recorded as
`oom` and the campaign goes on. `none` runs twice: FlashAttention's backward is not deterministic,
so the two runs' loss difference is the noise floor the other plans' differences are held to.

Predictions: `--predict-only` runs `ckrun estimate`'s Estimator on a CPU; its output, committed as
bench/gpu/predicted_bert_large.json, is the prediction the GPU run is judged by. The GPU run also
re-predicts with its own torch at the end, so a torch version that changes the prediction shows.
Two steps of `full` at micro-batch 16 are recorded with the allocator's history, from an emptied
cache, and replayed through ckrun's allocator model (bench/gpu/snapshot.py). OUT_DIR/plans.json is
rewritten after every plan, so a call that times out still brings back what was measured.

`--dry-run` runs the same code at toy size on the CPU (offload and the snapshot skipped, MFU null).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/plans.py` must find it too
    sys.path.insert(0, str(REPO))

from bench.gpu import snapshot, tables  # noqa: E402
from bench.gpu.facts import versions  # noqa: E402
from runner.load import load_recipe  # noqa: E402
from runner.predict.estimate import Estimator  # noqa: E402
from runner.train.loop import MemoryCapExceeded, Trainer  # noqa: E402

PLANS = {  # plan -> its memory overrides (the micro-batch comes on top)
    "none": ["memory.checkpointing={policy: none}", "memory.offload={policy: none}"],
    "full": ["memory.checkpointing={policy: full}", "memory.offload={policy: none}"],
    "every 2": ["memory.checkpointing={policy: every, every: 2}", "memory.offload={policy: none}"],
    "selective": ["memory.checkpointing={policy: selective}", "memory.offload={policy: none}"],
    "offload all": ["memory.checkpointing={policy: none}", "memory.offload={policy: all}"],
    "offload all + full": ["memory.checkpointing={policy: full}", "memory.offload={policy: all}"],
}
REPEAT = "none (repeat)"  # the second run of `none`: the loss noise floor
SNAPSHOT_PLAN = "full"  # recorded at the first micro-batch
SNAPSHOT_FILE = "snapshot_full_mb16.json.gz"
SNAPSHOT_STEPS = 2  # from an emptied cache: one that fills it, one that runs in it
COMMITTED = REPO / "bench" / "gpu" / "predicted_bert_large.json"
NOISE_MULTIPLE = 3  # a plan's loss difference within 3x the floor is run-to-run noise
LOSS_ATOL = 1e-6  # where the floor is 0 (deterministic CPU steps), float rounding of the loss itself
PEAK_BF16_DENSE = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12))  # datasheet, dense bf16
# bert_tiny shrunk further (tests/conftest.py's TINY_BERT): a step takes milliseconds on one core
TINY = ("model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.vocab_size=256",
        "model.config.max_position_embeddings=32", "data.seq_len=32", "train.batch_size=8")


@dataclass(frozen=True)
class Campaign:
    recipe: str
    base: tuple[str, ...]
    micro_batches: tuple[int, ...]
    warmup_steps: int
    timed_steps: int
    cuda: bool


GPU = Campaign("recipes/bert_large.yaml", ("train.device=cuda",), (16, 64), 2, 6, True)
DRY_RUN = Campaign("recipes/bert_tiny.yaml", (*TINY, "train.device=cpu"), (4, 8), 1, 1, False)


def plan_overrides(campaign: Campaign, name: str, micro: int, batch: int) -> list[str]:
    micro_override = "memory.micro_batch=null" if micro == batch else f"memory.micro_batch={micro}"
    return [*campaign.base, micro_override, *PLANS[base_name(name)]]


def base_name(name: str) -> str:
    return "none" if name == REPEAT else name


def plan_key(name: str, micro: int) -> str:
    return f"{base_name(name)} @ {micro}"


def recipe_hash(overrides: list[str], campaign: Campaign) -> str:
    """What a committed prediction must have been made for: the resolved recipe, not the override text."""
    return hashlib.sha256(load_recipe(REPO / campaign.recipe, overrides).model_dump_json().encode()).hexdigest()[:16]


# --- measuring ------------------------------------------------------------------------------------


def measure(recipe, campaign: Campaign, out: Path, record_snapshot: bool) -> dict:
    trainer = Trainer(recipe)
    records = [trainer.train_step() for _ in range(campaign.warmup_steps + campaign.timed_steps)]
    found = summarise(records, campaign.warmup_steps)
    if record_snapshot:
        found["snapshot"] = snapshot_step(trainer, out)
    found.update(count_flops(trainer, found["step_time_s"]))
    return found


def summarise(records: list[dict], warmup: int) -> dict:
    timed = records[warmup:]
    largest = lambda key: max((r[key] for r in records if r.get(key) is not None), default=None)  # noqa: E731
    return {"step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "step_times_s": [r["step_time_s"] for r in timed],
            "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
            "measured_peak_bytes": largest("peak_mem_bytes"), "peak_allocated_bytes": largest("peak_allocated_bytes"),
            "cuda_context_bytes": largest("cuda_context_bytes"), "alloc_retries": largest("alloc_retries"),
            "losses": [r["loss"] for r in records]}


def count_flops(trainer: Trainer, step_time_s: float) -> dict:
    """FLOPs of one more step, counted by dispatch (recompute included), and the rate they make."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with counter:
            trainer.train_step()
    except Exception as err:  # counting is extra: the step's measurements above stand without it
        return {"flops": None, "flops_error": _one_line(err)}
    flops = counter.get_total_flops()
    achieved = flops / step_time_s
    peak = peak_flops(trainer.device)
    return {"flops": flops, "achieved_flops_per_s": achieved, "mfu": achieved / peak if peak else None}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for model, flops in PEAK_BF16_DENSE if model in name), None)


def snapshot_step(trainer: Trainer, out: Path) -> dict:
    """Steps with the allocator's history on, written small and replayed; never ends the campaign.

    The cache is emptied first: in the steady state every segment already exists, and a replay
    that creates none tests nothing. From the live tensors' segments alone, the first recorded
    step builds the cache again and the second runs in it, as the prediction replays a step twice."""
    torch.cuda.empty_cache()
    run_steps = lambda: [trainer.train_step() for _ in range(SNAPSHOT_STEPS)]  # noqa: E731
    try:
        start, end, records = snapshot.record_step(run_steps, trainer.device)
        compact = snapshot.reduce(start, end, trainer.device.index or 0)
        del start, end
        file_bytes = snapshot.write(compact, out / SNAPSHOT_FILE)
        found = snapshot.replay(compact)
    except Exception as err:
        traceback.print_exc()
        return {"error": _one_line(err)}
    if file_bytes > 15 << 20:  # a call brings back files up to 16 MiB
        (out / SNAPSHOT_FILE).unlink()
        found["file_note"] = f"{file_bytes} bytes gzip'd: too large to bring back, deleted"
    return {**found, "file": SNAPSHOT_FILE, "file_bytes": file_bytes,
            "plan": f"{SNAPSHOT_PLAN} @ {trainer.recipe.micro_batch}",
            "steps": SNAPSHOT_STEPS, "steps_peak_reserved_bytes": max(r["peak_mem_bytes"] for r in records),
            "steps_peak_allocated_bytes": max(r.get("peak_allocated_bytes") or 0 for r in records)}


def run_plan(entry: dict, campaign: Campaign, out: Path, record_snapshot: bool) -> dict:
    """The plan's measurements, or status oom / error with the reason; memory is released either way."""
    if campaign.cuda:
        # the cuBLAS handles' workspaces stay allocated (~65 MiB on an H100); more is a leak from the last plan
        entry["allocated_before_bytes"] = torch.cuda.memory_allocated()
    try:
        recipe = load_recipe(REPO / campaign.recipe, entry["overrides"])
        entry.update(status="ok", **measure(recipe, campaign, out, record_snapshot))
    except (MemoryCapExceeded, torch.OutOfMemoryError) as err:
        entry.update(status="oom", reason=_one_line(err))
    except Exception as err:  # one broken plan must not cost the others their measurement
        traceback.print_exc()
        entry.update(status="error", reason=_one_line(err))
    release(campaign.cuda)
    return entry


def release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _one_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}"


# --- predicting -----------------------------------------------------------------------------------


def predict(campaign: Campaign, entries: list[dict]) -> dict:
    """{plan key: prediction} for the given plans, one Estimator for all (the micro-batch is in the plan)."""
    estimator = Estimator(load_recipe(REPO / campaign.recipe, list(campaign.base)), "cuda" if campaign.cuda else "cpu")
    found = {}
    for entry in entries:
        key = plan_key(entry["name"], entry["micro_batch"])
        if key in found:
            continue
        try:
            estimate = estimator.estimate(load_recipe(REPO / campaign.recipe, entry["overrides"]).memory)
            found[key] = {"peak_bytes": estimate.peak_bytes, "live_peak_bytes": estimate.live_peak_bytes,
                          "breakdown": estimate.breakdown}
        except Exception as err:  # an unpredictable plan is a finding, not the end of the campaign
            found[key] = {"error": _one_line(err)}
        found[key]["recipe_hash"] = recipe_hash(entry["overrides"], campaign)
        print(f"predicted {key}: {found[key].get('peak_bytes', found[key].get('error'))}", flush=True)
    return found


def attach_predictions(results: dict, committed: dict | None, here: dict | None) -> None:
    for entry in results["plans"]:
        key, wanted = plan_key(entry["name"], entry["micro_batch"]), entry["recipe_hash"]
        made = (committed or {}).get(key)
        if made and made.get("recipe_hash") == wanted and "peak_bytes" in made:
            entry["predicted_bytes"] = made["peak_bytes"]
        elif made:
            entry["predicted_note"] = "the committed prediction is for another recipe or failed: not used"
        if here and key in here and "peak_bytes" in here[key]:
            entry["predicted_here_bytes"] = here[key]["peak_bytes"]


# --- concluding -----------------------------------------------------------------------------------


def conclude(results: dict) -> None:
    """Errors, loss noise and their summaries, from whatever has been measured so far."""
    ok = [p for p in results["plans"] if p["status"] == "ok"]
    for plan in ok:
        for source, target in (("predicted_bytes", "error"), ("predicted_here_bytes", "error_here")):
            if plan.get(source) is not None and plan["measured_peak_bytes"]:
                plan[target] = (plan[source] - plan["measured_peak_bytes"]) / plan["measured_peak_bytes"]
    use_committed = any("predicted_bytes" in p for p in results["plans"])
    if not use_committed:  # no committed prediction: this machine's is the only one
        for plan in ok:
            if "error_here" in plan:
                plan["error"] = plan["error_here"]
    results["predictions_from"] = results["committed"]["source"] if use_committed else "this machine"
    results["summary"] = error_summary(ok, "error")
    results["summary_here"] = error_summary(ok, "error_here")
    results["noise_floor"] = loss_checks(results["plans"])


def error_summary(plans: list[dict], key: str) -> dict:
    errors = sorted(((abs(p[key]), p) for p in plans if p.get(key) is not None and p["name"] != REPEAT),
                    key=lambda pair: pair[0])
    if not errors:
        return {"plans": 0}
    worst = errors[-1][1]
    return {"plans": len(errors), "median_abs_error": statistics.median(e for e, _ in errors),
            "worst_abs_error": errors[-1][0], "worst_plan": f"{worst['name']} @ micro-batch {worst['micro_batch']}"}


def loss_checks(plans: list[dict]) -> dict:
    """Noise floor per micro-batch (none against its repeat); every plan's loss difference to none."""
    find = lambda name, micro: next((p for p in plans if p["name"] == name and p["micro_batch"] == micro  # noqa: E731
                                     and p["status"] == "ok"), None)
    floors = {}
    for micro in sorted({p["micro_batch"] for p in plans}):
        none, repeat = find("none", micro), find(REPEAT, micro)
        floor = max_loss_diff(none, repeat) if none and repeat else None
        floors[str(micro)] = floor
        for plan in (p for p in plans if p["micro_batch"] == micro and p["status"] == "ok" and p is not none):
            if none:
                plan["loss_diff_vs_none"] = max_loss_diff(plan, none)
                plan["loss_within_noise"] = None if floor is None else \
                    plan["loss_diff_vs_none"] <= NOISE_MULTIPLE * floor + LOSS_ATOL
    return floors


def max_loss_diff(a: dict, b: dict) -> float:
    # strict=False: a run that stopped early is compared over the steps it has
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=False))


def write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(temporary, path)  # a call killed mid-write still leaves the previous complete file


# --- the campaign ---------------------------------------------------------------------------------


def plan_entries(campaign: Campaign, only: list[str] | None) -> list[dict]:
    batch = load_recipe(REPO / campaign.recipe, list(campaign.base)).train.batch_size
    names = [n for n in PLANS if not only or n in only]
    if "none" in names:
        names.insert(names.index("none") + 1, REPEAT)
    entries = []
    for micro in campaign.micro_batches:
        for name in names:
            overrides = plan_overrides(campaign, name, micro, batch)
            entries.append({"name": name, "micro_batch": micro, "overrides": overrides,
                            "recipe_hash": recipe_hash(overrides, campaign)})
    return entries


def needs_cuda(entry: dict, campaign: Campaign) -> bool:
    return not campaign.cuda and "offload" in entry["name"]


def start_results(campaign: Campaign, committed_path: Path | None) -> dict:
    recipe = load_recipe(REPO / campaign.recipe, list(campaign.base))
    committed = json.loads(committed_path.read_text(encoding="utf-8")) if committed_path and committed_path.exists() \
        else None
    made = (committed or {}).get("versions", {})
    source = None if committed is None else \
        f"{committed_path.name} (CPU run, torch {made.get('torch')}, {made.get('date')})"
    return {"versions": versions(), "dry_run": not campaign.cuda, "recipe": campaign.recipe,
            "settings": {"batch_size": recipe.train.batch_size, "precision": recipe.precision,
                         "warmup_steps": campaign.warmup_steps, "timed_steps": campaign.timed_steps,
                         "micro_batches": list(campaign.micro_batches)},
            "peak_flops_per_s": peak_flops(torch.device("cuda", 0)) if campaign.cuda else None,
            "noise_multiple": NOISE_MULTIPLE, "committed": {"source": source,
                                                            "predictions": (committed or {}).get("predictions")},
            "plans": [], "snapshot": {"status": "skipped", "reason": "dry run: the allocator history needs CUDA"
                                      if not campaign.cuda else f"the {SNAPSHOT_PLAN} plan was not run (--only)"}}


def run_campaign(campaign: Campaign, entries: list[dict], results: dict, out: Path) -> None:
    committed = results["committed"]["predictions"]
    for entry in entries:
        record_snapshot = campaign.cuda and entry["name"] == SNAPSHOT_PLAN and \
            entry["micro_batch"] == campaign.micro_batches[0]
        if needs_cuda(entry, campaign):
            entry.update(status="skipped", reason="skipped: needs CUDA")
        else:
            print(f"--- {entry['name']} @ micro-batch {entry['micro_batch']}", flush=True)
            run_plan(entry, campaign, out, record_snapshot)
        if record_snapshot:
            results["snapshot"] = entry.pop("snapshot", {"error": f"the {SNAPSHOT_PLAN} plan did not run: "
                                                                  f"{entry.get('reason')}"})
        results["plans"].append(entry)
        attach_predictions(results, committed, None)
        conclude(results)
        write_json(out / "plans.json", results)


def predict_only(campaign: Campaign, entries: list[dict], out: Path) -> int:
    wanted = [e for e in entries if not needs_cuda(e, campaign)]
    found = {"versions": versions(), "recipe": campaign.recipe, "device": "cuda" if campaign.cuda else "cpu",
             "predictions": predict(campaign, wanted)}
    write_json(out / "predicted.json", found)
    print("\n| plan | predicted (GB) |\n|---|---|")
    for key, prediction in found["predictions"].items():
        print(f"| {key} | {tables.gb(prediction.get('peak_bytes')) or prediction.get('error')} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU: offload and snapshot skipped")
    parser.add_argument("--steps", type=int, help="timed steps per plan (default 6; dry run 1)")
    parser.add_argument("--only", help="comma-separated plan names, e.g. none,full")
    parser.add_argument("--predict-only", action="store_true", help="only the predictions (no GPU needed)")
    parser.add_argument("--predicted", type=Path,
                        help=f"committed predictions (default bench/gpu/{COMMITTED.name}; none in a dry run)")
    args = parser.parse_args(argv)
    campaign = DRY_RUN if args.dry_run else GPU
    if args.steps:
        campaign = Campaign(**{**vars(campaign), "timed_steps": args.steps})
    if args.dry_run:
        torch.set_num_threads(1)  # toy steps gain nothing from threads; spinning ones slow a shared 2-core box
    args.out.mkdir(parents=True, exist_ok=True)
    entries = plan_entries(campaign, args.only.split(",") if args.only else None)
    if args.predict_only:
        return predict_only(campaign, entries, args.out)
    if campaign.cuda and not torch.cuda.is_available():
        raise SystemExit("plans.py: no CUDA GPU here; use --dry-run or --predict-only")
    results = start_results(campaign, args.predicted or (None if args.dry_run else COMMITTED))
    run_campaign(campaign, entries, results, args.out)
    here = predict(campaign, [e for e in results["plans"] if e["status"] != "skipped"])
    attach_predictions(results, results["committed"]["predictions"], here)
    conclude(results)
    write_json(args.out / "plans.json", results)
    print("\n" + tables.plans_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
