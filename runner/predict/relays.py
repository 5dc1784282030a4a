"""Relays: a block's shapes without its work.

A trace (runner/predict/parts.py) makes only a few blocks real; every other block's forward is replaced
by a relay: an autograd function that takes the block's inputs and returns fresh outputs of the real
block's shapes, and in backward fresh gradients for its inputs, holding nothing. Each new input
signature learns its output's layout (a `Template`) from one real forward without gradients.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class _Relay(torch.autograd.Function):
    """Fresh outputs of the given layout; in backward, fresh gradients of the inputs' layouts (none for
    the trigger, which only makes the outputs need gradients)."""

    @staticmethod
    def forward(ctx, layout, triggered, *inputs):
        ctx.layouts, ctx.triggered = [(t.shape, t.stride(), t.dtype) for t in inputs], triggered
        outputs = tuple(torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=inputs[0].device)
                        for spec in layout)
        ctx.mark_non_differentiable(*[out for out, spec in zip(outputs, layout, strict=True) if not spec.grad])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.triggered:
            return (None, None, None)
        device = next(g.device for g in grads if g is not None)
        return (None, None, *(torch.empty_strided(shape, stride, dtype=dtype, device=device) if needed else None
                              for (shape, stride, dtype), needed in zip(ctx.layouts, ctx.needs_input_grad[2:],
                                                                        strict=True)))


@dataclass(frozen=True)
class Template:
    """A block's output for a given input: its tree, and per leaf a tensor layout (shape, stride, dtype,
    needs grad), the input leaf it returns as it is (an int), or a value."""

    tree: object
    leaves: tuple


def relay_forward(forward, module: torch.nn.Module, templates: dict, trigger: torch.Tensor):
    """`module`'s forward as a relay (module docstring); each new input signature learns its output's
    layout from one real forward without gradients."""
    trainable = any(p.requires_grad for p in module.parameters())

    @functools.wraps(forward)
    def run(*args, **kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        key = (type(module), parameter_signature(module), leaf_signature(leaves), torch.is_autocast_enabled("cpu"),
               torch.get_autocast_dtype("cpu"))
        template = templates.get(key)
        if template is None:
            template = templates[key] = _learn(module, args, kwargs, leaves, trainable)
        layout = [leaf for leaf in template.leaves if isinstance(leaf, _Fresh)]
        needs = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        fresh = iter(_Relay.apply(layout, not needs, *(needs or [trigger])) if layout else ())
        out = [next(fresh) if isinstance(leaf, _Fresh) else leaves[leaf.index] if isinstance(leaf, _Given)
               else leaf.value for leaf in template.leaves]
        return tree_unflatten(out, template.tree)
    return run


@dataclass(frozen=True)
class _Fresh:
    shape: torch.Size
    stride: tuple
    dtype: torch.dtype
    grad: bool


@dataclass(frozen=True)
class _Given:
    index: int


@dataclass(frozen=True)
class _Value:
    value: object


def _learn(module: torch.nn.Module, args, kwargs, leaves: list, trainable: bool) -> Template:
    needs_grad = trainable or any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
    keys = {storage_id(x): i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)}
    # no gradients, and autocast's cast copies not cached: nothing of this forward outlives it
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.get_autocast_dtype("cpu"),
                                         enabled=torch.is_autocast_enabled("cpu"), cache_enabled=False), \
            _gathered(module):
        output = type(module).forward(module, *args, **kwargs)
    out_leaves, tree = tree_flatten(output)
    described = []
    for leaf in out_leaves:
        if not isinstance(leaf, torch.Tensor):
            described.append(_Value(leaf))
        elif storage_id(leaf) in keys:
            described.append(_Given(keys[storage_id(leaf)]))  # the block hands an input on unchanged
        else:
            described.append(_Fresh(leaf.shape, leaf.stride(), leaf.dtype, needs_grad and leaf.is_floating_point()))
    return Template(tree, tuple(described))


@contextlib.contextmanager
def _gathered(module: torch.nn.Module):
    """A block FSDP2 split holds its shards only; its forward runs on its gathered parameters, which its
    hooks gather in a step (a relay of one of several ranks runs without them: runner/predict/rank_parts.py)."""
    unshard, reshard = getattr(module, "unshard", None), getattr(module, "reshard", None)
    if unshard is None or reshard is None:
        yield
        return
    unshard()
    try:
        yield
    finally:
        reshard()


def parameter_signature(module: torch.nn.Module) -> tuple:
    return tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()) + \
        tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers())


def leaf_signature(leaves: list) -> tuple:
    """What a block is given, in the terms its work depends on: tensors' shapes, strides, dtypes and
    whether they need gradients; plain values as they are; other objects by their type."""
    return tuple((tuple(x.shape), x.stride(), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else
                 x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__ for x in leaves)


def storage_id(tensor: torch.Tensor) -> int | None:
    """What names a tensor's memory: its storage (a DTensor's local shard's), None for other wrapper subclasses."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor (FSDP2's gradients, one of several ranks) holds its shard
    if isinstance(local, torch.Tensor):
        tensor = local
    if is_traceable_wrapper_subclass(tensor):
        return None
    try:
        return id(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None
