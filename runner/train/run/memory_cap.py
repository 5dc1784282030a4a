"""The memory cap during a run: the errors that end a step over it, the CUDA allocator limit that makes a
card-level cap fail where a card of that size would, and the prediction (`ckrun estimate`'s fake step,
made before step 1) that stops a run over the cap before it starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...memory.measure import context_after_kernels, cuda_context_bytes
from ...problems import EXIT_OVER_CAP, CkrunError, one_line
from ...units import format_bytes

log = logging.getLogger(__name__)


class MemoryCapExceeded(CkrunError, RuntimeError):
    """A step's measured peak went over memory.max_mem (or the device ran out under the cap)."""

    exit_status = EXIT_OVER_CAP
    every_rank = False  # the peak is reduced over the ranks: all of them see it, rank 0 says it

    def __init__(self, cap: int, peak: int, step: int, detail: str = ""):
        self.cap, self.peak, self.step = cap, peak, step
        super().__init__(f"memory cap {format_bytes(cap)} exceeded: step {step} peaked at {format_bytes(peak)}"
                         + (f" ({detail})" if detail else ""))

    advice = "lower memory.micro_batch or checkpoint more blocks"

    def lines(self) -> list[str]:
        return [one_line(f"ckrun: {self}; {self.advice}")]


class OutOfMemory(MemoryCapExceeded):
    """The machine itself could not give a step its memory (CPU: the allocator failed)."""

    every_rank = True  # a rank's own allocator: each says what it met

    def __init__(self, step: int, reason: str, device: torch.device):
        self.cap, self.peak, self.step = 0, 0, step
        RuntimeError.__init__(self, f"step {step} ran out of memory on {device.type}: {reason}")

    advice = ("lower train.batch_size or memory.micro_batch, or checkpoint more blocks (memory.checkpointing); "
              "`ckrun estimate` predicts a step's peak")


CONTEXT_SLACK = 16 << 20  # context growth below this is left to the in-run check


def limit_cuda_memory(device: torch.device, cap: int) -> int | None:
    """Make the allocator fail where reserve + context reach `cap`, as a card of that size would;
    returns the context the limit was set for (None: the cap is not below the card). The context is
    measured once a step's usual kernels are loaded (`context_after_kernels`, as the tuner's device
    child measures it): lazy loading grows it by ~150 MB in the first step, which a limit set from the
    context at init would leave to the in-run check to catch as an over-cap step."""
    total = torch.cuda.get_device_properties(device).total_memory
    if cap >= total:
        log.info("memory cap %s is not below the card's %s: nothing to limit", format_bytes(cap), format_bytes(total))
        return None
    context = context_after_kernels(device)
    fraction = max(0.0, (cap - context) / total)  # the CUDA context counts against a card-level cap too
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("memory cap %s: allocator limited to %.1f%% of %s (CUDA context %s, with a step's kernels loaded)",
             format_bytes(cap), 100 * fraction, format_bytes(total), format_bytes(context))
    return context


# A prediction the estimate does not claim exact (the CUDA allocator's model, eager experts' routing) stops a
# run only when clearly over, as `ckrun tune` screens plans by its default --margin; nearer, step 1 measures.
ROUGH = 0.05


@dataclass(frozen=True)
class Prediction:
    """What `ckrun estimate`'s fake step says of a run before its step 1 (the CLI makes it: runner/predict stands
    above train)."""

    step_s: float | None
    """Seconds an optimizer step on this device; None when the time model has no facts for it."""
    peak_bytes: int | None = None
    """The step's peak as the cap counts it (CPU: live tensor bytes; CUDA: the allocator's reserve)."""
    exact: bool = False
    """Whether a step measures exactly this peak (a CPU step whose bytes do not follow an expert router)."""
    plan: str = ""
    """The batch, micro-batch, precision and plan the peak is for, in words."""


class PredictedOverCap(MemoryCapExceeded):
    """The estimate puts the step's peak over memory.max_mem: the run stops before step 1, not after it."""

    def __init__(self, cap: int, peak: int, device: str, plan: str):
        self.cap, self.peak, self.step = cap, peak, 0
        RuntimeError.__init__(self, f"memory cap {format_bytes(cap)}: `ckrun estimate` predicts a peak of "
                                    f"{format_bytes(peak)} per step on {device} ({plan}), so the run stops before "
                                    "step 1")

    advice = ("lower memory.micro_batch or checkpoint more blocks; `ckrun tune RECIPE --max-mem SIZE` finds a plan "
              "under it")


def check_predicted_peak(prediction: Prediction | None, cap, device: torch.device, context: int | None = None) -> None:
    """Stop before step 1 when the predicted peak (on CUDA with the context, `context` where the allocator
    limit measured it, as the in-run check counts it) is over memory.max_mem: exactly over for an exact
    prediction, clearly over (ROUGH) for another; a rough one near the cap is said and left to step 1."""
    if cap is None or prediction is None or prediction.peak_bytes is None:
        return
    if device.type == "cuda" and context is None:
        context = cuda_context_bytes(device)
    peak, cap = prediction.peak_bytes + (context or 0), int(cap)
    if peak > cap * (1 if prediction.exact else 1 + ROUGH):
        raise PredictedOverCap(cap, peak, device.type, prediction.plan)
    if peak > cap:
        log.warning("memory cap %s: `ckrun estimate` predicts a peak of %s per step (%s), within %.0f%% over it; "
                    "step 1 measures it", format_bytes(cap), format_bytes(peak), prediction.plan, 100 * ROUGH)
