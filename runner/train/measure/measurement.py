"""What measuring a plan found (`ckrun.runner.train.measure.probe.probe`), as a type of its own: the probe
child imports it, and the tuner reads it, without importing torch or the trainer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Measurement(BaseModel):
    """What a probe of a plan measured: every step fitted (`ok`), or the cap stopped a step (`over_cap`).
    Not `Strict`: the numbers come from torch and statistics, and a JSON round trip turns 2.0 into 2."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    status: Literal["ok", "over_cap"]
    reason: str = ""
    """Why a step went over the cap (`MemoryCapExceeded`'s message); empty when it fitted."""
    card_peak_bytes: int | None = None
    """What the cap limits: the allocator's reserve plus the CUDA context on CUDA, live tensors on CPU."""
    peak_mem_bytes: int | None = None
    """The allocator's peak, without the CUDA context."""
    peak_allocated_bytes: int | None = None
    cuda_context_bytes: int | None = None
    samples_per_s: float | None = None
    """The median over the timed steps; none when over the cap."""
    step_time_s: float | None = None
    losses: list[float] = Field(default_factory=list)
    """Every step's loss, warm-up included."""
    gradient_error: float | None = None
    """A lossy plan's relative gradient error against the exact one (memory.compression)."""
    update_error: float | None = None
    """A lossy optimizer's (memory.optimizer_state 8bit/4bit/fp8, memory.weights bf16) relative error of the
    weights' change over the first steps against exact AdamW on the same gradients (runner/train/measure/update_error.py)."""
    step: int | None = None
    """The step that went over the cap."""
    device: str | None = None
    device_total_bytes: int | None = None
    torch: str | None = None
    cuda: str | None = None
    other_gpu_processes: int | None = None
    """Other processes on the probe's GPU: their time and memory may have been shared."""
