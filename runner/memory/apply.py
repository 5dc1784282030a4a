"""`apply_plan`: the one call that puts a recipe's memory plan onto a built model.

It applies each pool's policy by its entry in `POOL_APPLIERS` (the weights held in the plan's dtype,
the output projection a chunked loss splits found; the optimizer's pools are the optimizer's build),
finds the blocks, checks the plan against them (every error names its recipe key, e.g.
`memory.checkpointing.layers: ...`), wraps checkpointing first and offload around it, and returns an
`AppliedPlan` whose `remove()` puts the model back, so the tuner or the estimator can try another plan
on the same model. Every part's undo goes onto one ExitStack: a part that fails undoes the ones before. Micro-batching, precision, compile and the optimizer
(runner/memory/optimizers.py, built after this) are the trainer's part.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from ..plan.memory_plan import MemoryPlan, StepFacts, plan_problem
from ..plan.policy_base import PoolPolicy
from ..plan.pool_policies import LossPolicy, WeightsPolicy
from .blocks import BlockList, find_blocks
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
    blocks: BlockList | None = None  # None when the plan needs no blocks (nothing to checkpoint or offload)
    checkpointed: list[int] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)
    offload: ActivationOffload | None = None  # its pool and byte counts, when offloading
    compression: ActivationCompression | None = None  # its byte counts, when compressing
    switch: PlanSwitch | None = None  # memory.adaptive: which bucket's checkpointing runs now
    pools: dict[str, object] = field(default_factory=dict)  # each pool's section -> what its applier gave back
    _undo: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    @property
    def head(self) -> SplitHead | None:
        """memory.loss chunked: the output projection the loss splits."""
        return self.pools.get("loss")

    def remove(self) -> None:
        """Undo everything, last applied first (offload, compression, checkpointing, then the pools);
        calling it twice is harmless."""
        self._undo.close()

    def __enter__(self) -> AppliedPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


PoolApplier = Callable[[nn.Module, PoolPolicy], AbstractContextManager]
"""A pool's part of `apply_plan`: entered with the model and the pool's policy, it gives what the step
needs of it (or None) and undoes itself on exit."""


@contextlib.contextmanager
def _held_weights(model: nn.Module, policy: WeightsPolicy) -> Iterator[None]:
    undo = apply_weights(model, policy)
    try:
        yield None
    finally:
        undo()


def _split_head(model: nn.Module, policy: LossPolicy) -> AbstractContextManager:
    if not policy.splits_head:
        return contextlib.nullcontext()
    head = SplitHead(model, policy)  # a model whose head cannot be split is refused here, in one line
    log.info(policy.describe())
    return contextlib.nullcontext(head)


def _with_the_optimizer(model: nn.Module, policy: PoolPolicy) -> AbstractContextManager:
    """Nothing on the model: runner/memory/optimizers.py builds the optimizer the policy asks for."""
    return contextlib.nullcontext()


POOL_APPLIERS: dict[str, PoolApplier] = {
    "weights": _held_weights, "optimizer_state": _with_the_optimizer, "optimizer_step": _with_the_optimizer,
    "optimizer_offload": _with_the_optimizer, "loss": _split_head}
"""Each pool of POOL_KINDS (runner/plan/pool_policies.py) -> its applier; a test holds the keys to the table.
A new pool's applying module gives its entry here (or `_with_the_optimizer` where the optimizer's
build applies it)."""


def apply_plan(model: nn.Module, plan: MemoryPlan, device: torch.device | str) -> AppliedPlan:
    """Apply `plan` to `model` (after the model is on `device`): each pool's applier in the table's order,
    then checkpointing, compression and offload on the blocks. What fails part way is undone."""
    device = torch.device(device)
    check_combination(plan, device)
    with contextlib.ExitStack() as undo:  # left by an error: everything applied so far is undone
        applied = AppliedPlan(plan)
        for policy in plan.pool_policies():
            applied.pools[policy.section] = undo.enter_context(POOL_APPLIERS[policy.section](model, policy))
        needs_blocks = bool(plan.adaptive) or plan.checkpointing.recomputes or plan.offload.moves or plan.compression.lossy
        if needs_blocks or plan.blocks is not None:
            _apply_to_blocks(model, plan, device, applied, undo, needs_blocks)
        applied._undo = undo.pop_all()
    return applied


def _apply_to_blocks(model: nn.Module, plan: MemoryPlan, device: torch.device, applied: AppliedPlan,
                     undo: contextlib.ExitStack, needs_blocks: bool) -> None:
    """Find the blocks, then wrap checkpointing first, compression inside offload, offload around them."""
    blocks = applied.blocks = find_blocks(model, plan.blocks)
    applied.checkpointed, applied.offloaded = plan.checkpointing.chosen(blocks), plan.offload.chosen(blocks)
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
    undo.callback(undo_checkpointing)
    # compression inside offload: offload's hooks are entered first and compression's chain to them
    undo_compression, applied.compression = apply_compression(blocks, plan.compression)
    undo.callback(undo_compression)
    undo_offload, applied.offload = apply_offload(blocks, plan.offload, device)
    undo.callback(undo_offload)


def check_combination(plan: MemoryPlan, device: torch.device, facts: StepFacts | None = None) -> None:
    """What a plan cannot do here: its fields' combinations (ckrun.runner.plan.memory_plan.plan_problems; with `facts`, with
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
