"""Live tensor bytes per device: the ground truth for CPU peaks and the meter of the estimate.

`LiveBytesTracker` is a dispatch mode that sees every aten op's output tensors, counts each
untyped storage once (views and in-place results share their input's storage, so they add
nothing) and subtracts a storage's bytes when it is freed (a weakref callback on the storage:
torch keeps one Python object per storage for its whole life, so the callback fires exactly
when the memory goes). Fake tensors have a fake storage with the real byte size, so a step run
under `FakeTensorMode` measures the same peak as the real step without allocating anything.

Tensors that exist before the region (parameters, gradients, optimizer state, the batch) are
invisible to a dispatch mode; `track()` / `count_existing()` register them so they are part of
the baseline and their frees are seen.

Categories, and how each is decided (honest, not exact for attribution; the total is exact):
- `parameters`: storages of the model's parameters and buffers, registered by `track()`.
- `gradients`: `param.grad` storages: those present at `track()` time, and each new one when
  autograd's AccumulateGrad stores it (a post-accumulate-grad hook re-labels the storage, which
  was created by a backward op and counted as `activations` until then).
- `optimizer_state`: tensors in `optimizer.state` at `track()` time and after each step (a step
  post-hook re-labels them; on the very first step they count as `activations` until the step
  ends, steady-state steps find them already labelled).
- `inputs`: tensors given as `extra_tensors` / `count_existing()` (the batch).
- `weight_casts`: copies of parameters in another dtype (`_to_copy` of a parameter's storage):
  autocast's half-precision copies of the fp32 weights, and the update's fp32 copies of bf16 ones.
- `loss`: what the output head and the loss make in the forward (the logits, their fp32 copy, the
  log-probabilities), created inside `attributed("loss")` (runner/train/step.py enters it).
- `activations`: everything else created inside the region: saved activations, recomputed
  activations, forward/backward temporaries, activation gradients (the logits' too), optimizer-step
  temporaries.

Tensor subclasses that wrap others (DTensor's local shard, torchao's quantized optimizer states:
codes and scales) count as the tensors they wrap, which is what their memory holds.

Storages resized in place are followed too: `UntypedStorage.resize_` is no aten op, so while a
tracker is open it is wrapped to report the new size. FSDP2 frees a block's gathered parameters that
way (`free_storage`: resize to 0 after the forward, back before the backward); unseen, every block's
gathered parameters would stay counted for the whole step, the whole model in bf16 on every rank.

Not seen: memory that kernels allocate internally without returning it (workspaces), work done
inside a `torch.compile`d region (the mode is suspended there), tensors created outside the
region that were never registered (until an op returns them, e.g. an in-place op).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

CATEGORIES = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "weight_casts", "loss")
WORKING = ("activations", "weight_casts", "loss")
"""The categories of what a step makes (the rest existed before it): what `activations` held before
weight casts and the loss were told apart."""
_TO_COPY = torch.ops.aten._to_copy.default
_ATTRIBUTED: list[str] = []  # the category new tensors are given instead of activations (innermost last)


@contextlib.contextmanager
def attributed(category: str):
    """Tensors created inside count as `category` (e.g. `loss`) rather than activations, in any tracker."""
    _ATTRIBUTED.append(category)
    try:
        yield
    finally:
        _ATTRIBUTED.pop()


class _Record:
    """One live storage: its counted bytes, device, category and the weakref that reports its free."""

    __slots__ = ("nbytes", "device", "category", "ref")

    def __init__(self, nbytes: int, device: torch.device, category: str, ref: weakref.ref):
        self.nbytes, self.device, self.category, self.ref = nbytes, device, category, ref


class _DeviceBytes:
    """Running totals of one device; the breakdown is copied whenever the peak rises, and each category's
    own most is kept beside it (gradients are 0 at a peak that comes before backward makes them)."""

    __slots__ = ("total", "peak", "by_category", "peak_breakdown", "category_peaks")

    def __init__(self):
        self.total = self.peak = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_breakdown = dict(self.by_category)
        self.category_peaks = dict(self.by_category)

    def add(self, category: str, nbytes: int) -> None:
        held = self.by_category[category] + nbytes
        self.by_category[category] = held
        if held > self.category_peaks[category]:
            self.category_peaks[category] = held
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.peak_breakdown = dict(self.by_category)

    def reset_peak(self) -> None:
        self.peak = self.total
        self.peak_breakdown = dict(self.by_category)
        self.category_peaks = dict(self.by_category)


def _normalize(device: str | torch.device) -> torch.device:
    """`cuda` -> `cuda:0`, as tensors report it; `cpu` stays index-less, as CPU tensors report it."""
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        return torch.device(device.type, 0)
    return device


class LiveBytesTracker(TorchDispatchMode):
    """Peak of live tensor bytes per device over the regions run inside `with tracker:`.

    Usage::

        tracker = LiveBytesTracker("cpu").track(model, optimizer, extra_tensors=batch.values())
        with tracker:
            loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
        tracker.peak_bytes, tracker.breakdown_at_peak
        tracker.close()  # removes the gradient/optimizer hooks that track() installed

    The peak starts at the registered baseline; `reset_peak()` restarts it from the current
    bytes (once per step when one tracker serves many steps). With `record_events`, every
    allocation and free is appended to `events` as `(key, signed bytes, device)` (+ allocates,
    - frees the storage `key`), in order, for an allocator model to replay; with `record_labels` too,
    `labels` holds `(events so far, key, category)` for each storage's category when it appears and
    whenever it is re-labelled, so a replay of the events can say the breakdown at its peak.
    """

    def __init__(self, device: str | torch.device = "cpu", record_events: bool = False, record_labels: bool = False):
        super().__init__()
        self.device = _normalize(device)
        self.events: list[tuple[int, int, torch.device]] | None = [] if record_events or record_labels else None
        self.labels: list[tuple[int, int, str]] | None = [] if record_labels else None
        self._live: dict[int, _Record] = {}  # id(storage) -> record; ids are unique while it lives
        self._devices: dict[torch.device, _DeviceBytes] = {}
        self._hooks: list[Any] = []

    # --- registering what already exists ------------------------------------------------------

    def track(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              extra_tensors: Iterable[torch.Tensor] = ()) -> LiveBytesTracker:
        """Count the model's parameters, buffers and grads, the optimizer state and `extra_tensors`,
        and install the hooks that label new gradients and optimizer state as they appear."""
        if model is not None:
            self.count_existing(model.parameters(), "parameters")
            self.count_existing(model.buffers(), "parameters")
            params = [p for p in model.parameters() if p.requires_grad]
            self.count_existing((p.grad for p in params if p.grad is not None), "gradients")
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if optimizer is not None:
            self.count_existing(_state_tensors(optimizer), "optimizer_state")
            # an offloaded optimizer's host copies and buffers (runner/memory/host_optimizer.py): first
            # touched inside the step, they would count as activations made there
            self.count_existing(getattr(optimizer, "host_tensors", list)(), "optimizer_state")
            self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))
        self.count_existing(extra_tensors, "inputs")
        return self

    def count_existing(self, tensors: Iterable[torch.Tensor], category: str = "inputs") -> None:
        """Register live tensors (each storage once) under `category`; a known storage is re-labelled."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; use one of {', '.join(CATEGORIES)}")
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._see(tensor, category, relabel=True)

    def __enter__(self):
        if not _OPEN:
            torch.UntypedStorage.resize_ = _reported_resize
        _OPEN.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _OPEN.remove(self)
            if not _OPEN:
                _restore_storage_resize()

    def close(self) -> None:
        """Remove the hooks and forget every storage (the totals and peaks stay readable)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._live.clear()

    # --- results --------------------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int:
        """Most bytes live at once on the tracker's device since registration or `reset_peak()`."""
        return self._on(self.device).peak

    @property
    def current_bytes(self) -> int:
        return self._on(self.device).total

    @property
    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes per category (see the module docstring) at the moment of the peak; sums to the peak."""
        return dict(self._on(self.device).peak_breakdown)

    @property
    def category_peaks(self) -> dict[str, int]:
        """The most bytes each category held at any moment since registration or `reset_peak()` (not at once)."""
        return dict(self._on(self.device).category_peaks)

    @property
    def current_breakdown(self) -> dict[str, int]:
        return dict(self._on(self.device).by_category)

    @property
    def peak_by_device(self) -> dict[str, int]:
        return {str(device): stats.peak for device, stats in self._devices.items()}

    @property
    def current_by_device(self) -> dict[str, int]:
        return {str(device): stats.total for device, stats in self._devices.items()}

    def reset_peak(self) -> None:
        for stats in self._devices.values():
            stats.reset_peak()

    # --- the mode -------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _ATTRIBUTED[-1] if _ATTRIBUTED else "activations"
        if func is _TO_COPY and self._is_parameter(args[0]):
            category = "weight_casts"
        self._see_outputs(out, category)
        return out

    def _is_parameter(self, tensor: Any) -> bool:
        try:
            record = self._live.get(id(tensor.untyped_storage()))
        except (AttributeError, NotImplementedError, RuntimeError):  # storage-less layouts, subclasses
            return False
        return record is not None and record.category == "parameters"

    def _see_outputs(self, out: Any, category: str = "activations") -> None:
        # Ops return a tensor, a tuple/list of tensors (foreach ops), or tuples of lists (fused
        # optimizers); walking them by hand is several times cheaper than pytree on this hot path.
        if isinstance(out, torch.Tensor):
            self._see(out, category, relabel=False)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._see_outputs(item, category)

    def _see(self, tensor: torch.Tensor, category: str, relabel: bool) -> None:
        # a wrapper subclass answers for the tensor it stands for: a DTensor (FSDP2's shards) for the
        # whole tensor, a quantized optimizer state (torchao) for its float32 size; the memory holds
        # what it wraps (this rank's shard; the codes and scales), so those are counted
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self._see(inner, category, relabel)
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse and other storage-less layouts
            return
        record = self._live.get(id(storage))
        if record is None:
            self._add(storage, tensor.device, category)
            return
        self._resized(storage)
        if relabel and record.category != category:
            self._relabel(record, category)
            if self.labels is not None:
                self.labels.append((len(self.events), id(storage), category))

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A known storage whose size changed in place (resize_): new memory replaces the old."""
        record = self._live.get(id(storage))
        nbytes = storage.nbytes()
        if record is None or nbytes == record.nbytes:
            return
        self._on(record.device).add(record.category, nbytes - record.nbytes)
        if self.events is not None:
            self.events += [event for event in ((id(storage), -record.nbytes, record.device),
                                                (id(storage), nbytes, record.device)) if event[1]]
        record.nbytes = nbytes

    def _add(self, storage: torch.UntypedStorage, device: torch.device, category: str) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        ref = weakref.ref(storage, partial(self._on_free, key))
        self._live[key] = _Record(nbytes, device, category, ref)
        self._on(device).add(category, nbytes)
        if self.events is not None:
            self.events.append((key, nbytes, device))
        if self.labels is not None:
            self.labels.append((len(self.events), key, category))

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        record = self._live.pop(key, None)
        if record is not None:
            self._on(record.device).add(record.category, -record.nbytes)
            if self.events is not None:
                self.events.append((key, -record.nbytes, record.device))

    def _relabel(self, record: _Record, category: str) -> None:
        # Moving bytes between categories never changes the total, so the peak is untouched.
        stats = self._on(record.device)
        stats.by_category[record.category] -= record.nbytes
        stats.by_category[category] += record.nbytes
        stats.category_peaks[category] = max(stats.category_peaks[category], stats.by_category[category])
        record.category = category

    def _on(self, device: torch.device) -> _DeviceBytes:
        stats = self._devices.get(device)
        if stats is None:
            stats = self._devices[device] = _DeviceBytes()
        return stats

    # --- hooks that label what appears during the step -----------------------------------------

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._see(param.grad, "gradients", relabel=True)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        self.count_existing(_state_tensors(optimizer), "optimizer_state")


_OPEN: list[LiveBytesTracker] = []  # trackers entered and not yet left, innermost last
_STORAGE_RESIZE = torch.UntypedStorage.resize_
_OWN_RESIZE = "resize_" in vars(torch.UntypedStorage)  # else inherited from torch._C.StorageBase


def _restore_storage_resize() -> None:
    if _OWN_RESIZE:
        torch.UntypedStorage.resize_ = _STORAGE_RESIZE
    else:
        del torch.UntypedStorage.resize_


def _reported_resize(storage, size):
    """`UntypedStorage.resize_` that tells every open tracker (module docstring)."""
    result = _STORAGE_RESIZE(storage, size)
    for tracker in _OPEN:
        tracker._resized(storage)
    return result


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
