"""Adaptive plans: the checkpointing chosen per batch length (memory.adaptive), switched between
steps without rebuilding the model.

Text without packing (data.split: lines) pads each batch to its longest line, so one batch may be
a tenth as long as the next. Activation memory grows with the length, so a short batch can afford
to keep what a long one must recompute. Every block any bucket checkpoints is wrapped once
(`apply_switched`); before a step the trainer calls `PlanSwitch.select(batch)`, and the wrappers
read which bucket is active at forward time. Checkpointing is exact, so a switched run computes
the same losses and gradients as a run under any fixed plan.
"""

from __future__ import annotations

import logging
from collections import Counter

from ..builders.data import Batch
from ..plan.memory_plan import MemoryPlan
from .blocks import BlockList, Undo, short_list
from .checkpointing import apply_switched

log = logging.getLogger(__name__)


def batch_length(batch: Batch) -> int | None:
    """The sequence length of a token batch ([batch, seq] inputs); None for images."""
    lengths = [t.shape[1] for t in batch.inputs.values() if t.dim() == 2 and not t.is_floating_point()]
    return max(lengths) if lengths else None


class PlanSwitch:
    """Which bucket's checkpointing runs now; the last entry is memory.checkpointing (longer batches)."""

    def __init__(self, plan: MemoryPlan, blocks: BlockList):
        self.max_lens = [bucket.max_len for bucket in plan.adaptive]
        self.policies = [bucket.checkpointing for bucket in plan.adaptive] + [plan.checkpointing]
        self.checkpointed = [policy.chosen(blocks) for policy in self.policies]
        self.active = len(self.policies) - 1  # the longest batches' plan until a batch says otherwise
        self.steps = Counter()  # bucket -> steps run under it, for logs and tests

    def bucket_for(self, length: int | None) -> int:
        if length is None:
            return len(self.policies) - 1
        return next((i for i, most in enumerate(self.max_lens) if length <= most), len(self.policies) - 1)

    def select(self, batch: Batch) -> int:
        """Make the plan for `batch`'s length the active one (between steps, never inside one)."""
        length = batch_length(batch)
        bucket = self.bucket_for(length)
        if bucket not in self.steps:
            log.info("memory.adaptive: batch length %s -> %s: checkpointing %s (blocks %s)", length,
                     self.describe(bucket), self.policies[bucket].label(),
                     short_list(self.checkpointed[bucket]) or "none")
        self.active = bucket
        self.steps[bucket] += 1
        return bucket

    def describe(self, bucket: int) -> str:
        if bucket < len(self.max_lens):
            return f"bucket max_len {self.max_lens[bucket]}"
        return f"memory.checkpointing (over {self.max_lens[-1]})" if self.max_lens else "memory.checkpointing"


def apply_adaptive(blocks: BlockList, plan: MemoryPlan) -> tuple[Undo, PlanSwitch]:
    switch = PlanSwitch(plan, blocks)
    log.info("memory.adaptive: %d length buckets (max_len %s), then memory.checkpointing; the plan switches per "
             "batch without rebuilding the model", len(switch.max_lens), switch.max_lens)
    return apply_switched(blocks, switch.policies, lambda: switch.active), switch
