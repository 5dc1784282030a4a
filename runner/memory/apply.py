"""`apply_plan`: the one call that puts a recipe's memory plan onto a built model.

It finds the blocks, checks the plan against them (every error names its recipe key, e.g.
`memory.checkpointing.layers: ...`), wraps checkpointing first and offload around it, and returns
an `AppliedPlan` whose `remove()` puts the model back, so the tuner or the estimator can try
another plan on the same model. Micro-batching, precision and compile are the trainer's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..plan import MemoryPlan, plan_problem
from .blocks import BlockList, Undo, find_blocks
from .adaptive import PlanSwitch, apply_adaptive
from .checkpointing import apply_checkpointing, chosen_blocks, cuda_refusal
from .compress import ActivationCompression, apply_compression, chaining_missing, missing_for
from .offload import CPU_REFUSAL, ActivationOffload, apply_offload, offloaded_blocks
from .torch_features import missing_budget, missing_for_sqrt

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
    needs_blocks = bool(plan.adaptive) or any(part.policy != "none" for part in
                                               (plan.checkpointing, plan.offload, plan.compression))
    check_combination(plan, device)
    if not needs_blocks and plan.blocks is None:
        return AppliedPlan(plan, None)
    blocks = find_blocks(model, plan.blocks)
    applied = AppliedPlan(plan, blocks, chosen_blocks(plan.checkpointing, blocks), offloaded_blocks(plan.offload, blocks))
    every_checkpointed = sorted({i for part in [plan, *plan.adaptive] for i in chosen_blocks(part.checkpointing, blocks)})
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


def check_combination(plan: MemoryPlan, device: torch.device) -> None:
    """Plan problems that need no model: a ValueError whose message starts with the key to change."""
    problem = plan_problem(plan)
    if problem is not None:
        raise ValueError(problem[1])
    if plan.offload.policy != "none" and device.type != "cuda":
        raise ValueError(CPU_REFUSAL)
    if plan.activation_memory_budget is not None and missing_budget():
        raise ValueError(missing_budget())
    _check_compression(plan)
    if plan.adaptive and plan.checkpointing.policy == "sqrt":
        raise ValueError("memory.adaptive: cannot be combined with memory.checkpointing.policy: sqrt (its segments "
                         "span blocks, which cannot switch per batch); use policy every or layers")
    if plan.checkpointing.policy == "sqrt" and missing_for_sqrt():
        raise ValueError(missing_for_sqrt())
    if plan.compile and plan.checkpointing.policy == "sqrt":
        # a segment's checkpoint region opens in one block's forward and closes in another's,
        # which torch.compile cannot trace
        raise ValueError("memory.checkpointing: policy sqrt cannot be combined with memory.compile: true; "
                         "use policy full, every, layers or selective")
    if plan.offload.policy != "none" and plan.compile:
        # dynamo would trace the offload hooks' Python (streams, events, a buffer pool) and fail its
        # guards on them; compiled code also frees and reuses activations in its own way
        raise ValueError("memory.offload: cannot be combined with memory.compile: true; "
                         "set memory.offload.policy: none or memory.compile: false")
    if plan.offload.policy != "none" and plan.checkpointing.policy == "sqrt":
        # a sqrt segment's checkpoint region spans several blocks, but offload hooks open and close
        # around each block: the two would interleave on autograd's saved-tensor hook stack
        raise ValueError("memory.offload: cannot be combined with memory.checkpointing.policy: sqrt; "
                         "use policy full, every or layers with offload")


def _check_compression(plan: MemoryPlan) -> None:
    if plan.compression.policy == "none":
        return
    why = missing_for(plan.compression.policy)
    if why is None and plan.offload.policy != "none":
        why = chaining_missing()
    if why is None and plan.compile:
        # as with offload: dynamo would trace the hooks' Python; compiled code keeps its own activations
        why = ("memory.compression: cannot be combined with memory.compile: true; set memory.compression.policy: "
               "none or memory.compile: false")
    if why is None and plan.checkpointing.policy == "sqrt":
        # a sqrt segment's checkpoint hooks span several blocks; per-block hooks would interleave with them
        why = ("memory.compression: cannot be combined with memory.checkpointing.policy: sqrt; use policy full, "
               "every, layers or selective")
    if why is not None:
        raise ValueError(why)
