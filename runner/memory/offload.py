"""Activation offload: the saved activations of chosen blocks wait in pinned host memory.

While a chosen block runs forward, `saved_tensors_hooks` copies each tensor autograd saves for
backward (at least `min_bytes`, on the training device, not a weight) into a pinned host buffer
and lets the device copy go; backward copies it back just before the op that needs it. The
device-to-host copy runs on a side stream so compute does not wait for it; events order the two
streams. Host buffers come from a pool keyed by byte size and are reused every step, because
pinning memory costs far more than copying into it.

On a checkpointed block the hooks sit outside the checkpoint, so what goes to the host is what
the checkpoint keeps: the block's input (and, for selective checkpointing, the cached outputs).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import defaultdict
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ..plan import Offload
from .blocks import BlockList, Undo, short_list, undo_all, wrap_forward
from .measure import format_bytes

log = logging.getLogger("ckrun")

CPU_REFUSAL = ("memory.offload: activation offload moves activations from GPU to host memory; this run is on the "
               "CPU, so there is nothing to save - set memory.offload.policy: none")


def offloaded_blocks(policy: Offload, blocks: BlockList) -> list[int]:
    if policy.policy == "all":
        return list(range(len(blocks)))
    if policy.policy == "layers":
        blocks.check_indices("memory.offload.layers", policy.layers)
        return list(policy.layers)
    return []


def apply_offload(blocks: BlockList, policy: Offload, device: torch.device,
                  use_side_stream: bool = True) -> tuple[Undo, ActivationOffload | None]:
    """Offload the saved activations of the blocks `policy` names; returns (undo, the offloader)."""
    if policy.policy == "none":
        return undo_all([]), None
    if torch.device(device).type != "cuda":
        raise ValueError(CPU_REFUSAL)
    chosen = offloaded_blocks(policy, blocks)
    offload = ActivationOffload(device, int(policy.min_bytes), use_side_stream)
    log.info("offloading saved activations of %d of %d blocks (%s) to pinned host memory%s; tensors under %s stay",
             len(chosen), len(blocks), short_list(chosen), " on a side stream" if use_side_stream else "",
             format_bytes(int(policy.min_bytes)))
    return undo_all([wrap_forward(blocks[i].module, offload.wrapper, blocks[i].module) for i in chosen]), offload


class HostPool:
    """Host buffers by byte size, each with the event after which it may be written again."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = defaultdict(list)
        self.allocated_bytes = 0
        self.lock = threading.Lock()  # buffers come back from autograd's backward threads

    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        with self.lock:
            if self.free[nbytes]:
                return self.free[nbytes].pop()
            self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None

    def give(self, buffer: torch.Tensor, last_use: list) -> None:
        with self.lock:
            self.free[buffer.numel()].append((buffer, last_use[0]))


class _Offloaded:
    """What autograd keeps instead of a device tensor: its host copy and when that copy is done."""

    __slots__ = ("host", "device", "copied", "last_use", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, copied, last_use: list):
        self.host, self.device, self.copied, self.last_use = host, device, copied, last_use


class ActivationOffload:
    """saved_tensors_hooks that move large saved activations of a block to host memory.

    `device` is the training device; a CPU device is accepted here only so tests can run the
    hooks without a GPU (host and "device" are then the same memory).
    """

    def __init__(self, device: torch.device | str, min_bytes: int, use_side_stream: bool = True):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.min_bytes = min_bytes
        self.pool = HostPool(pin=self.cuda)
        self.stream = torch.cuda.Stream(self.device) if self.cuda and use_side_stream else None
        self.offloaded_bytes = 0  # totals since creation, for logs and tests
        self.offloaded_count = 0

    def wrapper(self, forward: Callable, module: nn.Module) -> Callable:
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            with self.hooks(module):
                return forward(*args, **kwargs)
        return run

    def hooks(self, module: nn.Module) -> saved_tensors_hooks:
        """The hooks for one forward of `module`: its weights stay, a tensor saved twice is copied once."""
        weights = _LazyStorages(module)
        seen: dict[int, tuple[weakref.ref, _Offloaded]] = {}
        return saved_tensors_hooks(functools.partial(self._pack, weights, seen), self._unpack)

    def wants(self, tensor: torch.Tensor) -> bool:
        # plain tensors only: parameters stay, and so do fake/meta tensors of a memory estimate
        return (type(tensor) is torch.Tensor and tensor.device == self.device and tensor.layout is torch.strided
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _pack(self, weights: _LazyStorages, seen: dict, tensor: torch.Tensor):
        if not self.wants(tensor) or weights.holds(tensor):
            return tensor
        hit = seen.get(id(tensor))
        if hit is not None and hit[0]() is tensor:
            return hit[1]
        packed = self._copy_out(tensor)
        seen[id(tensor)] = (weakref.ref(tensor), packed)
        return packed

    def _copy_out(self, tensor: torch.Tensor) -> _Offloaded:
        nbytes = tensor.numel() * tensor.element_size()
        buffer, writable = self.pool.take(nbytes)
        host = buffer.view(tensor.dtype).view(tensor.shape)
        copied = None
        if not self.cuda:
            host.copy_(tensor)
        else:
            compute = torch.cuda.current_stream(self.device)
            stream = compute if self.stream is None else self.stream
            if stream is not compute:
                stream.wait_stream(compute)  # the kernel that produced the tensor must finish first
            with torch.cuda.stream(stream):
                if writable is not None:
                    stream.wait_event(writable)  # last step's copy back out of this buffer
                host.copy_(tensor, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            if self.stream is not None:
                tensor.record_stream(self.stream)  # the allocator must not reuse it until the copy is done
        self.offloaded_bytes += nbytes
        self.offloaded_count += 1
        last_use = [copied]
        packed = _Offloaded(host, tensor.device, copied, last_use)
        # the buffer goes back to the pool when autograd drops the saved tensor (after backward)
        weakref.finalize(packed, self.pool.give, buffer, last_use)
        return packed

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.copied is None:
            return packed.host.clone()
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(packed.copied)
        tensor = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=packed.device)
        tensor.copy_(packed.host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(current)
        packed.last_use[0] = done
        return tensor


class _LazyStorages:
    """The storages of a module's parameters and buffers, looked up on the first tensor that asks."""

    def __init__(self, module: nn.Module):
        self.module, self.pointers = module, None

    def holds(self, tensor: torch.Tensor) -> bool:
        if self.pointers is None:
            tensors = [*self.module.parameters(), *self.module.buffers()]
            self.pointers = {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}
        return tensor.untyped_storage().data_ptr() in self.pointers
