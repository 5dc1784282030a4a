"""What a run says before its first step: where it runs and what that means.

The device, and what "peak memory" and `memory.max_mem` mean there; the predicted step and total
time when a prediction is given (runner/predict's time model); and for a recipe meant for a GPU
(bf16/fp16 or a large model) that finds only a CPU, one line saying so: it runs on, slowly, and
`--device` picks another device. A long silent first step on the wrong device is the complaint
this answers.
"""

from __future__ import annotations

import os

import torch

from ...units import format_bytes
from .progress import format_duration

LARGE_MODEL = 100_000_000  # parameters: beyond this a CPU step takes seconds to minutes


def start_lines(recipe, device: torch.device, predicted_step_s: float | None, parameters: int = 0,
                total_steps: int | None = None) -> list[str]:
    """The lines to log before step 1. `predicted_step_s`: the time model's seconds per optimizer step
    on `device` (None: nothing is said about time)."""
    lines = [device_line(device, recipe.memory.max_mem)]
    steps = total_steps or recipe.train.steps
    if predicted_step_s is not None and steps:
        each = f"{predicted_step_s:.2g} s" if predicted_step_s < 60 else format_duration(predicted_step_s)
        lines.append(f"predicted: {each} a step, {format_duration(predicted_step_s * steps)} for {steps} steps")
    meant = gpu_reasons(recipe, parameters)
    if device.type == "cpu" and meant:
        lines.append(f"this recipe is meant for a GPU ({', '.join(meant)}) but runs on the CPU: each step may take "
                     "seconds to minutes; it runs on (Ctrl-C stops it after a whole step, saved); --device cuda on a "
                     "machine with a GPU, or a smaller model, to change that")
    return lines


def device_line(device: torch.device, max_mem) -> str:
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        cap = f"; memory.max_mem {format_bytes(int(max_mem))} limits the allocator" if max_mem else ""
        return (f"device: {device} ({properties.name}, {format_bytes(properties.total_memory)}): peak memory is the "
                f"caching allocator's reserved bytes{cap}")
    cap = f"; memory.max_mem {format_bytes(int(max_mem))} caps that RAM" if max_mem else ""
    return (f"device: cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads): peak memory is the live "
            f"tensor bytes ckrun's tracker counts in RAM{cap}")


def gpu_reasons(recipe, parameters: int) -> list[str]:
    """Why a recipe looks written for a GPU: a half precision, a model past LARGE_MODEL parameters."""
    reasons = [recipe.precision] if recipe.precision in ("bf16", "fp16") else []
    if parameters >= LARGE_MODEL:
        reasons.append(f"{parameters / 1e6:.0f}M parameters")
    return reasons

