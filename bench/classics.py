"""The classic checkpointing examples, measured: peak memory saved and step time added by each
classic recipe's plan, against the same recipe with no plan, next to the published claims.

    python bench/classics.py [--steps 3] [--only classic_conv20] [--out docs/benchmarks_classics.md]

Runs on the CPU in fp32 through `Trainer.train_step()`: peak bytes come from its tracker (every
live tensor: parameters, gradients, optimizer state, activations). Time is the step's CPU time on
one thread: on a machine shared with other jobs, wall-clock time measures their load as much as
the step (in trials it showed `every: 3` 28% faster than no plan), CPU time of one thread does not.
Models that would take minutes a step on a CPU are shrunk (each case says how); the recipes'
depth and plan - what checkpointing acts on - are kept. Timed steps of the plans alternate, so
a load change hits every plan alike, and the fastest timed step counts.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckrun.runner.recipe.library import resolve_recipe
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.units import format_bytes
from ckrun.runner.train.trainer import Trainer

CPU = ["train.device=cpu", "precision=fp32", "memory.micro_batch=null", "memory.compile=false"]
NO_PLAN = "{policy: none}"
# 128 wide with 4 heads at sequence 256 keeps BERT-large's ratio of attention-score bytes to
# hidden-state bytes per layer (heads x seq / width = 8), so activations dominate as they do there
BERT_SHRINK = ["model.config.hidden_size=128", "model.config.num_attention_heads=4",
               "model.config.intermediate_size=512", "data.seq_len=256", "train.batch_size=4"]
CHEN = "sqrt(n) memory for about one extra forward (Chen et al. 2016)"
PARTIAL = "most of the saving for 10-15% more time"


@dataclass
class Case:
    recipe: str
    shrink: list[str]  # overrides that make it run on a CPU in seconds
    how: str  # the shrink, in words
    claim: str  # the published claim the recipe's plan is compared with
    extra_plans: dict[str, str] = field(default_factory=dict)  # label -> checkpointing, beside the recipe's


CASES = [
    Case("classic_conv20", ["train.batch_size=16"], "full size (20 x 64 ch, 32x32), batch 16", CHEN),
    Case("classic_cifar_cnn", ["train.batch_size=64"], "full size, batch 64", "no published figure"),
    Case("classic_transformer_stack",
         ["model.config.width=128", "model.config.heads=2", "model.config.vocab_size=4096", "data.vocab_size=4096",
          "train.batch_size=4"],
         "12 blocks x 128 wide with 2 heads (not 512 with 8: the same heads x seq / width), vocab 4096, seq 512, "
         "batch 4", PARTIAL),
    Case("classic_bert24_ckpt", BERT_SHRINK, "24 layers x 128 wide with 4 heads at seq 256 (not 1024 with 16 at "
         "512: the same heads x seq / width), batch 4 (not 64)",
         "about 60% less peak memory for about 25% more time",
         {"every 2": "{policy: every, every: 2}", "every 3": "{policy: every, every: 3}"}),
]


@dataclass
class Result:
    label: str
    peak: int  # bytes, the most over the timed steps
    resident: int  # parameters, buffers and optimizer state between steps
    seconds: float  # CPU time of the fastest timed step


def plans_of(case: Case) -> dict[str, str | None]:
    """Label -> checkpointing override (None: the recipe's own plan), no plan first."""
    own = load_recipe(resolve_recipe(case.recipe)).memory.checkpointing
    described = own.label().replace(":", " ")  # "every 2"
    return {"none": NO_PLAN, f"{described} (recipe)": None, **case.extra_plans}


def trainer_for(case: Case, checkpointing: str | None) -> Trainer:
    plan = [f"memory.checkpointing={checkpointing}"] if checkpointing else []
    path = resolve_recipe(case.recipe)
    return Trainer(load_recipe(path, CPU + case.shrink + plan), str(path))


def resident_bytes(trainer: Trainer) -> int:
    """What stays between steps: parameters, buffers and optimizer state (gradients are freed)."""
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    tensors += [v for state in trainer.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(case: Case, steps: int) -> list[Result]:
    trainers = {label: trainer_for(case, plan) for label, plan in plans_of(case).items()}
    # each trainer gets its own RNG stream back before its steps, as if it ran alone: dropout
    # masks then match across plans, and so must the losses
    rng = {label: torch.get_rng_state() for label in trainers}
    records: dict[str, list[dict]] = {label: [] for label in trainers}
    for step in range(steps + 1):  # step 0 warms up: allocator, kernels and optimizer state settle
        for label, trainer in trainers.items():  # interleaved: load changes hit all plans alike
            torch.set_rng_state(rng[label])
            started = time.process_time()
            record = trainer.train_step()
            record["cpu_s"] = time.process_time() - started
            rng[label] = torch.get_rng_state()
            records[label] += [record] if step else []
    _check_same_losses(case, records)
    return [Result(label, max(r["peak_mem_bytes"] for r in records[label]), resident_bytes(trainers[label]),
                   min(r["cpu_s"] for r in records[label])) for label in trainers]


def _check_same_losses(case: Case, records: dict[str, list[dict]]) -> None:
    # a plan that changed the losses would make its timing meaningless: refuse to report it
    losses = {label: [r["loss"] for r in rs] for label, rs in records.items()}
    baseline = losses["none"]
    for label, values in losses.items():
        if values != baseline:
            raise SystemExit(f"{case.recipe}: plan {label!r} changed the losses: {values} vs {baseline}")


def rows(case: Case, results: list[Result]) -> list[str]:
    base = results[0]
    out = [f"| {case.recipe} | {base.label} | {format_bytes(base.peak)} | - | - | {base.seconds:.3f} | - | |"]
    for result in results[1:]:
        peak = result.peak / base.peak - 1
        step_bytes = (result.peak - result.resident) / (base.peak - base.resident) - 1
        slower = result.seconds / base.seconds - 1
        claim = case.claim if result.label.endswith("(recipe)") else PARTIAL
        out.append(f"| {case.recipe} | {result.label} | {format_bytes(result.peak)} | {peak:+.0%} | "
                   f"{step_bytes:+.0%} | {result.seconds:.3f} | {slower:+.0%} | {claim} |")
    return out


def environment() -> str:
    threads = torch.get_num_threads()
    return (f"CPU {_cpu_name()}, {threads} thread{'s' * (threads != 1)} (a machine shared with other jobs); "
            f"torch {torch.__version__}; Python {platform.python_version()}; {datetime.date.today().isoformat()}")


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def report(measured: list[tuple[Case, list[Result]]], steps: int) -> str:
    lines = [
        "## Classic checkpointing examples, measured", "",
        f"`python bench/classics.py --steps {steps}`; {environment()}. fp32, peak = the most live tensor bytes "
        "in a step (CPU tracker: parameters, gradients, optimizer state, activations); step bytes = the peak "
        "minus what stays between steps (parameters, buffers, optimizer state), i.e. the activations, gradients "
        f"and temporaries the step adds; step = CPU seconds of the fastest of {steps} timed steps on one thread "
        "(wall time on this shared machine was dominated by other jobs), after a warm-up step, plans "
        "interleaved. Losses are identical across plans.", "",
        "| recipe | plan | peak | peak vs none | step bytes vs none | step (CPU s) | time vs none | published |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, results in measured:
        lines += rows(case, results)
    lines += ["", "Sizes run (the recipes' depth and plans kept, so what checkpointing acts on is the same):", ""]
    lines += [f"- `{case.recipe}`: {case.how}" for case, _ in measured]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per plan (after one warm-up)")
    parser.add_argument("--only", action="append", help="recipe name to run (repeatable); default all")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks_classics.md"), help="markdown to write")
    args = parser.parse_args()
    torch.set_num_threads(1)  # CPU time of one thread is the step's work, whatever else the machine runs
    measured = []
    for case in CASES:
        if args.only and case.recipe not in args.only:
            continue
        measured.append((case, measure(case, args.steps)))
        print("\n".join(rows(case, measured[-1][1])), flush=True)
    text = report(measured, args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"\n{text}\nwritten to {args.out}")


if __name__ == "__main__":
    main()
