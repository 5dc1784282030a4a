"""Activation checkpointing of chosen blocks: recompute their activations in backward.

Every policy wraps the chosen blocks' `forward` (an instance attribute, so `undo` is a `del`)
in non-reentrant `torch.utils.checkpoint` with the RNG state preserved: dropout masks are the
same in the recompute, so gradients are bit-identical to a run without the plan. Kwargs (HF
attention masks, position embeddings) pass straight through; inputs need not require grad.

A recompute reads the buffers the forward started from and leaves the ones it ended with
(`_BufferReplay`), so BatchNorm's statistics move once per forward and a buffer the forward updates
and reads gives the same activations again. `selective` caches only outputs the block never changes
(selective.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import (checkpoint, create_selective_checkpoint_contexts, noop_context_fn,
                                    set_checkpoint_early_stop)

from ..plan.memory_plan import Checkpointing
from .blocks import BlockList, Undo, undo_all, wrap_forward
from .segments import apply_segments, input_versions, refuse_written_inputs
from .selective import SelectiveBlock, static_policy
from .torch_features import checkpoint_options

log = logging.getLogger(__name__)


def apply_checkpointing(blocks: BlockList, policy: Checkpointing) -> Undo:
    """Wrap the blocks `policy` chooses, each of its regions as one checkpoint; the returned
    function puts the model back as it was."""
    if not policy.recomputes:
        return undo_all([])
    undos = [_kv_cache_off(blocks.root)]
    chosen = policy.chosen(blocks)
    log.info("checkpointing %d of %d blocks (%s)", len(chosen), len(blocks), policy.describe(blocks))
    if policy.spans_blocks:
        undos.append(apply_segments(blocks, policy.regions(blocks), lambda modules: _context_fns(modules, None).eager,
                                    EARLY_STOP))
        return undo_all(undos)
    for region in policy.regions(blocks):
        block = blocks[region[0]]
        undos.append(wrap_forward(block.module, _checkpointed,
                                  _context_fns([block.module], policy, block.name), block.name))
    return undo_all(undos)


def apply_switched(blocks: BlockList, policies: list[Checkpointing], active: Callable[[], int]) -> Undo:
    """Checkpointing chosen at each forward: every block runs under `policies[active()]`. Each block
    that any policy checkpoints is wrapped once, with one checkpointed forward per policy that wants
    it, so switching is a lookup and never a rebuild. No policy may be sqrt (its regions span blocks)."""
    chosen = [set(policy.chosen(blocks)) for policy in policies]
    undos = [_kv_cache_off(blocks.root)] if any(chosen) else []
    for index in sorted(set().union(*chosen)):
        module = blocks[index].module
        contexts = {k: _context_fns([module], p, blocks[index].name)
                    for k, p in enumerate(policies) if index in chosen[k]}
        undos.append(wrap_forward(module, _switched, contexts, active, blocks[index].name))
    return undo_all(undos)


def _switched(forward: Callable, contexts: dict[int, _Contexts], active: Callable[[], int], name: str) -> Callable:
    runs = {k: _checkpointed(forward, context_fns, name) for k, context_fns in contexts.items()}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return runs.get(active(), forward)(*args, **kwargs)
    return run


def cuda_refusal(blocks: BlockList, chosen: list[int]) -> str | None:
    """Why checkpointing `chosen` on CUDA would give wrong gradients, or None. cuDNN's RNNs draw the
    dropout between their layers from a state of their own, which the recompute cannot replay as it
    does torch's RNG (pytorch issue 74177): the recompute's masks differ from the forward's."""
    for index in chosen:
        for name, module in blocks[index].module.named_modules():
            if isinstance(module, nn.RNNBase) and module.dropout > 0 and module.num_layers > 1:
                where = f"{blocks[index].name}.{name}".rstrip(".")
                return (f"memory.checkpointing: block {index} ({where}) is an {type(module).__name__} with dropout "
                        f"{module.dropout} between its layers, which cuDNN draws from a state a recompute cannot "
                        "replay (wrong gradients); set its dropout to 0 (or put nn.Dropout between single-layer "
                        "RNNs), or leave this block out with policy layers")
    return None


def _kv_cache_off(root: nn.Module | None) -> Undo:
    """Turn off transformers' KV cache: a recompute would append each layer's keys to it a second time."""
    configs = {id(c): c for m in (root.modules() if root is not None else ())
               if getattr(c := getattr(m, "config", None), "use_cache", False) is True}
    if configs:
        log.info("memory.checkpointing: turned off the KV cache (config.use_cache); training does not read it "
                 "and a recompute would write it again")
    for config in configs.values():
        config.use_cache = False

    def undo() -> None:
        for config in configs.values():
            config.use_cache = True
    return undo


def _checkpointed(forward: Callable, contexts: _Contexts, name: str) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        compiling = torch.compiler.is_compiling()
        if not compiling and torch.is_grad_enabled():
            versions = input_versions(args, kwargs)
            output = _run_checkpointed(forward, contexts, compiling, args, kwargs)
            refuse_written_inputs(name, versions)
            return output
        return _run_checkpointed(forward, contexts, compiling, args, kwargs)
    return run


def _run_checkpointed(forward: Callable, contexts: _Contexts, compiling: bool, args: tuple, kwargs: dict):
    if contexts.selective is not None and not compiling and torch.is_grad_enabled():
        contexts.selective.prepare(forward, args, kwargs)  # what this input signature may cache
    context_fn = contexts.compiled if compiling else contexts.eager
    if context_fn is not noop_context_fn:  # dynamo traces checkpoint only without a no-op context_fn
        kwargs = {"context_fn": context_fn, **checkpoint_options(), **kwargs}
    if compiling:
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    with set_checkpoint_early_stop(EARLY_STOP):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


EARLY_STOP = False
"""Whether a recompute may stop once it has rebuilt the last tensor the backward needs. It may not: an
op that writes into a tensor it also saves (RReLU's noise, `rrelu_with_noise`) saves it before its
kernel runs, so a recompute stopped there leaves it unwritten (silently wrong gradients, pytorch issue
193671). Running the block to its end costs only the ops after its last saved tensor."""


# --- what a recompute may and may not do --------------------------------------------------


class _Contexts(NamedTuple):
    """checkpoint's `context_fn` eager and under torch.compile, and the selective learner (or None)."""
    eager: Callable
    compiled: Callable
    selective: SelectiveBlock | None = None


def _context_fns(modules: list[nn.Module], policy: Checkpointing | None, name: str = "") -> _Contexts:
    """Eager: the buffers replayed (below) and, when the policy keeps ops, selective caching of what the
    block leaves alone (selective.py). Under compile the partitioner recomputes on a functional graph that
    applies buffer updates once, and context_fn may only give dispatch modes: the static policy alone."""
    slots = _buffer_slots(modules)
    save_ops = None if policy is None else policy.kept_ops()
    if save_ops is None:
        return _Contexts(_eager_contexts(slots, None), noop_context_fn)
    stride = policy.kept_product_stride()
    selective = SelectiveBlock(save_ops, name, lambda: _BufferReplay(slots).untouched(), stride)
    return _Contexts(_eager_contexts(slots, selective),
                     lambda: create_selective_checkpoint_contexts(static_policy(save_ops, stride)), selective)


def _eager_contexts(slots: list[tuple[nn.Module, str]], selective: SelectiveBlock | None) -> Callable:
    """checkpoint's eager context_fn: the block's buffers replayed around its selective cache, if any."""
    def eager():
        replay = _BufferReplay(slots)
        forward_context, recompute_context = selective.context_fn() if selective else (contextlib.nullcontext(),) * 2
        # outside the selective cache: its clones and copies would otherwise count as ops of the block
        return _nested(replay.forward(), forward_context), _nested(replay.recompute(), recompute_context)
    return eager


@contextlib.contextmanager
def _nested(outer, inner):
    with outer, inner:
        yield


def _buffer_slots(modules: list[nn.Module]) -> list[tuple[nn.Module, str]]:
    owners = {id(m): m for module in modules for m in module.modules()}.values()
    return [(owner, name) for owner in owners for name, buffer in owner._buffers.items() if buffer is not None]


class _BufferReplay:
    """A checkpointed forward's buffers as it found them, for its recompute.

    A block may write its buffers in its forward: BatchNorm's running statistics (a kernel that does
    not even bump their version counters), an average it updates and then reads, a buffer it rebinds.
    Its recompute must read what the forward read and leave what the forward wrote, or it computes
    other activations (wrong gradients) and moves the statistics twice. So the recompute runs on the
    values the forward started from, and the forward's values are put back after it. Buffers keep
    their identity (DDP holds them), except one the model itself rebound."""

    def __init__(self, slots: list[tuple[nn.Module, str]]):
        self.slots = slots
        self.before: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []  # owner, name, object, start value

    @contextlib.contextmanager
    def forward(self):
        with torch.no_grad():
            start = [(owner, name, owner._buffers[name], owner._buffers[name]._version) for owner, name in self.slots]
            values = [tensor.clone() for _, _, tensor, _ in start]
        yield
        self.before = [(owner, name, tensor, value) for (owner, name, tensor, version), value in zip(start, values, strict=True)
                       if owner._buffers.get(name) is not tensor or tensor._version != version
                       or isinstance(owner, nn.modules.batchnorm._BatchNorm)]

    @contextlib.contextmanager
    def recompute(self):
        ended = [(owner, name, owner._buffers.get(name)) for owner, name, _, _ in self.before]
        with torch.no_grad():
            kept = [value.clone() if value is tensor else None for (_, _, value), (_, _, tensor, _) in
                    zip(ended, self.before, strict=True)]
        self._set(self.before)
        try:
            yield
        finally:
            self._set([(owner, name, value, value if saved is None else saved)
                       for (owner, name, value), saved in zip(ended, kept, strict=True)])

    @contextlib.contextmanager
    def untouched(self):
        """The buffers as they were before, after a forward run only to look at it."""
        with self.forward():
            yield
        self._set(self.before)

    @staticmethod
    def _set(entries) -> None:
        """Put each slot's object back, holding the given value, in place where it is the same object."""
        with torch.no_grad():
            for owner, name, tensor, value in entries:
                if owner._buffers.get(name) is not tensor:
                    owner._buffers[name] = tensor
                if value is not tensor:
                    tensor.data.copy_(value)  # .data: no version bump under tensors autograd saved
