"""Llama 2 7B full fine-tune on one A100 (batch 2, seq 2048) beside torchtune's documented 16 GB: the
predicted peak of memory.optimizer_offload master (ZeRO-Offload's split) and the plans around it, the
table in docs/benchmarks.md.

    PYTHONPATH=. python bench/zero_offload.py > table.md

bench/published/llama2_7b_full.yaml is built once on fake tensors (runner/predict/estimate.py: no real
memory, no GPU) and each plan estimated for CUDA with an A100's facts. Its peak is the predicted CUDA
reserve without the CUDA context, as torchtune's figure is `torch.cuda.max_memory_reserved()`.
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

RECIPE = "bench/published/llama2_7b_full.yaml"
TORCHTUNE = ("| torchtune `llama2/7B_full_low_memory` (its PR 527, \"Full finetune < 16GB\": \"GPU peak memory "
             "reserved: 15.974006784GB\") | bf16 weights, no fp32 copy; bitsandbytes' PagedAdamW; step in the "
             "backward; activation checkpointing | lossy | 15.97 (measured) | | |")
# name -> (exact?, the plan's fields over the recipe's own)
PLANS = {
    "the recipe: master, full checkpointing, block offload, chunked loss, expandable segments": (True, {}),
    "the same, the allocator's default": (True, {"allocator": None}),
    "the same, no block offload (expandable segments)": (True, {"offload": {"policy": "none"}}),
    "host offload of the state only (`cpu`), fp32 weights on the device": (True, {"optimizer_offload": {"policy": "cpu"}}),
    "no optimizer offload": (True, {"optimizer_offload": {"policy": "none"}}),
    "torchtune's choices in ckrun: bf16 weights, 8-bit AdamW, step in the backward": (False, {
        "optimizer_offload": {"policy": "none"}, "offload": {"policy": "none"}, "weights": {"policy": "bf16"},
        "optimizer_state": {"policy": "8bit"}, "optimizer_step": {"policy": "in_backward"}, "allow_lossy": True}),
}


def rows() -> list[str]:
    recipe = load_recipe(RECIPE)
    estimator = Estimator(recipe, "cuda", resolve_device("a100"))
    base = recipe.memory.model_dump(exclude={"max_mem"})
    out = [TORCHTUNE]
    for name, (exact, fields) in PLANS.items():
        estimate = estimator.estimate(MemoryPlan.model_validate({**base, **fields}))
        pools = estimate.breakdown
        host = next((n.split(": ", 1)[1].split(" of ")[0] for n in estimate.notes
                     if n.startswith("memory.optimizer_offload")), "")
        out.append(f"| ckrun: {name} | {', '.join(MemoryPlan.model_validate({**base, **fields}).pool_changes())} | "
                   f"{'exact' if exact else 'lossy'} | {estimate.peak_bytes / 1e9:.1f} (predicted) | "
                   f"{pools['parameters'] / 1e9:.1f} / {pools['gradients'] / 1e9:.1f} / "
                   f"{pools['optimizer_state'] / 1e9:.1f} / {pools['activations'] / 1e9:.1f} | {host} |")
        print(out[-1], file=sys.stderr, flush=True)
    return out


def main() -> None:
    print(f"Predicted on fake tensors, {datetime.date.today()}, torch {torch.__version__}, {platform.machine()}; "
          "peak = predicted CUDA reserve on an A100 (allocator model), without the CUDA context\n")
    print("| setup | plan | exact? | peak GB | params / grads / optimizer / activations GB at the peak | host memory |")
    print("|---|---|---|---|---|---|")
    for row in rows():
        print(row)


if __name__ == "__main__":
    main()
