"""Measure one recipe's plan: warm-up steps, then timed steps; the tuner's view of a run.

This is the only thing the tuner asks of training: a recipe in, a `Measurement` out. It runs in
whatever process calls it; the tuner runs it in a fresh subprocess, and adds to the measurement
what only the tuner knows.
"""

from __future__ import annotations

import platform
import statistics

import torch

from ...memory import nvml
from ...memory.measure import card_peak, cuda_context_bytes
from ...recipe.recipe import Recipe
from ..run.memory_cap import MemoryCapExceeded
from ..trainer import Trainer
from .measurement import Measurement


def probe(recipe: Recipe, warmup_steps: int = 2, timed_steps: int = 3, source: str = "<probe>") -> Measurement:
    """The peak and the throughput of `recipe`'s plan, or `over_cap` with the step that broke the cap.

    `card_peak_bytes` is what the cap limits (`ckrun.runner.memory.measure.card_peak`): the allocator's
    reserve plus the CUDA context on CUDA, the live tensor bytes on CPU.

    The peak is measured in the warm-up steps (on CPU the tracker watches the first two, the
    second being the first with optimizer state, and any batch of new shapes); the timed steps run
    without it. For text of varying length the warm-up runs the longest batches (`warmup_steps_for`)."""
    trainer = Trainer(recipe, source)
    records, warmup = [], warmup_steps_for(trainer, warmup_steps)
    warmup_steps = len(warmup)
    try:
        for step in [*warmup, *range(warmup_steps, warmup_steps + timed_steps)]:
            trainer.step = step  # the batch of that step: a probe measures, it does not train
            records.append(trainer.train_step())
    except MemoryCapExceeded as err:
        # err.peak is already the card peak (reserve plus context), as the cap counts it
        context = cuda_context_bytes(trainer.device) if trainer.device.type == "cuda" else 0
        return Measurement(status="over_cap", card_peak_bytes=err.peak, peak_mem_bytes=max(0, err.peak - context),
                           cuda_context_bytes=context, step=err.step, reason=str(err), **_device(trainer))
    finally:
        trainer.close()  # the data's worker processes, before the measurements are reported
    timed = records[warmup_steps:]
    return Measurement(
        status="ok",
        peak_mem_bytes=max(r["peak_mem_bytes"] for r in records),
        card_peak_bytes=max(card_peak(r) for r in records),
        samples_per_s=statistics.median(r["samples_per_s"] for r in timed),
        step_time_s=statistics.median(r["step_time_s"] for r in timed),
        losses=[r["loss"] for r in records],
        peak_allocated_bytes=max(r.get("peak_allocated_bytes", 0) for r in records),
        cuda_context_bytes=max(r.get("cuda_context_bytes", 0) for r in records),
        gradient_error=trainer.gradient_error,
        update_error=trainer.update_error,
        **_device(trainer),
    )


SCAN_STEPS = 32  # batches looked at for the longest one of each length bucket


def warmup_steps_for(trainer: Trainer, count: int) -> list[int]:
    """The steps whose batches the warm-up runs. For text of varying length (data.split: lines) the
    cap must hold for the longest batch of each plan bucket: those (among the first SCAN_STEPS) run
    after one step that creates the optimizer state, so each is measured in the steady state."""
    if not trainer.recipe.data.varying_length:
        return list(range(count))
    from ...memory.adaptive import batch_length

    switch, longest = trainer.plan.switch, {}
    for step in range(SCAN_STEPS):
        length = batch_length(trainer.data.global_batch(step))
        bucket = switch.bucket_for(length) if switch is not None else 0
        if bucket not in longest or length > longest[bucket][0]:
            longest[bucket] = (length, step)
    covering = [step for _, step in sorted(longest.values(), reverse=True)]
    return ([covering[0]] + covering + list(range(count)))[: max(count, len(covering) + 1)]


def _device(trainer: Trainer) -> dict:
    device = trainer.device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # another process on the card shares its time and, where NVML cannot tell us apart, its memory
        return {"device": props.name, "device_total_bytes": props.total_memory, "torch": torch.__version__,
                "cuda": torch.version.cuda, "other_gpu_processes": nvml.others(device.index)}
    return {"device": f"cpu ({platform.processor() or platform.machine()})", "device_total_bytes": 0,
            "torch": torch.__version__, "cuda": None}
