"""Ops whose fake-tensor kernels allocate less than the real ones: where an estimate runs them, it is low.

The estimate runs the step on fake tensors and counts the bytes of every tensor the kernels return.
A few fake (meta) kernels return a placeholder of size 0 where the real kernel returns a workspace
that stays alive until backward; those bytes are missing from the estimate. The amount depends on
the library version (oneDNN, cuDNN), so it is not guessed: the estimate names the op instead.

`FAKE_GAPS` is checked against torch's own meta kernels (torch/_meta_registrations.py); a test
runs a tiny LSTM to see the first entry fire.

A prediction runs these mends as one dispatch mode, `FakeKernelFixes`: every mode is a Python call on
every op of a fake step (~12,000 ops a traced 8B step), and the mends touch four ops among them, so one
table lookup per op replaces three modes' calls (an 8B's traces 15 % faster).
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..builders.experts import GroupedMmOnFake

# op (the overload packet's qualified name) -> what its fake kernel leaves out
FAKE_GAPS = {
    "aten::mkldnn_rnn_layer": "its fake kernel returns a 0-byte workspace where the real one (oneDNN's, kept "
                              "for backward; an LSTM on a CPU) holds every gate of every time step; a CUDA "
                              "estimate runs this CPU kernel too, so cuDNN's reserve is missing there",
    "aten::_cudnn_rnn": "its fake kernel returns a 0-byte cuDNN reserve, which the real RNN keeps for backward",
    "aten::miopen_rnn": "its fake kernel returns a 0-byte MIOpen reserve, which the real RNN keeps for backward",
}


# op -> the output its fake kernel leaves empty; WorkspaceFill gives it its real size where it can
GAP_OUTPUT = {"aten::mkldnn_rnn_layer": 3}
MOST_MEASURED_FLOPS = 2e10  # a real layer run to size its workspace: at most seconds on a CPU


class FakeGapWatch(TorchDispatchMode):
    """Notes which ops of FAKE_GAPS a region runs and leave their bytes out; everything else passes through."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, None] = {}  # ordered set: warnings come out in the order the ops ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name  # "aten::mkldnn_rnn_layer" for every overload
        out = func(*args, **(kwargs or {}))
        if name in FAKE_GAPS and not _filled(name, out):
            self.seen[name] = None
        return out


    def warnings(self) -> list[str]:
        return gap_warnings(self.seen)


class WorkspaceFill(TorchDispatchMode):
    """On fake tensors, oneDNN's LSTM workspace gets the size the real kernel gives it: measured by running
    that one layer for real on zeros of the same shapes (once per shape; its size follows oneDNN's
    internal blocking, which no formula reproduces). A layer too large to run in seconds stays empty,
    and FakeGapWatch warns about it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is not torch.ops.aten.mkldnn_rnn_layer.default or not _is_fake(out[3]) or out[3].nbytes:
            return out
        size = _real_workspace_bytes(*_shapes(args))
        if size is None:
            return out
        workspace = torch.empty(size // out[3].element_size(), dtype=out[3].dtype, device=out[3].device)
        return (*out[:3], workspace, *out[4:])


class FakeKernelFixes(TorchDispatchMode):
    """WorkspaceFill, BatchNormStats and experts' GroupedMmOnFake in one mode, with FakeGapWatch's note of
    what stays unmended (`seen`): each op costs one table lookup, and only the ops they mend run their code."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.seen: dict[str, None] = {}  # as FakeGapWatch's: the unmended gaps, in the order they ran
        fill, stats, grouped = WorkspaceFill(), BatchNormStats(cuda), GroupedMmOnFake()
        # op -> what runs it: a mode's __torch_dispatch__, called as the mode stack would (this mode is off inside)
        self._mends = {**dict.fromkeys(_overloads(FAKE_GAPS), self._watched(None)),
                       torch.ops.aten.mkldnn_rnn_layer.default: self._watched(fill.__torch_dispatch__),
                       **dict.fromkeys(_BATCH_NORMS, stats.__torch_dispatch__),
                       torch.ops.aten._grouped_mm.default: grouped.__torch_dispatch__}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mend = self._mends.get(func)
        if mend is None:
            return func(*args, **(kwargs or {}))
        return mend(func, types, args, kwargs)

    def _watched(self, mend):
        """`mend` (None: the op as it is) with its output checked for a gap left, as FakeGapWatch does."""
        def run(func, types, args=(), kwargs=None):
            out = mend(func, types, args, kwargs) if mend else func(*args, **(kwargs or {}))
            if not _filled(func._schema.name, out):
                self.seen[func._schema.name] = None
            return out
        return run

    def warnings(self) -> list[str]:
        return gap_warnings(self.seen)


def _overloads(names) -> list:
    """Every overload of the ops named (aten::name) that this torch has."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name.split("::")[1], None)
        found += [getattr(packet, overload) for overload in packet.overloads()] if packet is not None else []
    return found


def gap_warnings(seen) -> list[str]:
    return [f"{name.replace('::', '.')}: {FAKE_GAPS[name]}; this estimate leaves that out and is low" for name in seen]


def _filled(name: str, out) -> bool:
    index = GAP_OUTPUT.get(name)
    return index is not None and isinstance(out, tuple) and out[index].nbytes > 0


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _shapes(args) -> tuple:
    """The op's arguments with every tensor as (shape, dtype): what its workspace size depends on."""
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else
                 tuple(a) if isinstance(a, list) else a for a in args)


@functools.lru_cache(maxsize=256)
def _real_workspace_bytes(*shapes) -> int | None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    input_shape, (gates, inputs), hidden_size = shapes[0][0], shapes[1][0], shapes[10]
    flops = 2 * gates * (inputs + hidden_size) * math.prod(input_shape[:-1])  # every step of every row
    if flops > MOST_MEASURED_FLOPS:
        return None
    with unset_fake_temporarily(), torch.enable_grad():  # real zeros; a workspace is kept only for a backward
        real = [torch.zeros(a[0], dtype=a[1]) if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)
                else list(a) if isinstance(a, tuple) else a for a in shapes]
        return int(torch.ops.aten.mkldnn_rnn_layer.default(*real)[3].nbytes)


_BATCH_NORMS = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten._batch_norm_with_update.default,
                          torch.ops.aten._native_batch_norm_legit.default,
                          torch.ops.aten._native_batch_norm_legit.no_stats})
_HALF = (torch.float16, torch.bfloat16)


class BatchNormStats(TorchDispatchMode):
    """On fake tensors, a half-precision BatchNorm's saved mean and inverse deviation get the real kernels'
    float32: the meta kernel gives them the input's dtype, while CPU's kernel computes in its parameters'
    float32 (mixed types, as under autocast: fp32 weights, bf16 activations) and CUDA's (native and cuDNN)
    always in float32. Both are kept for the backward, so every BatchNorm in a bf16 step was 4 bytes a
    channel low (GoogLeNet, MobileNetV3: the estimate below the measured CPU peak)."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in _BATCH_NORMS or args[0].dtype not in _HALF or not _is_fake(out[1]):
            return out
        params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
        if out[1].dtype in _HALF and (self.cuda or any(p.dtype == torch.float32 for p in params)):
            return (out[0], *(stat.to(torch.float32) for stat in out[1:3]), *out[3:])
        return out
