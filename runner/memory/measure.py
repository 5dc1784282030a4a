"""Peak memory of a training step, measured the honest way for each device.

CUDA: the caching allocator's own peaks (reserved is what the card really gives up; allocated
is what tensors use), its retries (a sign of fragmentation near the limit) and the CUDA
context, which a card-level cap must include. CPU: the live-tensor-bytes tracker.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..builders.experts import routing_decides_bytes
from . import nvml

log = logging.getLogger(__name__)


@dataclass
class Peak:
    """What one measured step reports into metrics.jsonl."""

    peak_mem_bytes: int = 0
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"peak_mem_bytes": int(self.peak_mem_bytes), **self.extra}


def cuda_context_bytes(device: torch.device) -> int:
    """What this process holds on the card beyond the caching allocator's reserve: the CUDA context
    and the kernels loaded into it (lazy loading grows it after init: ~650 MB at init, ~800 MB once
    a BERT step's kernels are in, H100 with torch 2.11). This process only: from NVML's per-process
    list where it names us; else the card's used memory less what other processes held before this
    one started CUDA (`note_card_before_cuda`), which is exact while no other process starts or
    grows on the card meanwhile (the tuner keeps its own off the GPU while a probe runs); else, with
    no NVML at all, the card's used memory, which counts every other process too (logged once)."""
    reserved = torch.cuda.memory_reserved(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    own = nvml.own_bytes(index)
    if own is not None:
        return max(0, own - reserved)
    before, used = _OTHERS_BEFORE.get(index), None
    if before is not None:
        used = nvml.card_used_bytes(index)  # the same reading as the one before: NVML's "used" counts the driver's too
    if used is not None:
        return max(0, used - before - reserved)
    _warn_counting_others(index)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - reserved)


_OTHERS_BEFORE: dict[int, int] = {}  # CUDA index -> the card's used bytes before this process's context
_WARNED: set[int] = set()


def note_card_before_cuda() -> None:
    """Read every visible card's used memory before this process creates a CUDA context: what other
    processes hold there, which `cuda_context_bytes` must not count as ours. Once CUDA is up, our
    own context is in the card's numbers, so a late call notes nothing."""
    if torch.cuda.is_initialized() or not torch.cuda.is_available():  # is_available creates no context
        return
    for index in range(torch.cuda.device_count()):
        used = nvml.card_used_bytes(index)
        if used is not None:
            _OTHERS_BEFORE.setdefault(index, used)


def _warn_counting_others(index: int) -> None:
    if index not in _WARNED:
        _WARNED.add(index)
        log.warning("CUDA context of cuda:%d: NVML neither lists this process nor gave the card's use before "
                    "CUDA started, so the context is read as the card's used memory beyond this process's "
                    "reserve, which counts any other process on the card too", index)


def context_after_kernels(device: torch.device) -> int:
    """The CUDA context once a training step's usual kernels are loaded: matmuls forward and backward
    (which also create the backward thread's cuBLAS handle), attention, layer norm, softmax and fused
    AdamW. Lazy module loading adds them to the context only when first used, so the context at init
    understates what a step holds; the tuner screens predictions with this number."""
    weight = torch.randn(256, 256, device=device, requires_grad=True)
    query = torch.randn(1, 2, 64, 64, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        attention = torch.nn.functional.scaled_dot_product_attention(query, query, query)
        out = torch.nn.functional.layer_norm(weight @ weight, (256,)).softmax(-1).sum() + attention.float().sum()
    out.backward()
    torch.optim.AdamW([weight, query], fused=True).step()
    torch.cuda.synchronize(device)
    del weight, query, attention, out
    return cuda_context_bytes(device)


def card_peak(record: dict) -> int:
    """What a card-level cap limits, from a step's record: the allocator's peak reserve plus the CUDA
    context. The in-run check, the tuner and the estimate all compare this one number with the cap."""
    return int(record["peak_mem_bytes"]) + int(record.get("cuda_context_bytes") or 0)


class PeakMeter:
    """Measures each step's peak. On CPU the tracker's per-op cost (about 3% on a tiny BERT)
    would slow the steps it watches, so it watches only some: steps 1 and 2 after a (re)start
    (step 2 is the first with optimizer state, i.e. the steady state) and every `every`-th.
    A CPU step's peak depends only on shapes and plan, so the other steps report the peak measured
    for their batch's shapes and say which step it came from; their time is free of the tracker.
    A batch of shapes not yet measured in the steady state (text of varying length) is measured.
    The exception is a mixture-of-experts model whose experts run eagerly: its peak follows how many
    tokens the router sends each expert, so every step is measured (runner/builders/experts.py)."""

    def __init__(self, device: torch.device, model: torch.nn.Module, optimizer: torch.optim.Optimizer, every: int = 10):
        self.device, self.model, self.optimizer = device, model, optimizer
        self.every = 1 if routing_decides_bytes(model) else every
        self._steps_seen = 0
        self._by_shapes: dict[tuple, Peak] = {}  # the batch's shapes -> its steady-state peak

    @contextlib.contextmanager
    def measure(self, batch_tensors=(), step: int = 0):
        """Measure step `step` run inside; `batch_tensors` exist before it and count towards the peak."""
        self._steps_seen += 1
        peak = Peak()
        if self.device.type == "cuda":
            with self._cuda(peak):
                yield peak
            return
        shapes = tuple(tuple(t.shape) for t in batch_tensors)
        if self._steps_seen <= 2 or step % self.every == 0 or shapes not in self._by_shapes:
            with self._cpu(peak, batch_tensors):
                yield peak
            peak.extra = {"peak_measured_step": step}
            if self._steps_seen >= 2:  # the first step has no optimizer state yet: not the steady state
                self._by_shapes[shapes] = peak
        else:
            yield peak
            known = self._by_shapes[shapes]
            peak.peak_mem_bytes, peak.extra = known.peak_mem_bytes, dict(known.extra)

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
    """Bytes a forward pass leaves alive for backward, measured inside `with SavedBytes(model) as saved:`.

    `saved.bytes` is the size of the tensor storages that were created inside the region and are
    still alive when it ends, on the model's device: the activations autograd saved, and what each
    checkpointed block keeps (its inputs; under selective checkpointing also the outputs its policy
    caches). It is read from the live-bytes tracker (tracker.py), not from saved-tensor hooks:
    selective checkpointing caches its outputs outside autograd's saved tensors, and only torch >=
    2.14 shows them to hooks around the checkpoint, so counting what stays alive is what sees them on
    every torch. Each storage counts once, however many views or saves share it.

    Not counted: storages that existed before the region (parameters, buffers, the batch, any other
    tensor Python can reach), even where the forward views them or updates them in place; tensors
    freed before the region ends (temporaries, outputs nobody keeps). The graph of every forward of
    `model` run inside is held until the region ends, so the caller need not keep the loss. Counted
    too: whatever the caller still holds at the end (a loss is a few bytes; logits it keeps count)
    and state the model keeps from a forward (a cache it fills).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.bytes = 0
        self._tracker = None
        self._graphs: list = []  # grad_fn of each output of `model`: keeps its graph alive until the end
        self._hook = None

    def _keep_graph(self, _module, _args, output) -> None:
        pending = [output]
        while pending:
            item = pending.pop()
            if isinstance(item, torch.Tensor):
                if item.grad_fn is not None:
                    self._graphs.append(item.grad_fn)
            elif isinstance(item, dict):  # transformers' ModelOutput is a dict
                pending.extend(item.values())
            elif isinstance(item, (tuple, list)):
                pending.extend(item)

    def __enter__(self) -> SavedBytes:
        import gc

        from .tracker import LiveBytesTracker

        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        self._tracker = LiveBytesTracker(device)
        # every tensor alive now is baseline; type(), not isinstance(): some proxies warn when asked their class
        self._tracker.count_existing((o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)), "inputs")
        self._tracker.count_existing(self.model.parameters(), "parameters")
        self._tracker.count_existing(self.model.buffers(), "parameters")
        self._hook = self.model.register_forward_hook(self._keep_graph)
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from .tracker import WORKING

        try:
            self._tracker.__exit__(*exc)
        finally:
            self._hook.remove()
            self.bytes = sum(self._tracker.current_breakdown[category] for category in WORKING)
            self._tracker.close()
            self._graphs.clear()
