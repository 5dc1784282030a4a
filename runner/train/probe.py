"""Measure one recipe's plan: warm-up steps, then timed steps; the tuner's view of a run.

This is the only thing the tuner asks of training: a recipe in, a small dict of measurements
out. It runs in whatever process calls it; the tuner runs it in a fresh subprocess.
"""

from __future__ import annotations

import platform
import statistics

import torch

from ..memory.measure import card_peak, cuda_context_bytes
from ..recipe import Recipe
from .loop import MemoryCapExceeded, Trainer


def probe(recipe: Recipe, warmup_steps: int = 2, timed_steps: int = 3, source: str = "<probe>") -> dict:
    """{"status": "ok"|"over_cap", "card_peak_bytes", "peak_mem_bytes", "samples_per_s" (median of timed steps), ...}.

    `card_peak_bytes` is what the cap limits (`runner.memory.measure.card_peak`): the allocator's
    reserve plus the CUDA context on CUDA, the live tensor bytes on CPU.

    The peak is measured in the warm-up steps (on CPU the tracker watches the first two, the
    second being the first with optimizer state); the timed steps run without it."""
    trainer = Trainer(recipe, source)
    records = []
    try:
        for _ in range(warmup_steps + timed_steps):
            records.append(trainer.train_step())
    except MemoryCapExceeded as err:
        # err.peak is already the card peak (reserve plus context), as the cap counts it
        context = cuda_context_bytes(trainer.device) if trainer.device.type == "cuda" else 0
        return {"status": "over_cap", "card_peak_bytes": err.peak, "peak_mem_bytes": max(0, err.peak - context),
                "cuda_context_bytes": context, "step": err.step, "reason": str(err), **_device(trainer)}
    timed = records[warmup_steps:]
    return {
        "status": "ok",
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "card_peak_bytes": max(card_peak(r) for r in records),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "losses": [r["loss"] for r in records],
        **{k: max(r.get(k, 0) for r in records) for k in ("peak_allocated_bytes", "cuda_context_bytes")},
        **({"gradient_error": trainer.gradient_error} if trainer.gradient_error is not None else {}),
        **_device(trainer),
    }


def _device(trainer: Trainer) -> dict:
    device = trainer.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": props.name, "device_total_bytes": props.total_memory, "torch": torch.__version__,
                "cuda": torch.version.cuda}
    return {"device": f"cpu ({platform.processor() or platform.machine()})", "device_total_bytes": 0,
            "torch": torch.__version__, "cuda": None}
