"""Mixture-of-experts models: which of transformers' expert kernels runs them, and that kernel on fake tensors.

transformers 5 runs the experts of Mixtral, Qwen2-MoE, OLMoE and the other models whose experts class
it decorates with `@use_experts_implementation` by the kernel the config's `experts_implementation`
names: `grouped_mm` (its default: the tokens sorted by expert, then one grouped matmul over all experts,
torch's `_grouped_mm`), `batched_mm` (every token's expert weights gathered: memory-hungry), or `eager`
(a Python loop over the experts hit, each taking the tokens routed to it).

What ckrun picks when the recipe does not say (`model.config.experts_implementation` is kept as given):
transformers' own `grouped_mm` where torch's grouped kernel runs the model's expert weights, else its
`eager` experts, and the log says which and why. torch's kernel (CPU, and CUDA's fallback for fp32)
needs every stride of its operands to be a multiple of 16 bytes: an fp32 expert whose hidden or
intermediate width is not a multiple of 4 fails there at the first step, so such a model runs eagerly.

Memory: grouped_mm's tensors have the batch's shapes (tokens x top-k rows) whatever the router decides,
so its peak depends only on shapes and plan; eager's follow how many tokens each expert takes
(`routing_decides_bytes`), which the estimate has to assume (runner/predict/routing.py).

torch's fake (meta) kernel of `_grouped_mm` takes bf16 and fp16 only (it mirrors CUDA's fast path),
while the real kernels also take fp32: ckrun's models keep fp32 weights, so without
`GroupedMmOnFake` validation and the estimate would refuse a model that trains.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .resolve import BuildError

log = logging.getLogger(__name__)

GROUPED, EAGER = "grouped_mm", "eager"
ALIGNMENT = 16  # bytes: torch's grouped kernel needs every stride of its operands to be a multiple of this
KEYWORD = "experts_implementation"  # transformers' public config keyword


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules transformers' `@use_experts_implementation` decorates (it gives them these flags)."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
            and hasattr(m, "config")]


def implementation(module: nn.Module) -> str | None:
    """The kernel an experts module runs by; None when the config names none (transformers' default)."""
    return getattr(module.config, "_experts_implementation", None)


def routing_decides_bytes(model: nn.Module) -> bool:
    """Whether the step's peak follows the router's choices: some experts run eagerly (module docstring)."""
    return any(implementation(m) == EAGER for m in experts_modules(model))


def settle_experts(model: nn.Module, given: dict, say: bool = True) -> str | None:
    """Set the experts' kernel (module docstring) and log it when `say`; the kernel's name, or None
    for a model without transformers experts."""
    modules = experts_modules(model)
    if not modules:
        return None
    if KEYWORD in given:
        chosen, why = given[KEYWORD], "model.config.experts_implementation"
        unaligned = _unaligned(modules) if chosen == GROUPED else None
        if unaligned:  # asked for by name: said at the key, not met as a stride error at the first step
            raise BuildError(("model", "config", KEYWORD), f"grouped_mm needs {ALIGNMENT}-byte strides, and "
                             f"{unaligned.removesuffix('; eager experts run it')}; give widths that fit (fp32: "
                             "multiples of 4), or leave experts_implementation out (eager experts run it)")
    else:
        unaligned = _unaligned(modules)
        chosen = EAGER if unaligned else GROUPED
        why = (f"transformers' grouped kernel needs {ALIGNMENT}-byte strides, and {unaligned}" if unaligned else
               "transformers' grouped kernel: one grouped matmul over the experts, shapes fixed by the batch")
        if implementation(modules[0]) != chosen:
            _set(model, chosen)
    if say:
        memory = ("its bytes follow how many tokens the router sends each expert" if chosen == EAGER
                  else "its bytes do not depend on the routing")
        log.info("experts: %s (%s; %s)", chosen, why, memory)
    return chosen


def _unaligned(modules: list[nn.Module]) -> str | None:
    """The first expert weight with a width whose rows torch's grouped kernel cannot take, said in words."""
    for module in modules:
        for name, weight in module.named_parameters(recurse=False):
            if weight.dim() != 3:
                continue
            for width in weight.shape[1:]:
                if width * weight.element_size() % ALIGNMENT:
                    return (f"{type(module).__name__}.{name} has rows of {width} x {weight.element_size()} bytes; "
                            "eager experts run it")
    return None


def _set(model: nn.Module, chosen: str) -> None:
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        setter(chosen)
        return
    for module in experts_modules(model):  # an older transformers: the attribute its experts read
        module.config._experts_implementation = chosen


class GroupedMmOnFake(TorchDispatchMode):
    """`_grouped_mm` on fake fp32 tensors: the output the real kernel gives (its shape rules, a new
    contiguous tensor) after the real kernel's stride check, where torch's fake kernel refuses fp32.
    Every other op, and bf16/fp16, go to the fake kernels as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and _fake_fp32(args[0]):
            return grouped_output(*args, **kwargs)
        return func(*args, **kwargs)


def _fake_fp32(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) and tensor.dtype == torch.float32


def grouped_output(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    """An empty tensor of `_grouped_mm`'s output (aten's create_grouped_gemm_output_tensor's shapes),
    after the real kernel's stride check (check_valid_strides_and_return_transposed)."""
    for operand in (mat_a, mat_b):
        _check_strides(operand)
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # one product per group of the shared dimension
        shape = (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    elif mat_a.dim() == 2:  # rows of mat_a grouped, one weight each: the MoE case
        shape = (mat_a.shape[0], mat_b.shape[-1])
    elif mat_b.dim() == 2:
        shape = (mat_a.shape[1], mat_b.shape[1])
    else:
        shape = (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def _check_strides(mat: torch.Tensor) -> None:
    """A matrix the kernel reads row- or column-major, its leading stride a multiple of 16 bytes."""
    (rows, cols), (row_stride, col_stride) = mat.shape[-2:], mat.stride()[-2:]
    if row_stride == 1 and col_stride >= max(1, rows):
        leading = col_stride
    elif col_stride == 1 and row_stride >= max(1, cols):
        leading = row_stride
    else:
        raise RuntimeError(f"Invalid strides/sizes, got {list(mat.stride())} for strides and {list(mat.shape)} for sizes")
    torch._check(leading % (ALIGNMENT // mat.element_size()) == 0, lambda: "strides should be multiple of 16 bytes")
