"""bert_large on a CUDA GPU: step time per plan, and predicted vs measured reserved peaks.

    python bench/bert_large_gpu.py [--steps 5]

Table 1 (memory-plan issue): batch 16, bf16, plans none / full / every 2 / selective /
offload (all blocks), median step time and the allocator's peak. Table 2 (measurement
issue): batch sizes 16, 32, 64 x plans none / full / every 2, `ckrun estimate --device cuda`
against the measured `max_memory_reserved`, with median and worst error. Needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics

import torch

from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.train.run.memory_cap import MemoryCapExceeded
from ckrun.runner.train.trainer import Trainer

PLANS = {"none": "{policy: none}", "full": "{policy: full}", "every 2": "{policy: every, every: 2}",
         "selective": "{policy: selective}"}


def measure(overrides: list[str], steps: int) -> tuple[float, int]:
    recipe = load_recipe("recipes/bert_large.yaml", ["train.device=cuda", *overrides])
    trainer = Trainer(recipe)
    records = [trainer.train_step() for _ in range(steps + 1)]
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(r["step_time_s"] for r in records[1:]), max(r["peak_mem_bytes"] for r in records)


def timing_table(steps: int) -> None:
    print("| plan (batch 16, bf16) | step time (s) | vs none | peak reserved (GB) |\n|---|---|---|---|")
    plans = {**PLANS, "offload all": "{policy: none}"}
    base = None
    for name, plan in plans.items():
        extra = ["memory.offload={policy: all}"] if name.startswith("offload") else []
        seconds, peak = measure(["train.batch_size=16", "memory.micro_batch=null", f"memory.checkpointing={plan}", *extra], steps)
        base = base or seconds
        print(f"| {name} | {seconds:.3f} | {seconds / base:.2f}x | {peak / 1e9:.2f} |", flush=True)


def prediction_table(steps: int) -> None:
    print("\n| batch | plan | predicted (GB) | measured (GB) | error |\n|---|---|---|---|---|")
    errors = []
    for batch in (16, 32, 64):
        for name, plan in list(PLANS.items())[:3]:
            overrides = [f"train.batch_size={batch}", "memory.micro_batch=null", f"memory.checkpointing={plan}"]
            predicted = Estimator(load_recipe("recipes/bert_large.yaml", overrides), "cuda").estimate().peak_bytes
            try:
                _, measured = measure(overrides, min(steps, 2))
            except MemoryCapExceeded:  # the trainer reports a CUDA out-of-memory as the card's cap
                print(f"| {batch} | {name} | {predicted / 1e9:.2f} | out of memory | |", flush=True)
                continue
            errors.append((predicted - measured) / measured)
            print(f"| {batch} | {name} | {predicted / 1e9:.2f} | {measured / 1e9:.2f} | {100 * errors[-1]:+.1f}% |", flush=True)
    absolute = sorted(abs(e) for e in errors)
    print(f"\nmedian error {100 * statistics.median(absolute):.1f}%, worst {100 * absolute[-1]:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/bert_large_gpu.py needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name} ({props.total_memory / 1e9:.0f} GB), torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{datetime.date.today()}\n")
    timing_table(args.steps)
    prediction_table(args.steps)


if __name__ == "__main__":
    main()
