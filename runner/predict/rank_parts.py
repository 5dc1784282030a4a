"""One rank's step composed from parts: `tune --predict --nproc N` at the cost of a few traced blocks.

A rank's step (runner/predict/per_rank.py) is the training step on its share of the batch, with the model
split over a fake process group. Run whole, it costs the depth of the model for every plan (0.14 CPU s a
block of a 70B shape's 80). Composed as one process's step is (runner/predict/compose.py): one fake step in
which only a few blocks are real and the others relays, cut into parts, a traced block standing for every
block of its kind (2-4 CPU s a plan of the 80-block shape); a generated test holds the composed peak equal
to the whole-rank step to the byte, and its time to rounding (tests/runner/predict/test_rank_parts.py).

What a rank adds to one process's composition:
- FSDP2's work reaches past a block: in the backward a block gathers the previous block's parameters
  (implicit backward prefetch) and lets go of the next block's reduce-scatter input; the root gathers the
  last block's. So each representative is traced with `NEIGHBOURS` real blocks on either side: one for the
  reach, and one more so that its neighbours' own neighbours are alike (the first and the last block
  prefetch and are prefetched unlike the others, which a block's signature then sees).
- The embedding's and head's parts are traced per plan (`Composer(neighbours=...)`): the root's prefetch of
  the last block is let go inside that block's backward, which differs between a kept and a recomputed block.
- The relays run without FSDP2's forward hooks (`hooks_set_aside`): gathering a relay's weights was half
  of what a plan cost, and a relay holds nothing; a relay learns its block's output layout gathered.
- The collectives each part ran are placed again in the composed step (runner/predict/placement.py).
- The optimizer state is made by one update alone on the split model (`PartsEstimator`), not by a whole step.
- ddp: the whole model on every rank, so one process's composition with the world size (the gradient
  buckets are added after, as for the whole-rank step).

Where a plan does not compose (the composer says why: a model that runs code between its blocks, adaptive
plans, ...), the whole-rank step is the answer and the estimate's notes say so.
"""

from __future__ import annotations

import contextlib

import torch

from .compose import Composer
from .parts import PartsEstimator

NEIGHBOURS = 2  # blocks traced real on either side of a sharded representative (module docstring)


class RankComposer(Composer):
    """The composer of one rank's step: one process's rules, the world size and the split model allowed."""

    ranks = True

    def __init__(self, estimator: PartsEstimator, sharded: bool):
        super().__init__(estimator, NEIGHBOURS if sharded else 0)

    def _trace(self, layout, traced, real: set[int], chosen: set[int]) -> None:
        relays = [block.module for block in self.blocks(traced) if block.index not in real]
        with hooks_set_aside(relays):
            super()._trace(layout, traced, real, chosen)


@contextlib.contextmanager
def hooks_set_aside(relays: list[torch.nn.Module]):
    """The relays' FSDP2 forward hooks set aside while a step is traced: a relay holds nothing, and gathering
    its parameters (and in its backward, again) is most of what a relay costs on a split model (a 70B shape's
    78 relays: 8 of a plan's 17 profiled seconds). Its real neighbours, which the composition reads, see
    the prefetch and reduce-scatter of the blocks beside them as in the whole step (module docstring); the
    relays' groups stay sharded, which FSDP2's end of backward takes as unused. Where this torch's FSDP2
    keeps its hooks elsewhere, they stay (the trace is exact either way, only slower)."""
    saved = []
    for module in relays:
        handles = _forward_hooks(module)
        for hooks in (module._forward_pre_hooks, module._forward_hooks) if handles else ():
            saved.append((hooks, dict(hooks)))
            for handle in handles:
                hooks.pop(handle.id, None)
    try:
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)


def _forward_hooks(module: torch.nn.Module) -> list | None:
    """FSDP2's forward hook handles on a block it split (torch's private state: feature-detected), or None."""
    state = getattr(module, "_get_fsdp_state", None)
    try:
        state = state() if state is not None else None
    except AssertionError:
        return None
    handles = [getattr(state, name, None) for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle")]
    if state is None or len(getattr(state, "_modules", ())) != 1 or not all(hasattr(h, "id") for h in handles):
        return None  # a group of several modules shares one handle; leave it
    return handles
