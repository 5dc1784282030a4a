"""Activation offload: the saved activations of chosen blocks wait in pinned host memory.

The schedule is torchtune's OffloadActivations, per block:

- Forward. While a chosen block runs, `saved_tensors_hooks` copy each tensor autograd saves for
  backward that `offloadable` accepts (on the training device, at least `min_bytes`, not a weight
  nor a view or autocast cast of one) into a pinned host buffer on a side stream. The device
  tensor stays in a stash until its copy is done: when block k starts, the compute stream waits
  for the copies of block k-2 and lets their device tensors go. That bounds what is in flight to
  two blocks, and since nothing calls `record_stream`, freed memory is reusable at once, in the
  compute stream's order, so the allocator's reserve (what a cap limits) really drops.
- Backward. The first unpack of a block's tensors brings the block back (unless prefetched) and
  prefetches the block before it on the side stream, into memory allocated on the compute stream;
  compute waits only for the copy of the tensor it needs. Blocks whose copies were still stashed
  when backward began (the last ones) use their device tensors: no round trip. Each copy (host and
  device) goes as the node that saved it is done, not with its block's last node.
- A forward that never reaches backward (an out-of-memory mid-step, inside an offloaded block or
  after them) leaves no state behind: its stashed device tensors are let go once their copies are
  done, and the next forward starts a chain of its own.

Host buffers come from a pool of size classes (`HostPool`), so new shapes (text of varying length,
adaptive plans) reuse buffers of nearby sizes, and free buffers beyond what was ever in use at once
go back to torch. A host copy keeps the saved tensor's strides (channels_last stays channels_last).

The memory estimate runs this same class with `CopyTransport(meta)`: the same pack rule and the same
stash and prefetch timing, with fake host copies. On a checkpointed block the hooks sit outside the
checkpoint, so what goes to the host is what the checkpoint keeps: the block's input (and, on torch
>= 2.14, the outputs selective checkpointing caches).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ..plan.memory_plan import Offload
from ..units import format_bytes
from .blocks import BlockList, Undo, short_list, undo_all, wrap_forward
from .torch_features import storage_key

log = logging.getLogger(__name__)

CPU_REFUSAL = ("memory.offload: activation offload moves activations from GPU to host memory; this run is on the "
               "CPU, so there is nothing to save - set memory.offload.policy: none")

# autograd nodes that only view or cast their input: a saved tensor reached from a parameter through
# these alone is the parameter itself in another dtype or shape (autocast's bf16 weight, a transpose)
_VIEWS_AND_CASTS = frozenset({
    "ToCopyBackward0", "TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
    "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "ReshapeAliasBackward0", "SliceBackward0", "SelectBackward0",
})


def derived_from_parameter(tensor: torch.Tensor, depth: int = 6) -> bool:
    """True for a parameter and for views and casts of one: under autocast, each forward saves the
    bf16 copy of every weight it multiplies with. Moving those to the host and back would cost
    bandwidth every micro-batch and save nothing: the next forward makes them again."""
    if tensor.grad_fn is None:
        return isinstance(tensor, nn.Parameter)
    node = tensor.grad_fn
    for _ in range(depth):
        if node.name().endswith("AccumulateGrad"):
            return isinstance(getattr(node, "variable", None), nn.Parameter)
        parents = [parent for parent, _ in node.next_functions if parent is not None]
        if node.name() not in _VIEWS_AND_CASTS or len(parents) != 1:
            return False
        node = parents[0]
    return False


def offloadable(tensor: torch.Tensor, device: torch.device, min_bytes: int, own: ModuleStorages) -> bool:
    """The one rule of what goes to the host, shared by training and the memory estimate."""
    nbytes = tensor.numel() * tensor.element_size()
    return (tensor.device == device and tensor.layout is torch.strided and nbytes > 0 and nbytes >= min_bytes
            and not derived_from_parameter(tensor) and not own.holds(tensor))


def apply_offload(blocks: BlockList, policy: Offload, device: torch.device) -> tuple[Undo, ActivationOffload | None]:
    """Offload the saved activations of the blocks `policy` names; returns (undo, the offloader)."""
    if not policy.moves:
        return undo_all([]), None
    if torch.device(device).type != "cuda":
        raise ValueError(CPU_REFUSAL)
    chosen = policy.chosen(blocks)
    offload = ActivationOffload(device, int(policy.min_bytes), CudaTransport(device))
    log.info("offloading saved activations of %d of %d blocks (%s) to pinned host memory on a side stream, at "
             "most two blocks in flight; weights and tensors under %s stay", len(chosen), len(blocks),
             short_list(chosen), format_bytes(int(policy.min_bytes)))
    return undo_all([wrap_forward(blocks[i].module, offload.wrapper, blocks[i].module) for i in chosen]), offload


# --- moving bytes ------------------------------------------------------------------------------


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to a quarter of its power of two (at least 512 B): at most 25% unused."""
    step = max(512, (1 << (max(nbytes, 1).bit_length() - 1)) // 4)
    return -(-nbytes // step) * step


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostPool:
    """Pinned host buffers by size class, reused every step: pinning costs far more than copying.
    Every copy into or out of a buffer runs on the one side stream, so their order is the stream's.

    Free buffers are kept up to the most bytes ever in use at once (what a step takes back); past
    that the least recently used go back to torch, whose caching host allocator holds a buffer until
    the copies recorded on it are done and reuses it for any pinned request of its size. So the pool
    holds at most twice a step's need, however many shapes come by (it was keyed by exact size and
    never gave anything back: host memory grew with every new batch length)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] = _pinned):
        self.allocate = allocate
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocated_bytes = 0  # held now: in use and free
        self.in_use_bytes = self.most_in_use_bytes = self.free_bytes = 0
        self._used_at: dict[int, int] = {}  # size class -> when it was last taken or given (a counter)
        self._clock = 0
        self.lock = threading.Lock()  # buffers come back from autograd's backward thread

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `nbytes` (its size class)."""
        size = size_class(nbytes)
        with self.lock:
            self._touch(size)
            self.in_use_bytes += size
            self.most_in_use_bytes = max(self.most_in_use_bytes, self.in_use_bytes)
            if self.free[size]:
                self.free_bytes -= size
                return self.free[size].pop()
            self.allocated_bytes += size
        return self.allocate(size)

    def give(self, buffer: torch.Tensor) -> None:
        size = buffer.numel()
        with self.lock:
            self._touch(size)
            self.in_use_bytes -= size
            self.free[size].append(buffer)
            self.free_bytes += size
            self._trim()

    def _touch(self, size: int) -> None:
        self._clock += 1
        self._used_at[size] = self._clock

    def _trim(self) -> None:
        for size in sorted(self.free, key=self._used_at.__getitem__):
            while self.free_bytes > self.most_in_use_bytes and self.free[size]:
                self.free[size].pop()
                self.free_bytes -= size
                self.allocated_bytes -= size
            if self.free_bytes <= self.most_in_use_bytes:
                return


def host_view(buffer: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`buffer`'s first bytes as a tensor of `tensor`'s shape, dtype and strides (for a dense tensor:
    its own, so channels_last stays channels_last and the copy is one memcpy; otherwise dense
    strides in the same order, as `empty_like` picks them)."""
    strides = torch.empty_like(tensor, device="meta").stride()
    flat = buffer[: tensor.numel() * tensor.element_size()].view(tensor.dtype)
    return flat.as_strided(tensor.shape, strides)


def device_like(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An empty device tensor with the host copy's shape, dtype and strides."""
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


class CudaTransport:
    """Copies on a side stream. Device memory is always allocated on the compute stream, which then
    waits for the copy's event before it uses (or frees) the tensor: no record_stream needed."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.pool = HostPool()

    def accepts(self, tensor: torch.Tensor) -> bool:
        return type(tensor) is torch.Tensor  # tensor subclasses (DTensor, float8) are left alone

    def to_host(self, tensor: torch.Tensor, owner: object) -> tuple[torch.Tensor, torch.cuda.Event]:
        buffer = self.pool.take(tensor.numel() * tensor.element_size())
        host = host_view(buffer, tensor)
        weakref.finalize(owner, self.pool.give, buffer)  # back to the pool when autograd drops the entry
        return host, self._on_side_stream(lambda: host.copy_(tensor, non_blocking=True))

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        tensor = device_like(host, self.device)  # on the compute stream
        return tensor, self._on_side_stream(lambda: tensor.copy_(host, non_blocking=True))

    def _on_side_stream(self, copy: Callable) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the data, or the memory, is ready
        with torch.cuda.stream(self.stream):
            copy()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class CopyTransport:
    """Synchronous copies to `host`: CPU tests (host "cpu") and the memory estimate (host "meta", so
    fake host copies are counted apart from the device)."""

    def __init__(self, device: torch.device, host: torch.device):
        self.device, self.host = torch.device(device), torch.device(host)

    def accepts(self, tensor: torch.Tensor) -> bool:
        return True

    def to_host(self, tensor: torch.Tensor, owner: object) -> tuple[torch.Tensor, None]:
        return tensor.to(self.host, copy=True), None

    def to_device(self, host: torch.Tensor) -> tuple[torch.Tensor, None]:
        return host.to(self.device, copy=True), None

    def wait(self, event) -> None:
        pass


# --- the schedule ------------------------------------------------------------------------------


class _Offloaded:
    """What autograd keeps instead of a device tensor: the host copy, and the device tensor while it
    exists (stashed in forward, fetched in backward)."""

    __slots__ = ("host", "device_tensor", "ready", "group", "__weakref__")

    def __init__(self, group: _Group):
        self.host, self.device_tensor, self.ready, self.group = None, None, None, group


class _Group:
    """The offloaded tensors of one forward of one block, linked to the block that ran before it."""

    def __init__(self, previous: _Group | None):
        self.previous = previous
        self.entries: list[weakref.ref] = []  # autograd owns the entries; a group must not keep them alive
        self.stash: list[tuple[torch.Tensor, object]] = []  # (device tensor, its copy's event) in flight
        self.fetched = False


class ActivationOffload:
    """saved_tensors_hooks that move large saved activations of chosen blocks to the host and back,
    on the schedule in the module docstring. `transport` does the copies (`CudaTransport` in training)."""

    def __init__(self, device: torch.device | str, min_bytes: int, transport: CudaTransport | CopyTransport):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes, self.transport = min_bytes, transport
        self._last: _Group | None = None  # the newest group of the forward now running, None in backward
        self.offloaded_bytes = 0  # totals since creation, for logs and tests
        self.offloaded_count = 0

    def wrapper(self, forward: Callable, module: nn.Module) -> Callable:
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            copied: dict = {}
            try:
                with self.hooks(module, copied):
                    return forward(*args, **kwargs)
            except BaseException:
                self.reset()  # an out-of-memory mid-forward: this forward will see no backward
                raise
            finally:  # autograd keeps the pack hook as long as any tensor the block saved: were its note of what it
                # copied kept too, each copy (host, and the device copy fetched back) would live until the block's
                # last node is done, not its own
                copied.clear()
        return run

    def reset(self) -> None:
        """Forget the forward in progress: its stashed device tensors go once their copies are done
        (compute waits for them first, so the memory is reused only after), and the next forward
        starts a chain of its own. The host copies go with the entries autograd drops."""
        group, self._last = self._last, None
        while group is not None:
            self._release(group)
            group.previous, group = None, group.previous

    def hooks(self, module: nn.Module, seen: dict | None = None) -> saved_tensors_hooks:
        """The hooks for one forward of `module`; a tensor saved twice in it is copied once (`seen`: the note of
        what was copied, for the caller to clear when the forward is over)."""
        if self._last is not None and self._abandoned():
            self.reset()  # the last forward failed after the offloaded blocks (in the head, the loss)
        if self._last is not None and self._last.previous is not None:
            self._release(self._last.previous)  # block k starts: block k-2's copies must be done
        group = self._last = _Group(self._last)
        own, seen = ModuleStorages(module), {} if seen is None else seen
        return saved_tensors_hooks(functools.partial(self._pack, group, own, seen), self._unpack)

    def _pack(self, group: _Group, own: ModuleStorages, seen: dict, tensor: torch.Tensor):
        if not self.transport.accepts(tensor) or not offloadable(tensor, self.device, self.min_bytes, own):
            return tensor
        hit = seen.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        entry = _Offloaded(group)
        entry.host, copied = self.transport.to_host(tensor, entry)
        group.entries.append(weakref.ref(entry))
        # detached: the stash keeps the memory until its copy is done, not the graph (a forward that
        # never reaches backward must let its entries go, which is how `_abandoned` knows it)
        group.stash.append((tensor.detach(), weakref.ref(entry), copied))
        seen[id(tensor)] = (weakref.ref(tensor), entry)
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        self.offloaded_count += 1
        return entry

    def _abandoned(self) -> bool:
        """Autograd dropped every entry of the forward in progress: it ended without a backward. (In a
        forward that goes on, the graph holds the entries of the blocks that ran.)"""
        refs, group = [], self._last
        while group is not None:
            refs += group.entries
            group = group.previous
        return bool(refs) and all(ref() is None for ref in refs)

    def _unpack(self, entry):
        if not isinstance(entry, _Offloaded):
            return entry
        if self._last is not None:
            self._begin_backward()
        group = entry.group
        self._fetch(group)
        if group.previous is not None:
            self._fetch(group.previous)  # prefetch: its copies overlap this block's backward
        if entry.device_tensor is None:  # the entry was created after its group was fetched
            entry.device_tensor, entry.ready = self.transport.to_device(entry.host)
        self.transport.wait(entry.ready)
        return entry.device_tensor

    def _release(self, group: _Group) -> None:
        """Forward: let a group's device tensors go once the compute stream has waited for their copies."""
        if group.stash:
            self.transport.wait(group.stash[-1][2])  # one side stream: the last copy ends after the rest
            group.stash.clear()

    def _begin_backward(self) -> None:
        """The forward is over: stashed device tensors serve backward directly (their copies are waited
        for, since the memory is freed in compute order once backward is done with it)."""
        group, self._last = self._last, None
        while group is not None:  # the whole chain: a block that offloaded nothing has an empty stash
            if not group.stash:
                group = group.previous
                continue
            self.transport.wait(group.stash[-1][2])
            for tensor, entry_ref, _ in group.stash:
                entry = entry_ref()
                if entry is not None:
                    entry.device_tensor = tensor
            group.stash.clear()
            group.fetched = True
            group = group.previous

    def _fetch(self, group: _Group) -> None:
        if group.fetched:
            return
        group.fetched = True
        for entry_ref in group.entries:
            entry = entry_ref()
            if entry is not None and entry.device_tensor is None:
                entry.device_tensor, entry.ready = self.transport.to_device(entry.host)


class ModuleStorages:
    """The storages of a module's parameters and buffers (a buffer saved for backward stays), looked
    up on the first tensor that asks."""

    def __init__(self, module: nn.Module):
        self.module, self.keys = module, None

    def holds(self, tensor: torch.Tensor) -> bool:
        if self.keys is None:
            self.keys = {storage_key(t) for t in (*self.module.parameters(), *self.module.buffers())}
        return storage_key(tensor) in self.keys
