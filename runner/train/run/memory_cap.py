"""The memory cap during a run: the errors that end a step over it, and the CUDA allocator limit
that makes a card-level cap fail where a card of that size would."""

from __future__ import annotations

import logging

import torch

from ...memory.measure import context_after_kernels
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
