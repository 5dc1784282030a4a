"""Activation compression: the saved activations of every block are kept in a lower precision.

While a block runs forward, `saved_tensors_hooks` replace each floating tensor autograd saves for
backward (not a weight nor a view or cast of one, at least `min_bytes`) by a rounded copy: bf16 for
fp32 tensors, or float8_e4m3fn with one scale per tensor (amax / 448, so nothing overflows; see
`to_fp8` for the transient it costs and what a non-finite tensor becomes). The original is then free
to go, and backward gets the copy cast back to the original dtype. This is lossy: the gradient
changes by the rounding, which `gradient_error` (runner/train/measure/lossy.py) measures.

Composition. The hooks sit outside a checkpointed block's checkpoint, as offload's do: what gets
compressed there is what the checkpoint keeps (its input), and the recompute starts from the rounded
input. On a block that is offloaded too, offload's hooks are entered first and these chain to them:
the compressed copy goes to the host, so the copy moves fewer bytes. autograd only calls the top pair
of its hook stack, so the chaining reads the pair beneath (a private torch call, feature-detected).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks

from ..plan.memory_plan import Compression
from ..plan.policies import CastCompression, float8
from ..units import format_bytes
from .blocks import BlockList, Undo, undo_all, wrap_forward
from .offload import ModuleStorages, derived_from_parameter

log = logging.getLogger(__name__)

FP8 = float8()  # None on a torch without float8
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def chaining_missing() -> str | None:
    if _TOP_HOOKS is None:
        return (f"memory.compression: cannot be combined with memory.offload on torch {torch.__version__} (it "
                "cannot chain saved-tensor hooks); set memory.offload.policy: none or memory.compression.policy: none")
    return None


def outer_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in force before ours (offload's), or None."""
    return _TOP_HOOKS(True) if _TOP_HOOKS is not None else None


class _Compressed:
    """What autograd keeps instead of a tensor: its rounded copy (or what outer hooks made of it)."""

    __slots__ = ("data", "dtype", "scale")

    def __init__(self, data, dtype: torch.dtype, scale: torch.Tensor | None):
        self.data, self.dtype, self.scale = data, dtype, scale


class ActivationCompression:
    """saved_tensors_hooks that round saved activations of chosen blocks; counts what they stored."""

    def __init__(self, policy: CastCompression):
        self.policy, self.target, self.min_bytes = policy.label(), policy.stored_dtype(), int(policy.min_bytes)
        self.original_bytes = 0  # totals since creation: what the compressed tensors held, and now hold
        self.stored_bytes = 0
        self.count = 0
        self.enabled = True  # off: the exact plan, for measuring the gradient error on the same model

    def wrapper(self, forward: Callable, module: nn.Module) -> Callable:
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled() or not self.enabled:
                return forward(*args, **kwargs)
            with self.hooks(module):
                return forward(*args, **kwargs)
        return run

    def hooks(self, module: nn.Module) -> saved_tensors_hooks:
        """The hooks for one forward of `module`, chained to the hooks already in force."""
        outer = outer_hooks()
        own = ModuleStorages(module)
        pack = functools.partial(self._pack, own, outer[0] if outer else None)
        return saved_tensors_hooks(pack, functools.partial(self._unpack, outer[1] if outer else None))

    def compressible(self, tensor: torch.Tensor, own: ModuleStorages) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        # subclasses (DTensor, float8 tensors) are left alone; fake ones are the estimate's, which must count
        return (type(tensor) in (torch.Tensor, FakeTensor) and tensor.is_floating_point() and tensor.layout is torch.strided
                and tensor.element_size() > self.target.itemsize and nbytes >= max(1, self.min_bytes)
                and not derived_from_parameter(tensor) and not own.holds(tensor))

    def _pack(self, own: ModuleStorages, outer_pack: Callable | None, tensor: torch.Tensor):
        # no de-duplication of a tensor saved twice (offload has one): a table of what was packed held
        # the copies for the whole block and made the peak depend on when Python freed it
        if not self.compressible(tensor, own):
            return outer_pack(tensor) if outer_pack else tensor
        rounded, scale = self.compress(tensor.detach())
        self.original_bytes += tensor.numel() * tensor.element_size()
        self.stored_bytes += rounded.numel() * rounded.element_size() + (0 if scale is None else scale.element_size())
        self.count += 1
        return _Compressed(outer_pack(rounded) if outer_pack else rounded, tensor.dtype, scale)

    def _unpack(self, outer_unpack: Callable | None, entry):
        if not isinstance(entry, _Compressed):
            return outer_unpack(entry) if outer_unpack else entry
        rounded = outer_unpack(entry.data) if outer_unpack else entry.data
        restored = rounded.to(entry.dtype)
        return restored if entry.scale is None else restored.mul_(entry.scale.to(entry.dtype))

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.target is torch.bfloat16:
            return tensor.to(torch.bfloat16), None
        return to_fp8(tensor)


def to_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn copy, scale in the tensor's dtype) with copy * scale ~ tensor.

    The scaling runs in the tensor's own dtype: its one transient is the quotient, the tensor's own
    size (fp32 copies of a bf16 activation made about 4x its bytes, at the moment memory is
    tightest). amax comes from `aminmax`, which makes no |tensor| copy. The scale is held at or above
    the dtype's smallest normal number: in fp16, amax / 448 of a tensor of small values underflowed
    to 0, and the unpacked tensor with it. A non-finite amax (an activation that overflowed, as fp16
    ones can) gives a NaN scale, so the unpacked tensor and the gradients through it are NaN and
    fp16's GradScaler skips the step, as it would have without compression, never a zeroed tensor."""
    low, high = torch.aminmax(tensor)
    amax = torch.maximum(high, -low).float()
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(tensor.dtype).tiny)
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan"))).to(tensor.dtype)
    scaled = tensor / scale
    scaled.clamp_(-FP8_MAX, FP8_MAX)  # a scale rounded to the dtype can put amax just past 448, which fp8 makes NaN
    return scaled.to(FP8), scale


def apply_compression(blocks: BlockList, policy: Compression) -> tuple[Undo, ActivationCompression | None]:
    """Compress the saved activations of every block; returns (undo, the compressor)."""
    if not policy.lossy:
        return undo_all([]), None
    compression = ActivationCompression(policy)
    log.info("memory.compression: saved activations of all %d blocks stored as %s (lossy: the gradient changes "
             "by the rounding); weights and tensors under %s keep their dtype", len(blocks), compression.target,
             format_bytes(int(policy.min_bytes)))
    return undo_all([wrap_forward(block.module, compression.wrapper, block.module) for block in blocks]), compression
