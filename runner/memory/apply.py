"""`apply_plan`: the one call that puts a recipe's memory plan onto a built model.

It holds the weights in the plan's dtype (memory.weights), finds the output projection a chunked
loss splits (memory.loss), finds the blocks, checks the plan against them (every error names its
recipe key, e.g. `memory.checkpointing.layers: ...`), wraps checkpointing first and offload around
it, and returns an `AppliedPlan` whose `remove()` puts the model back, so the tuner or the estimator
can try another plan on the same model. Micro-batching, precision, compile and the optimizer
(runner/memory/optimizers.py, built after this) are the trainer's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..plan import MemoryPlan, StepFacts, plan_problem
from .blocks import BlockList, Undo, find_blocks
from .adaptive import PlanSwitch, apply_adaptive
from .checkpointing import apply_checkpointing, cuda_refusal
from .chunked_loss import SplitHead
from .compress import ActivationCompression, apply_compression, chaining_missing
from .offload import CPU_REFUSAL, ActivationOffload, apply_offload
from .torch_features import missing_budget, missing_for_sqrt
from .weights import apply_weights

log = logging.getLogger(__name__)

@dataclass
class AppliedPlan:
    plan: MemoryPlan
    blocks: BlockList | None  # None when the plan needs no blocks (nothing to checkpoint or offload)
    checkpointed: list[int] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)
    offload: ActivationOffload | None = None  # its pool and byte counts, when offloading
    compression: ActivationCompression | None = None  # its byte counts, when compressing
    switch: PlanSwitch | None = None  # memory.adaptive: which bucket's checkpointing runs now
    head: SplitHead | None = None  # memory.loss chunked: the output projection the loss splits
    _undo: list[Undo] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Undo the wrapping (offload first, then checkpointing); calling it twice is harmless."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def apply_plan(model: nn.Module, plan: MemoryPlan, device: torch.device | str) -> AppliedPlan:
    """Apply `plan`'s checkpointing and offload to `model`'s blocks (after the model is on `device`)."""
    device = torch.device(device)
    needs_blocks = bool(plan.adaptive) or plan.checkpointing.recomputes or plan.offload.moves or plan.compression.lossy
    check_combination(plan, device)
    head = SplitHead(model, plan.loss) if plan.loss.splits_head else None
    if head is not None:
        log.info(plan.loss.describe())
    undo_weights = apply_weights(model, plan.weights)
    if not needs_blocks and plan.blocks is None:
        return AppliedPlan(plan, None, head=head, _undo=[undo_weights])
    try:
        blocks = find_blocks(model, plan.blocks)
    except BaseException:
        undo_weights()
        raise
    applied = AppliedPlan(plan, blocks, plan.checkpointing.chosen(blocks), plan.offload.chosen(blocks), head=head,
                          _undo=[undo_weights])
    every_checkpointed = sorted({i for part in [plan, *plan.adaptive] for i in part.checkpointing.chosen(blocks)})
    refusal = cuda_refusal(blocks, every_checkpointed) if device.type == "cuda" else None
    if refusal:
        raise ValueError(refusal)
    if needs_blocks:
        log.info("memory plan on %d blocks of %s", len(blocks), blocks.container_name or type(model).__name__)
    if plan.adaptive:
        undo_checkpointing, applied.switch = apply_adaptive(blocks, plan)
    else:
        undo_checkpointing = apply_checkpointing(blocks, plan.checkpointing)
    applied._undo.append(undo_checkpointing)
    # compression inside offload: offload's hooks are entered first and compression's chain to them
    undo_compression, applied.compression = apply_compression(blocks, plan.compression)
    applied._undo.append(undo_compression)
    try:
        undo_offload, applied.offload = apply_offload(blocks, plan.offload, device)
    except BaseException:
        applied.remove()
        raise
    applied._undo.append(undo_offload)
    return applied


def check_combination(plan: MemoryPlan, device: torch.device, facts: StepFacts | None = None) -> None:
    """What a plan cannot do here: its fields' combinations (ckrun.runner.plan.plan_problems; with `facts`, with
    the rest of the recipe too), then what needs CUDA or a torch feature this torch lacks. A ValueError
    whose message starts with the key to change."""
    problem = plan_problem(plan, facts)
    if problem is not None:
        raise ValueError(problem[1])
    if plan.offload.moves and device.type != "cuda":
        raise ValueError(CPU_REFUSAL)
    if plan.activation_memory_budget is not None and missing_budget():
        raise ValueError(missing_budget())
    if plan.checkpointing.spans_blocks and missing_for_sqrt():
        raise ValueError(missing_for_sqrt())
    if plan.compression.lossy:
        why = plan.compression.unsupported()
        if why is None and plan.offload.moves:
            why = chaining_missing()
        if why is not None:
            raise ValueError(why)
    why = plan.optimizer_state.unsupported()
    if why is None and device.type != "cuda":
        why = plan.optimizer_offload.cpu_refusal()
    if why is not None:
        raise ValueError(why)
