"""sqrt checkpointing: runs of consecutive blocks, each checkpointed as one unit.

Why segments and not "every ceil(sqrt(L))-th block": checkpointing single blocks keeps every chosen
block's input plus the full activations of every block left alone, so that gives no sqrt(L) saving.
checkpoint_sequential's saving comes from keeping only each segment's input and recomputing the
whole segment in backward. HF models call their layers in their own loop with kwargs, so we cannot
call a segment ourselves; instead a segment's checkpoint region opens when one of its blocks is
called and closes after its last block returns, while we record each block's call. The recompute
replays the recorded calls, feeding each block the replayed outputs of the blocks before it
(matched by tensor identity), so the intermediate boundaries are not kept.

Why this is exact whatever the model does between two blocks (issue 32: noise between blocks,
Swin's PatchMerging, Pegasus's LayerDrop gave wrong gradients or crashes): a region never spans
code the recording did not see, and a replayed call starts where its forward started.
- Between two blocks the region is suspended: saved-tensor hooks of our own sit above the
  checkpoint's, so what the model's own code saves for backward is saved as without a plan and is
  never asked of the replay (which does not run that code).
- Each recorded call keeps the RNG state it started from, and the replay sets it before the call:
  random numbers drawn between blocks (noise, LayerDrop's coin) do not shift a later block's masks.
- A call's input that an earlier block of the region returned is replayed only if nothing changed
  it in place since (version counters); else it is kept as it was given, and a kept input changed
  in place before backward is an error in backward, as torch's own checkpoint says of its inputs.
- A block skipped (LayerDrop), called again or out of order ends the open region and starts another
  at that block: each region holds exactly the calls it replays, so nothing is required of the
  model's loop. The region left open when the model's forward ends is closed there.
As in checkpoint_sequential the last segment is not checkpointed: backward needs it first.
Segments never cross containers (T5's encoder and decoder stacks).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import get_device_states, set_device_states

from ..builders.resolve import BuildError
from .blocks import BlockList, Undo, undo_all, wrap_forward
from .torch_features import checkpoint_options, segment_generator

log = logging.getLogger(__name__)


def input_versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """The tensors a block is given, with their version counters before it runs."""
    return [(x, x._version) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]


def refuse_written_inputs(name: str, versions: list[tuple[torch.Tensor, int]]) -> None:
    """A one-line refusal when a checkpointed block wrote a tensor it was given in place (`nn.ReLU(inplace=True)`
    or `x.add_()` on its input): checkpoint keeps the inputs to recompute from, and a written one is no longer
    what the forward started from, which torch finds only in the backward (an internal error at the first
    step, whatever the policy). Found at the block's first forward, before any backward or update."""
    if any(tensor._version != version for tensor, version in versions):
        raise BuildError("memory.checkpointing", f"{name} writes a tensor it is given in place (an in-place op such "
                         "as nn.ReLU(inplace=True) or x.add_() on its input), so a recompute cannot start from what "
                         "its forward started from; make that op out of place (inplace=False) or leave this block "
                         "out of the plan (policy layers)")


def apply_segments(blocks: BlockList, checkpointed: list[list[int]], context_for: Callable, early_stop: bool) -> Undo:
    """Each region, a run of blocks, checkpointed as one unit; `context_for(modules)` gives the
    checkpoint's context_fn over those modules (their buffers replayed)."""
    segment_runner = _SegmentRunner(early_stop)
    undos = []
    for segment in checkpointed:
        context_fn = context_for([blocks[i].module for i in segment])
        for position, index in enumerate(segment):
            undos.append(wrap_forward(blocks[index].module, segment_runner.wrapper, segment, position, context_fn, blocks[index].name))
    if blocks.root is not None and checkpointed:
        handle = blocks.root.register_forward_hook(segment_runner.after_model, always_call=True)
        undos.append(handle.remove)
    undos.append(segment_runner.abandon)
    return undo_all(undos)


class _Ref:
    """Stands in a recorded call for a tensor that an earlier block of the region returned."""

    def __init__(self, call: int, leaf: int):
        self.call, self.leaf = call, leaf


class _Kept:
    """An input kept as given (no earlier call of the region returned it), with its version then."""

    def __init__(self, tensor: torch.Tensor, name: str):
        self.tensor, self.version, self.name = tensor, tensor._version, name

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(f"memory.checkpointing: sqrt: an input of {self.name} was changed in place after the "
                               "block ran, so its recompute cannot see what the forward saw; use policy full or every "
                               "for this model")
        return self.tensor


class _Rng:
    """The RNG state a call started from: the CPU generator's and those of its tensors' devices."""

    def __init__(self, args: tuple, kwargs: dict):
        self.cpu = torch.get_rng_state()
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        self.device_type = next((x.device.type for x in tensors if x.device.type not in ("cpu", "meta")), None)
        self.devices, self.states = get_device_states(*tensors) if self.device_type else ([], [])

    def set(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_type:
            set_device_states(self.devices, self.states, device_type=self.device_type)


class _Recording:
    """The calls of one region; the recompute replays them. Holds no intermediate boundary."""

    def __init__(self, first: Callable, position: int):
        self.calls: list[tuple[Callable, tuple, dict, _Rng]] = []
        self.first = first
        self.last = position  # the segment position of the latest call recorded
        self.produced: dict[int, tuple[weakref.ref, int, int, int]] = {}  # id -> (ref, call, leaf, version)

    def record(self, forward: Callable, args: tuple, kwargs: dict, name: str) -> bool:
        """Record a call; False when it takes nothing an earlier block of the region returned as it was."""
        found = []

        def template(x):
            if not isinstance(x, torch.Tensor):
                return x
            hit = self.produced.get(id(x))
            if hit is None or hit[0]() is not x or hit[3] != x._version:
                return _Kept(x, name)
            found.append(hit)
            return _Ref(hit[1], hit[2])
        rng = _Rng(args, kwargs)
        args, kwargs = tree_map(template, (args, kwargs))
        self.calls.append((forward, args, kwargs, rng))
        return bool(found)

    def kept_versions(self) -> list[tuple[torch.Tensor, int]]:
        """The inputs the latest call keeps as given, with their versions then: a write to one of those is
        what the replay cannot undo (an input an earlier block returned is replayed, written again as in the
        forward; the region's first call's inputs are the checkpoint's own)."""
        _, args, kwargs, _ = self.calls[-1]
        return [(kept.tensor, kept.version) for kept in tree_leaves((args, kwargs)) if isinstance(kept, _Kept)]

    def returned(self, output) -> None:
        call = len(self.calls)
        for leaf, x in enumerate(tree_leaves(output)):
            if isinstance(x, torch.Tensor):
                self.produced[id(x)] = (weakref.ref(x), call, leaf, x._version)

    def replay(self, *args, **kwargs) -> None:
        outputs = [tree_leaves(self.first(*args, **kwargs))]

        def value(x):
            return outputs[x.call][x.leaf] if isinstance(x, _Ref) else x.get() if isinstance(x, _Kept) else x
        for forward, call_args, call_kwargs, rng in self.calls:
            call_args, call_kwargs = tree_map(value, (call_args, call_kwargs),
                                              is_leaf=lambda x: isinstance(x, _Ref | _Kept))
            rng.set()  # inside checkpoint's fork_rng: the caller's RNG is put back after the recompute
            outputs.append(tree_leaves(forward(*call_args, **call_kwargs)))


def _detach(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()  # not the tensor itself: a saved output holding its own grad_fn is a cycle


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Open:
    """The region open now: its segment, torch's checkpoint generator, its recording, and the
    hooks that suspend it while the model's own code runs between two of its blocks."""

    def __init__(self, segment: list[int], region, recording: _Recording):
        self.segment, self.region, self.recording = segment, region, recording
        self.suspended: torch.autograd.graph.saved_tensors_hooks | None = None

    def suspend(self) -> None:
        self.suspended = torch.autograd.graph.saved_tensors_hooks(_detach, _same)
        self.suspended.__enter__()

    def resume(self) -> None:
        if self.suspended is not None:
            self.suspended.__exit__(None, None, None)
            self.suspended = None


class _SegmentRunner:
    """Opens a checkpoint region at a segment's block and closes it after its last."""

    def __init__(self, early_stop: bool):
        self.early_stop = early_stop
        self.open: _Open | None = None
        self.warned: set[str] = set()

    def wrapper(self, forward: Callable, segment: list[int], position: int, context_fn: Callable, name: str):
        @functools.wraps(forward)
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            versions = input_versions(args, kwargs)
            recording = self._enter(segment, position, forward, args, kwargs, context_fn, name)
            try:
                output = forward(*args, **kwargs)
                refuse_written_inputs(name, recording.kept_versions() if recording.calls else versions)
            except BaseException as error:
                self.abandon(error)
                raise
            recording.returned(output)
            if position == len(segment) - 1:
                self.close()
            else:
                self.open.suspend()  # until its next block: the model's own code runs as without a plan
            return output
        return run

    def _enter(self, segment, position, forward, args, kwargs, context_fn, name) -> _Recording:
        current = self.open
        if current is not None and current.segment is segment and position > current.recording.last:
            current.resume()
            if not current.recording.record(forward, args, kwargs, name) and name not in self.warned:
                self.warned.add(name)
                log.warning("memory.checkpointing: sqrt: %s does not take the previous block's output as that block "
                            "returned it, so its input is kept in memory too", name)
            current.recording.last = position
            return current.recording
        self.close()  # a skipped block, a block called again or another segment's: a new region starts here
        recording = _Recording(forward, position)
        region = segment_generator()(recording.replay, True, context_fn, "default", False, self.early_stop, *args,
                                     **checkpoint_options(), **kwargs)
        next(region)
        self.open = _Open(segment, region, recording)
        return recording

    def close(self) -> None:
        """End the open region as its forward completed (what it recorded is what it replays)."""
        if self.open is None:
            return
        current, self.open = self.open, None
        current.resume()
        next(current.region, None)  # runs the checkpoint's post-forward logic and ends the region

    def abandon(self, error: BaseException | None = None) -> None:
        if self.open is None:
            return
        current, self.open = self.open, None
        current.resume()
        if error is None:
            current.region.close()
            return
        with contextlib.suppress(BaseException):
            current.region.throw(error)

    def after_model(self, module, args, output) -> None:
        # the segment's later blocks were skipped, or the model called its last block no more; a forward
        # that raised (torch calls this hook with no output then) will have no backward
        self.close() if output is not None else self.abandon()
