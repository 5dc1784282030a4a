"""Step 2 of the GPU campaign: memory plans of BERT-large measured, counted and predicted (the time
model's and the memory model's calibration data).

    python bench/gpu/plans.py OUT_DIR [--dry-run] [--budget-s 105] [--steps N] [--only none,full] [--predicted FILE]
    python bench/gpu/plans.py OUT_DIR --predict-only          # CPU: OUT_DIR/predicted.json
    python bench/gpu/plans.py --repredict OUT/plans.json      # CPU, after a call: this checkout's predictions

Plans none / full / every 2 / selective / offload all / offload all + full / the solver's plan /
compile on recipes/bert_large.yaml (bf16, seq 512, batch 64), at micro-batch 16 and in one pass of
64, in order of value (`PRIORITY`: the whole batch with no plan first, the first look's baseline;
compile last). Per plan: median step time of the timed steps, samples/s, the largest reserved and
allocated peaks and the CUDA context over all steps, every step's loss, FLOPs counted by torch's
FlopCounterMode, MFU beside HFU (plan_results.py says which is which), the predicted peak, and the
predicted step time where the time model has put one in the predictions (`predicted_step_s`,
"not predicted" otherwise). A plan that runs out of memory is recorded as `oom` and the campaign
goes on. `none` runs twice: FlashAttention's backward is not deterministic, so the two runs' loss
difference is the noise floor the other plans' differences are held to.

Predictions: `--predict-only` runs the Estimator and the solver on a CPU (predictions.py); its
output, committed as bench/gpu/predicted_bert_large.json, is what the GPU run is judged by (remake
it when runner/predict or the recipe schema changes: a plan whose recipe hash no longer matches is
predicted on the GPU machine's CPU at the end, if the budget leaves time; `--repredict` predicts a
call's measured plans again afterwards, on any CPU, with the checkout's model). Two steps of `full` at
micro-batch 16 are recorded with the allocator's history and replayed through ckrun's allocator
model (snapshot.py), when the budget leaves time for it.

The budget (`--budget-s`): a plan starts only when the time it usually takes is left (compile: a
cold compile, 1-2 minutes), and a watchdog writes plans.json and leaves at the deadline.
OUT_DIR/plans.json is rewritten after every plan, so a call cut short still brings back what was
measured. `measure_entries` is the engine: bench/gpu/knobs.py measures its plans with it too; each
plan is measured by plan_measurement.py.
`--dry-run` runs the same code at toy size on the CPU (offload and the snapshot skipped, MFU null).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/plans.py` must find it too
    sys.path.insert(0, str(REPO))

from bench.gpu import figures, plan_results, predictions, tables  # noqa: E402
from bench.gpu.budget import Budget, write_json  # noqa: E402
from bench.gpu.facts import versions  # noqa: E402
from bench.gpu.plan_measurement import SNAPSHOT_PLAN, run_plan  # noqa: E402
from bench.gpu.plan_results import REPEAT  # noqa: E402
from ckrun.runner.recipe.load import load_recipe  # noqa: E402

NO_OFFLOAD = "memory.offload={policy: none}"
PLANS = {  # plan -> its memory overrides (the micro-batch comes on top); the solver's come from predictions.py
    "none": ["memory.checkpointing={policy: none}", NO_OFFLOAD],
    "full": ["memory.checkpointing={policy: full}", NO_OFFLOAD],
    "every 2": ["memory.checkpointing={policy: every, every: 2}", NO_OFFLOAD],
    "selective": ["memory.checkpointing={policy: selective}", NO_OFFLOAD],
    "offload all": ["memory.checkpointing={policy: none}", "memory.offload={policy: all}"],
    "offload all + full": ["memory.checkpointing={policy: full}", "memory.offload={policy: all}"],
    "solver": None,
    "compile": ["memory.checkpointing={policy: none}", NO_OFFLOAD, "memory.compile=true"],
}
# (plan, index into the micro-batches) in order of value: the whole batch with no plan (the first look's
# baseline and MFU figure), the usual plans at the small micro-batch, the noise floor, offload, the solver's
# plan at the whole batch, the rest, compile last (a cold compile takes 1-2 minutes)
PRIORITY = (("none", 1), ("none", 0), ("full", 0), ("every 2", 0), ("selective", 0), (REPEAT, 0), ("offload all", 0),
            ("solver", 1), ("full", 1), ("every 2", 1), ("selective", 1), ("offload all + full", 0), (REPEAT, 1),
            ("offload all", 1), ("offload all + full", 1), ("solver", 0), ("compile", 0), ("compile", 1))
COMMITTED = REPO / "bench" / "gpu" / "predicted_bert_large.json"
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
    budget_s: float
    plan_s: float  # what an eager plan usually takes (build, steps, FLOP count): start one only with this left
    compile_s: float  # the same for a compiled plan: a cold compile
    snapshot_s: float  # the allocator history of two more steps, and its replay
    predict_s: float  # one plan's prediction on this machine's CPU, at the end
    solver_limit: int | None  # the solver's limit; None: halfway between none and full (a toy's)

    @property
    def recipe_path(self) -> Path:
        return REPO / self.recipe


TUNE_LIMIT = int(40e9 * 0.95) - predictions.CONTEXT_GUESS  # the tune call's --max-mem 40GB, margin 0.05
# H100, BERT-large (2026-11-22): a step of 64 samples 0.22 s, the model built in seconds: a plan with its 7 steps
# and a counted one about 12 s
GPU = Campaign("recipes/bert_large.yaml", ("train.device=cuda",), (16, 64), 2, 5, True, 105, 15, 150, 20, 8,
               TUNE_LIMIT)
DRY_RUN = Campaign("recipes/bert_tiny.yaml", (*TINY, "train.device=cpu"), (4, 8), 1, 1, False, 300, 3, 3, 0, 1, None)


def plan_overrides(campaign: Campaign, name: str, micro: int, batch: int, solved: dict) -> list[str] | None:
    micro_override = "memory.micro_batch=null" if micro == batch else f"memory.micro_batch={micro}"
    memory = predictions.solver_overrides(solved.get(str(micro), {})) if name == "solver" else \
        PLANS["none" if name == REPEAT else name]
    return None if memory is None else [*campaign.base, micro_override, *memory]


# --- the card -------------------------------------------------------------------------------------


def peak_flops(device: torch.device) -> float | None:
    """The card's dense bf16 peak from ckrun's GPU table (MFU's denominator); None for a card it lacks."""
    if device.type != "cuda":
        return None
    from ckrun.runner.predict.hardware import this_gpu

    facts = this_gpu()
    return facts.peak_flops("bf16") if facts else None


# --- the campaign ---------------------------------------------------------------------------------


def plan_entries(campaign: Campaign, only: list[str] | None, solved: dict) -> list[dict]:
    """The plans in order of value (PRIORITY), those named in `only` alone if given."""
    batch = load_recipe(campaign.recipe_path, list(campaign.base)).train.batch_size
    wanted = lambda name: not only or name in only or (name == REPEAT and "none" in only)  # noqa: E731
    entries = []
    for name, index in PRIORITY:
        micro = campaign.micro_batches[index]
        if not wanted(name):
            continue
        entry = {"name": name, "micro_batch": micro, "key": f"{'none' if name == REPEAT else name} @ {micro}",
                 "overrides": plan_overrides(campaign, name, micro, batch, solved)}
        if entry["overrides"] is None:
            entry.update(status="skipped", reason=f"no solver plan: {solved.get(str(micro), {}).get('reason')}")
        else:
            entry["recipe_hash"] = predictions.recipe_hash(campaign, entry["overrides"])
        entries.append(entry)
    return entries


def skip_reason(entry: dict, campaign: Campaign, budget: Budget) -> str | None:
    if entry.get("status") == "skipped":
        return entry["reason"]
    if not campaign.cuda and "offload" in entry["name"]:
        return "skipped: needs CUDA"
    if not campaign.cuda and entry["name"] == "compile":
        return "skipped: dry run (a cold compile of a toy costs more than every other plan; ckrun's tests compile)"
    needed = campaign.compile_s if entry["name"] == "compile" else campaign.plan_s
    if not budget.allows(needed):
        return f"skipped: {budget.left():.0f} s of the call's budget left, a {entry['name']} plan takes ~{needed:.0f} s"
    return None


def start_results(campaign: Campaign, committed_path: Path | None, solved: dict) -> dict:
    recipe = load_recipe(campaign.recipe_path, list(campaign.base))
    committed = json.loads(committed_path.read_text(encoding="utf-8")) if committed_path and committed_path.exists() \
        else None
    made = (committed or {}).get("versions", {})
    source = None if committed is None else \
        f"{committed_path.name} (made before the call on a CPU, torch {made.get('torch')}, {made.get('date')})"
    return {"versions": versions(), "dry_run": not campaign.cuda, "recipe": campaign.recipe,
            "settings": {"batch_size": recipe.train.batch_size, "precision": recipe.precision,
                         "warmup_steps": campaign.warmup_steps, "timed_steps": campaign.timed_steps,
                         "micro_batches": list(campaign.micro_batches)},
            "peak_flops_per_s": peak_flops(torch.device("cuda", 0)) if campaign.cuda else None,
            "noise_multiple": plan_results.NOISE_MULTIPLE, "solver": solved,
            "committed": {"source": source, "predictions": (committed or {}).get("predictions")},
            "plans": [], "snapshot": {"status": "skipped", "reason": "dry run: the allocator history needs CUDA"
                                      if not campaign.cuda else f"the {SNAPSHOT_PLAN} plan was not run (--only)"}}


def run_campaign(campaign: Campaign, entries: list[dict], results: dict, out: Path, budget: Budget,
                 filename: str = "plans.json") -> None:
    """Measures `entries` in order, writing OUT/`filename` after each (the engine knobs.py shares)."""
    counted = set()  # plans whose FLOPs are counted: once each, the global batch is the same at every micro-batch
    for entry in entries:
        record_snapshot = campaign.cuda and entry["name"] == SNAPSHOT_PLAN and \
            entry["micro_batch"] == campaign.micro_batches[0] and budget.allows(campaign.plan_s + campaign.snapshot_s)
        why = skip_reason(entry, campaign, budget)
        if why:
            entry.update(status="skipped", reason=why)
        else:
            print(f"--- {entry['name']} @ micro-batch {entry['micro_batch']} ({budget.left():.0f} s left)", flush=True)
            count = entry["name"] not in counted and entry["name"] not in (REPEAT, "compile")
            run_plan(entry, campaign, out, record_snapshot, count)
            counted |= {entry["name"]} if entry.get("flops") else set()
        if record_snapshot:
            results["snapshot"] = entry.pop("snapshot", {"error": f"the {SNAPSHOT_PLAN} plan did not run: "
                                                                  f"{entry.get('reason')}"})
        results["plans"].append(entry)
        conclude(results, budget)
        write_json(out / filename, results)


def predict_here(campaign: Campaign, results: dict, budget: Budget) -> dict | None:
    """Predictions made on this machine's CPU at the end: first for the measured plans the committed
    file has no valid prediction of, then, if the budget leaves time, for all (a torch version that
    moves them shows)."""
    measured = [e for e in results["plans"] if e["status"] == "ok"]
    committed = results["committed"]["predictions"] or {}
    missing = [e for e in measured if (committed.get(e["key"]) or {}).get("recipe_hash") != e.get("recipe_hash")]
    wanted = measured if budget.allows(len(measured) * campaign.predict_s + 10) else \
        missing if budget.allows(len(missing) * campaign.predict_s + 10) else []
    if not wanted:
        results["predicted_here_note"] = "no time left to predict here" if missing else "all committed"
        return None
    return predictions.predict(campaign, wanted)


def conclude(results: dict, budget: Budget, here: dict | None = None) -> None:
    plan_results.attach_predictions(results, results["committed"]["predictions"], here)
    plan_results.conclude(results)
    results["figures"] = plan_results.figures(results)
    results["budget"] = budget.record()


def predict_only(campaign: Campaign, out: Path) -> int:
    estimator = predictions.estimator_for(campaign)
    solved = solve_here(campaign, estimator)
    wanted = [e for e in plan_entries(campaign, None, solved) if e.get("status") != "skipped"
              and (campaign.cuda or "offload" not in e["name"])]
    found = {"versions": versions(), "recipe": campaign.recipe, "device": "cuda" if campaign.cuda else "cpu",
             "solver": solved, "predictions": predictions.predict(campaign, wanted, estimator)}
    write_json(out / "predicted.json", found)
    print("\n| plan | predicted (GB) |\n|---|---|")
    for key, prediction in found["predictions"].items():
        print(f"| {key} | {figures.gb(prediction.get('peak_bytes')) or prediction.get('error')} |")
    return 0


def solver_plans(campaign: Campaign, committed_path: Path | None) -> dict:
    """The committed solver plans; where none were committed, solved here (CPU, seconds)."""
    if committed_path and committed_path.exists():
        solved = json.loads(committed_path.read_text(encoding="utf-8")).get("solver")
        if solved:
            return solved
    return solve_here(campaign)


def solve_here(campaign: Campaign, estimator=None) -> dict:
    """The solver's plan at each micro-batch, from `none`'s recipe there (CPU, seconds)."""
    batch = load_recipe(campaign.recipe_path, list(campaign.base)).train.batch_size
    return predictions.solve(campaign, {m: plan_overrides(campaign, "none", m, batch, {})
                                        for m in campaign.micro_batches}, estimator)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU: offload and snapshot skipped")
    parser.add_argument("--budget-s", type=float, help=f"this step's share of the call in seconds (default {GPU.budget_s:g})")
    parser.add_argument("--steps", type=int, help="timed steps per plan (default 5; dry run 1)")
    parser.add_argument("--only", help="comma-separated plan names, e.g. none,full")
    parser.add_argument("--predict-only", action="store_true", help="only the predictions (no GPU needed)")
    parser.add_argument("--predicted", type=Path,
                        help=f"committed predictions (default bench/gpu/{COMMITTED.name}; none in a dry run)")
    parser.add_argument("--repredict", type=Path, metavar="RESULTS",
                        help="predict a call's measured plans (plans.json or knobs.json) again here and rewrite it")
    args = parser.parse_args(argv)
    if args.repredict:
        results = json.loads(args.repredict.read_text(encoding="utf-8"))
        write_json(args.repredict, predictions.repredict(DRY_RUN if results.get("dry_run") else GPU, results))
        print(f"{args.repredict}: {results['predictions_from']}; {figures.step_time_text(results['plans'])}")
        return 0
    if args.out is None:
        parser.error("OUT_DIR is needed")
    campaign = DRY_RUN if args.dry_run else GPU
    campaign = Campaign(**{**vars(campaign), "timed_steps": args.steps or campaign.timed_steps,
                           "budget_s": args.budget_s or campaign.budget_s})
    if args.dry_run:
        torch.set_num_threads(1)  # toy steps gain nothing from threads; spinning ones slow a shared 2-core box
    args.out.mkdir(parents=True, exist_ok=True)
    if args.predict_only:
        return predict_only(campaign, args.out)
    if campaign.cuda and not torch.cuda.is_available():
        raise SystemExit("plans.py: no CUDA GPU here; use --dry-run or --predict-only")
    return run(campaign, args)


def run(campaign: Campaign, args) -> int:
    budget = Budget(campaign.budget_s)
    committed_path = args.predicted or (None if args.dry_run else COMMITTED)
    solved = solver_plans(campaign, committed_path)
    results = start_results(campaign, committed_path, solved)
    entries = plan_entries(campaign, args.only.split(",") if args.only else None, solved)
    measure_entries(campaign, entries, results, args.out, budget)
    print("\n" + tables.plans_table(results))
    return 0


def measure_entries(campaign: Campaign, entries: list[dict], results: dict, out: Path, budget: Budget,
                    filename: str = "plans.json") -> dict:
    """The engine: every entry measured in order within the budget, the predictions, the conclusions,
    OUT/`filename` written after each plan and at the end (and by the watchdog at the deadline)."""
    watchdog = budget.arm(lambda: write_json(out / filename, {**results, "budget": {
        **budget.record(), "stopped": "at the deadline, in the middle of a plan"}}))
    run_campaign(campaign, entries, results, out, budget, filename)
    conclude(results, budget, predict_here(campaign, results, budget))
    write_json(out / filename, results)
    watchdog.set()
    return results


if __name__ == "__main__":
    sys.exit(main())
