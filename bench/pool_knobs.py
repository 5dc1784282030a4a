"""What the pools' knobs (weights, optimizer state and step, optimizer offload, loss) do to the Llama
recipes' predicted peak, and which GPUs that fits: the numbers in the recipes' headers and in
docs/benchmarks.md.

    PYTHONPATH=. python bench/pool_knobs.py [recipes/llama3_8b.yaml ...] > table.md

Each recipe is built once on fake tensors (runner/predict/estimate.py: no real memory, no GPU) and
each knob set is estimated for CUDA with an H100's facts (the step time is the roofline's, which
prices neither the host's AdamW nor the copies of memory.optimizer_offload yet). A card fits a plan
when the predicted reserve plus an H100's CUDA context (0.8 GB once a step's kernels are loaded)
is within the memory its driver reports (an "80GB" H100: 85.5e9 bytes).
"""

from __future__ import annotations

import datetime
import platform
import sys

import torch

from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import resolve_device

CONTEXT = 0.8e9
CARDS = {name: resolve_device(key).memory_bytes for name, key in (("L4", "l4"), ("A100 40GB", "a100-40gb"),
                                                                 ("H100 80GB", "h100"))}
LOSSY = {"weights": {"policy": "bf16"}, "optimizer_state": {"policy": "8bit"}, "allow_lossy": True}
# name -> the plan's fields over the recipe's own; `batch` keeps the recipe's global batch whatever the micro-batch
KNOB_SETS = {
    "activations only: full checkpointing": {"checkpointing": {"policy": "full"}},
    "+ chunked loss": {"checkpointing": {"policy": "full"}, "loss": {"policy": "chunked", "chunks": 8}},
    "+ chunked loss, cast cache off": {"checkpointing": {"policy": "full"}, "loss": {"policy": "chunked", "chunks": 8},
                                       "weights": {"policy": "fp32", "cast_cache": False}},
    "+ chunked, cast cache off, update in backward (one micro-batch)": {
        "checkpointing": {"policy": "full"}, "loss": {"policy": "chunked", "chunks": 8},
        "weights": {"policy": "fp32", "cast_cache": False}, "optimizer_step": {"policy": "in_backward"},
        "micro_batch": None},
    "+ chunked, cast cache off, optimizer offload": {
        "checkpointing": {"policy": "full"}, "loss": {"policy": "chunked", "chunks": 8},
        "weights": {"policy": "fp32", "cast_cache": False}, "optimizer_offload": {"policy": "cpu"}},
    "lossy: bf16 weights, 8-bit AdamW, chunked": {"checkpointing": {"policy": "full"},
                                                  "loss": {"policy": "chunked", "chunks": 8}, **LOSSY},
    "lossy: bf16 weights, 8-bit AdamW, chunked, update in backward": {
        "checkpointing": {"policy": "full"}, "loss": {"policy": "chunked", "chunks": 8},
        "optimizer_step": {"policy": "in_backward"}, "micro_batch": None, **LOSSY},
}


def plans_for(recipe) -> dict[str, MemoryPlan]:
    base = recipe.memory.model_dump(exclude={"max_mem"})
    defaults = {"weights": {"policy": "fp32"}, "optimizer_state": {"policy": "full"},
                "optimizer_step": {"policy": "after"}, "optimizer_offload": {"policy": "none"},
                "loss": {"policy": "whole"}, "allow_lossy": False}
    plans = {}
    for name, fields in KNOB_SETS.items():
        plan = MemoryPlan.model_validate({**base, **defaults, **fields})
        if plan.optimizer_step.updates_in_backward and recipe.train.grad_clip is not None:
            name += " [grad_clip off]"
        plans[name] = plan
    return plans


def rows(path: str) -> list[str]:
    recipe = load_recipe(path)
    unclipped = recipe.model_copy(update={"train": recipe.train.model_copy(update={"grad_clip": None})})
    facts, estimators = resolve_device("h100"), {}
    out = []
    for name, plan in plans_for(recipe).items():
        clip = recipe.train.grad_clip is not None and not plan.optimizer_step.updates_in_backward
        if clip not in estimators:
            estimators[clip] = Estimator(recipe if clip else unclipped, "cuda", facts)
        estimate = estimators[clip].estimate(plan)
        fits = [card for card, size in CARDS.items() if estimate.peak_bytes + CONTEXT <= size]
        pools = estimate.breakdown
        out.append(f"| {path.split('/')[-1]} | {name} | {estimate.peak_bytes / 1e9:.1f} | "
                   f"{pools['parameters'] / 1e9:.1f} / {pools['gradients'] / 1e9:.1f} / "
                   f"{pools['optimizer_state'] / 1e9:.1f} / {pools['activations'] / 1e9:.1f} / "
                   f"{pools['weight_casts'] / 1e9:.1f} / {pools['loss'] / 1e9:.1f} | "
                   f"{1000 * estimate.time.seconds:,.0f} | {', '.join(fits) or 'none of these'} |")
        print(out[-1], file=sys.stderr, flush=True)
    return out


def main(paths: list[str]) -> None:
    print(f"Predicted on fake tensors, {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}; "
          "peak = predicted CUDA reserve (allocator model), without the CUDA context\n")
    print("| recipe | knobs | peak GB | params / grads / optimizer / activations / weight casts / loss GB at the peak "
          "| step ms (H100 roofline) | fits |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        for row in rows(path):
            print(row)


if __name__ == "__main__":
    main(sys.argv[1:] or ["recipes/llama3_2_1b.yaml", "recipes/llama3_2_3b.yaml", "recipes/llama3_8b.yaml"])
