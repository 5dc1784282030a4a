"""Per-block plans against the uniform rules, at a cap between full and every-2nd-block checkpointing (CPU).

A GPT-2-style model of 8 blocks, the whole batch in one pass. The cap's limit lies between the
estimator's peaks of `full` and `every:2` (by default 0.6 of the way, `--at`: there `sqrt` fits
too; on the CPU the estimate is the tracker's exact live bytes, which is what a probe measures),
so every:2 does not fit and full does. The solver proposes
its per-block plan from the block costs (estimator and a short timed run); then the solver's plan
and every uniform rule that fits (none, full, every:k, sqrt, selective: measured, not assumed) are
probed ROUNDS times each, interleaved, the way the tuner measures (a fresh single-threaded process
per probe). The question: is the solver's plan faster than every uniform rule that fits?

    python bench/per_block.py                    # about 10 minutes on 2 idle cores
    python bench/per_block.py --quick            # a tiny model and one round: a smoke run, a minute or two

Writes OUT/results.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
from pathlib import Path

from ckrun.autotune.probes.probe import ProbeRunner, ProbeSettings
from ckrun.autotune.search.solver import frontier
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes/gpt2.yaml"
FULL = ["model.config.n_layer=8", "model.config.n_embd=128", "model.config.n_head=4", "model.config.vocab_size=2048",
        "model.config.n_positions=256", "data.seq_len=256", "train.batch_size=8", "train.device=cpu",
        "precision=fp32", "memory.micro_batch=null"]
QUICK = ["model.config.n_layer=4", "model.config.n_embd=32", "model.config.n_head=2", "model.config.vocab_size=256",
         "model.config.n_positions=32", "data.seq_len=32", "train.batch_size=2", "train.device=cpu",
         "precision=fp32", "memory.micro_batch=null"]
RULES = [{"policy": "none"}, {"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "every", "every": 3},
         {"policy": "sqrt"}, {"policy": "selective"}]


def label(plan: MemoryPlan) -> str:
    return plan.checkpointing.label()


def setting(overrides: list[str], at: float = 0.6) -> tuple:
    """The recipe, its estimator, the limit `at` of the way from full's peak to every:2's, and each rule's peak."""
    recipe = load_recipe(RECIPE, overrides)
    estimator = Estimator(recipe, "cpu")
    peaks = {label(MemoryPlan.model_validate({"checkpointing": rule})): estimator.estimate(
        MemoryPlan.model_validate({"checkpointing": rule})).peak_bytes for rule in RULES}
    limit = int(peaks["full"] + at * (peaks["every:2"] - peaks["full"]))
    return recipe, estimator, limit, peaks


def plans_to_measure(recipe, estimator, limit: int, peaks: dict, timed_steps: int) -> dict[str, MemoryPlan]:
    proposals, lines = frontier(estimator, [(recipe.train.batch_size, recipe.precision)], limit, MemoryPlan(),
                                timed_steps=timed_steps)
    for line in lines:
        logging.info("solver: %s", line)
    if not proposals:
        raise SystemExit("the solver found no plan under the limit: " + "; ".join(lines))
    plans = {"solver": proposals[0].plan}
    for rule in RULES:
        plan = MemoryPlan.model_validate({"checkpointing": rule})
        if peaks[label(plan)] <= limit:
            plans[label(plan)] = plan
    return plans


def measure(recipe, plans: dict[str, MemoryPlan], rounds: int, out: Path, settings: ProbeSettings) -> dict:
    """Each plan probed `rounds` times, interleaved so that they share the machine's moods."""
    probe_runner, runs = ProbeRunner(out, settings), {name: [] for name in plans}
    for round_ in range(rounds):
        for index, (name, plan) in enumerate(plans.items()):
            result = probe_runner.probe(recipe.model_copy(update={"memory": plan}), round_ * len(plans) + index)
            if result.status != "ok":
                raise SystemExit(f"{name}: {result.status}: {result.reason}")
            runs[name].append({"speed": result.samples_per_s, "peak": result.measured_peak_bytes})
            logging.info("round %d: %s: %.2f samples/s, peak %s", round_ + 1, name, result.samples_per_s,
                         format_bytes(result.measured_peak_bytes))
    return {name: {"median": statistics.median(r["speed"] for r in values), "runs": [r["speed"] for r in values],
                   "peak": max(r["peak"] for r in values)} for name, values in runs.items()}


def markdown(result: dict) -> str:
    limit, measured = result["limit"], result["measured"]
    lines = [f"## Per-block plan vs uniform rules (CPU, limit {format_bytes(limit)}: between full "
             f"{format_bytes(result['peaks']['full'])} and every:2 {format_bytes(result['peaks']['every:2'])})", "",
             "| plan | peak | fits | samples/s (median) | runs |", "|---|---|---|---|---|"]
    for name, m in measured.items():
        shown = result["solver_plan"] if name == "solver" else name
        lines.append(f"| {shown} | {format_bytes(m['peak'])} | {'yes' if m['peak'] <= limit else 'no'} "
                     f"| {m['median']:.2f} | {', '.join(f'{v:.2f}' for v in m['runs'])} |")
    rivals = [m["median"] for name, m in measured.items() if name != "solver" and m["peak"] <= limit]
    verdict = measured["solver"]["median"] > max(rivals) if rivals else True
    lines += ["", f"solver faster than every uniform rule that fits: {'yes' if verdict else 'no'}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, one timed step: a smoke run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurements of each plan (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench_per_block")
    parser.add_argument("--at", type=float, default=0.6,
                        help="where the limit lies from full's peak (0) to every:2's (1); default 0.6")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("ckrun.runner.memory").setLevel(logging.WARNING)  # the estimator applies plans many times
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every probe child
    rounds, settings = (1, ProbeSettings(warmup_steps=1, timed_steps=1)) if args.quick else \
        (args.rounds, ProbeSettings(warmup_steps=2, timed_steps=5))
    if not 0 <= args.at < 1:
        raise SystemExit(f"--at must lie in [0, 1) but got {args.at}")
    recipe, estimator, limit, peaks = setting(QUICK if args.quick else FULL, args.at)
    plans = plans_to_measure(recipe, estimator, limit, peaks, timed_steps=1 if args.quick else 3)
    measured = measure(recipe, plans, rounds, args.out, settings)
    result = {"limit": limit, "peaks": peaks, "solver_plan": label(plans["solver"]), "measured": measured,
              "overrides": QUICK if args.quick else FULL, "at": args.at}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(markdown(result))


if __name__ == "__main__":
    main()
