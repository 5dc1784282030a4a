"""Peak memory of a training step, measured the honest way for each device.

CUDA: the caching allocator's own peaks (reserved is what the card really gives up; allocated
is what tensors use), its retries (a sign of fragmentation near the limit) and the CUDA
context, which a card-level cap must include. CPU: the live-tensor-bytes tracker.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


def format_bytes(count: int | float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


@dataclass
class Peak:
    """What one measured step reports into metrics.jsonl."""

    peak_mem_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"peak_mem_bytes": int(self.peak_mem_bytes), **self.extra}


def cuda_context_bytes(device: torch.device) -> int:
    """Memory the driver holds for this process beyond the allocator: the CUDA context, cuBLAS workspaces."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


class PeakMeter:
    """Measures each step's peak. On CPU the tracker's per-op cost (about 3% on a tiny BERT)
    would slow the steps it watches, so it watches only some: steps 1 and 2 after a (re)start
    (step 2 is the first with optimizer state, i.e. the steady state) and every `every`-th.
    A CPU step's peak depends only on shapes and plan, so the other steps report the latest
    measured peak and say which step it came from; their time is free of the tracker."""

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer, every: int = 10):
        self.device, self.model, self.optimizer, self.every = device, model, optimizer, every
        self._steps_seen = 0
        self._last: Peak | None = None

    @contextlib.contextmanager
    def measure(self, batch_tensors=(), step: int = 0):
        """Measure step `step` run inside; `batch_tensors` exist before it and count towards the peak."""
        self._steps_seen += 1
        peak = Peak()
        if self.device.type == "cuda":
            with self._cuda(peak):
                yield peak
        elif self._steps_seen <= 2 or step % self.every == 0:
            with self._cpu(peak, batch_tensors):
                yield peak
            peak.extra = {"peak_measured_step": step}
            self._last = peak
        else:
            yield peak
            peak.peak_mem_bytes, peak.extra = self._last.peak_mem_bytes, dict(self._last.extra)

    @contextlib.contextmanager
    def _cuda(self, peak: Peak):
        torch.cuda.reset_peak_memory_stats(self.device)
        retries_before = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        yield
        stats = torch.cuda.memory_stats(self.device)
        peak.peak_mem_bytes = torch.cuda.max_memory_reserved(self.device)
        peak.extra = {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "alloc_retries": stats.get("num_alloc_retries", 0) - retries_before,
            "cuda_context_bytes": cuda_context_bytes(self.device),
        }

    @contextlib.contextmanager
    def _cpu(self, peak: Peak, batch_tensors):
        from .tracker import LiveBytesTracker

        tracker = LiveBytesTracker(self.device).track(self.model, self.optimizer, extra_tensors=batch_tensors)
        try:
            with tracker:
                yield
        finally:
            tracker.close()
        peak.peak_mem_bytes = tracker.peak_bytes


class SavedBytes:
    """Bytes of activations autograd saves for backward inside `with SavedBytes(model) as saved:`.

    Parameters are saved by reference and cost nothing extra, so they are left out; a storage
    saved twice (a view and its base) counts once. Inside a checkpointed block only what the
    checkpoint keeps is seen, which is exactly what checkpointing is meant to shrink.
    """

    def __init__(self, model: torch.nn.Module):
        self._parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._parameters and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
