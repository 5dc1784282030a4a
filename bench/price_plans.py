"""What a prediction's traces cost: five plans of the Llama 8B (H100) priced on one composer, each one's CPU
seconds, traces and prediction (issue 42: the 8B's tune is mostly these).

    python bench/price_plans.py           # about 20 CPU s on this machine

Prints one line per plan and the total; the peaks and step times must not change when only the cost does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tune_shapes import ROWS  # noqa: E402

LOSSY = {"weights": {"policy": "bf16"}, "allow_lossy": True}
PLANS = [  # a walk's kinds of trace: offloaded blocks, a kept and a recomputed block, every:2, masters on the host
    {"micro_batch": 8, "checkpointing": {"policy": "selective"}, "offload": {"policy": "all"},
     "optimizer_state": {"policy": "4bit"}, "loss": {"policy": "chunked", "chunks": 8}, **LOSSY},
    {"micro_batch": 4, "checkpointing": {"policy": "full"}, "optimizer_state": {"policy": "8bit"}, **LOSSY},
    {"micro_batch": 8, "checkpointing": {"policy": "every", "every": 2}, "offload": {"policy": "all"},
     "optimizer_state": {"policy": "4bit"}, "loss": {"policy": "chunked", "chunks": 8}, **LOSSY},
    {"micro_batch": 2, "checkpointing": {"policy": "full"}, "optimizer_offload": {"policy": "master"}},
    {"micro_batch": 1, "checkpointing": {"policy": "selective"}, "weights": {"policy": "fp32", "cast_cache": False},
     "optimizer_offload": {"policy": "master"}},
]


def main() -> None:
    from ckrun.runner.plan.memory_plan import MemoryPlan
    from ckrun.runner.predict.compose import Composer
    from ckrun.runner.predict.hardware import resolve_device
    from ckrun.runner.predict.parts import PartsEstimator
    from ckrun.runner.recipe.load import load_recipe

    _, recipe_path, overrides, _ = ROWS["8b"]
    recipe = load_recipe(ROOT / recipe_path, overrides)
    started = time.process_time()
    composer = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")))
    print(f"built in {time.process_time() - started:.2f} CPU s")
    total = time.process_time()
    for fields in PLANS:
        plan, before, traces = MemoryPlan.model_validate(fields), time.process_time(), composer.traces
        estimate = composer.estimate(plan, "bf16")
        print(f"{time.process_time() - before:6.2f} CPU s, {composer.traces - traces} trace(s): peak "
              f"{estimate.peak_bytes} B, step {estimate.time.seconds:.6f} s  ({plan.checkpointing.label()}, "
              f"micro-batch {plan.micro_batch})", flush=True)
    print(f"five plans: {time.process_time() - total:.2f} CPU s, {composer.traces} traces")


if __name__ == "__main__":
    main()
