"""The memory plan: the recipe's `memory` section, which the tuner searches over.

Every closed choice is a discriminated union on `policy` whose members are the policy types of
runner/plan/policies.py, so a plan is plain data that can be written into a recipe, compared, hashed
and proposed by the tuner. The pools' fields are made from runner/plan/pool_policies.py's POOL_KINDS, one
per entry, so that a new kind of pool is one entry there. `plan_problems` is the one place that says which combinations a plan
cannot have, in terms of what the policies are (`spans_blocks`, `moves`, `lossy`), not their names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal, Union, get_args

from pydantic import ByteSize, Field, create_model, field_validator

from .choices import Strict
from .policies import (  # noqa: F401 - the plan's vocabulary, importable from here as before
    AllBlocksOffload,
    CastCompression,
    Checkpointing,
    Compression,
    EveryKthCheckpointing,
    FullCheckpointing,
    LayerListCheckpointing,
    LayerListOffload,
    NoCheckpointing,
    NoCompression,
    NoOffload,
    Offload,
    SelectiveCheckpointing,
    SqrtCheckpointing,
)
from .policy_base import Policy, PoolPolicy
from .pool_policies import (  # noqa: F401 - the pools' policies, importable from here too
    BF16Weights,
    ChunkedLoss,
    FullState,
    HostMasterOffload,
    HostOptimizerOffload,
    LowBitState,
    Loss,
    MasterWeights,
    NoOptimizerOffload,
    OptimizerOffload,
    OptimizerState,
    OptimizerStep,
    POOL_KINDS,
    StepAfterBackward,
    StepInBackward,
    Weights,
    WholeLogits,
)


# --- FSDP sharding (distributed.strategy: fsdp) ---------------------------------------------


class Sharding(Strict):
    """How FSDP2 holds a rank's shard of parameters, gradients and optimizer state; a plan knob,
    because it trades communication (time) for memory as checkpointing trades recompute."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again in backward:
    one block's full parameters live at a time. false keeps them from forward to backward (less
    communication, the memory of every block's full parameters)."""
    offload: Literal["none", "cpu"] = "none"
    """`cpu`: keep parameters, gradients and optimizer state in host memory and run the optimizer
    step there (FSDP2's CPUOffloadPolicy); the device holds only the blocks in flight. CUDA only."""


class LengthBucket(Strict):
    """One bucket of an adaptive plan: the checkpointing for batches up to `max_len` tokens long."""

    max_len: int = Field(gt=0)
    """Batches whose sequence length is at most this, and over the previous bucket's, use this bucket."""
    checkpointing: Checkpointing
    """The checkpointing for these batches (policy sqrt is not switchable: use every or layers)."""


class ActivationPlan(Strict):
    """The plan's fields before the pools': how the activations are kept, recomputed, moved or compressed,
    and how the step runs (micro-batches, compile, the allocator). `MemoryPlan` adds the pools'."""

    micro_batch: int | None = Field(default=None, gt=0)
    """Samples per forward pass; must divide train.batch_size. Gradient accumulation makes up the
    rest, so the global batch stays the same. Exact only without BatchNorm (it normalises over each
    micro-batch) and dropout (masks are drawn per micro-batch). Unset: the whole batch in one pass."""
    checkpointing: Checkpointing = Field(default_factory=NoCheckpointing)
    """Which blocks recompute their activations in backward instead of keeping them."""
    offload: Offload = Field(default_factory=NoOffload)
    """Which blocks move their saved activations to host memory (CUDA only)."""
    blocks: str | None = None
    """Dotted path of the repeated-block container (e.g. `bert.encoder.layer`) when discovery guesses wrong."""
    sharding: Sharding | None = None
    """FSDP knobs (only with distributed.strategy: fsdp); unset: reshard after forward, no CPU offload."""
    compile: bool = False
    """Run the model through torch.compile (slow first step, faster after)."""
    activation_memory_budget: float | None = Field(default=None, ge=0, le=1)
    """With compile: the fraction of its default activation memory torch's partitioner may keep,
    recomputing the rest (0: recompute all it can, 1: torch's default). The peak is not monotonic
    in it (pytorch issue 197838): measure each value. Unset: torch's own setting."""
    allocator: str | None = None
    """PYTORCH_CUDA_ALLOC_CONF for the run, e.g. `expandable_segments:True` (less fragmentation),
    set before CUDA starts; no effect on the CPU. Unset: whatever the environment says."""
    adaptive: list[LengthBucket] = Field(default_factory=list)
    """Checkpointing per batch length, for text whose batches vary in length (data.split: lines):
    a batch uses the first bucket whose max_len it does not exceed, a longer one memory.checkpointing.
    Short batches can then recompute less. The trainer switches between steps without rebuilding
    the model; results are the same as under any fixed plan. Empty: one plan for every batch."""
    compression: Compression = Field(default_factory=NoCompression)
    """Store the blocks' saved activations in a lower precision until backward needs them (lossy)."""

    @field_validator("adaptive")
    @classmethod
    def _buckets_in_order(cls, buckets: list[LengthBucket]) -> list[LengthBucket]:
        lengths = [bucket.max_len for bucket in buckets]
        if lengths != sorted(set(lengths)):
            raise ValueError(f"buckets must go from short to long, each max_len once, but got max_len {lengths}")
        fixed = next((bucket.checkpointing for bucket in buckets if not bucket.checkpointing.switchable), None)
        if fixed is not None:
            raise ValueError(f"a bucket cannot use policy {fixed.label()} (its segments span blocks, which cannot "
                             "switch per batch); use policy every or layers")
        return buckets

    @field_validator("allocator")
    @classmethod
    def _allocator_settings(cls, allocator: str | None) -> str | None:
        if allocator is not None and not _ALLOCATOR_SETTINGS.fullmatch(allocator):
            raise ValueError(f"{allocator!r} is not allocator settings; write option:value pairs joined by commas, "
                             "e.g. expandable_segments:True or max_split_size_mb:128,expandable_segments:False")
        return allocator


def _pool_field(kind: tuple[type[PoolPolicy], ...]):
    """A pool's plan field, from its entry in POOL_KINDS: its union, its first class as the default, its
    kind's docstring as the key's documentation (what `ckrun schema` and the docs show)."""
    union = Annotated[Union[kind], Field(discriminator=Policy.discriminator)]  # noqa: UP007 - a union of a tuple
    return union, Field(default_factory=kind[0], description=kind[0].key_doc())


PoolPlan = create_model("PoolPlan", __base__=ActivationPlan, __module__=__name__,
                        **{section: _pool_field(kind) for section, kind in POOL_KINDS.items()})
PoolPlan.__doc__ = "ActivationPlan with one field per pool of POOL_KINDS (runner/plan/pool_policies.py), in its order."


class MemoryPlan(PoolPlan):
    """How a step trades time for memory. Checkpointing, offload and compile never change what is
    computed; micro_batch does where the model looks across samples (BatchNorm, dropout masks)."""

    # ActivationPlan's fields, then one per pool of POOL_KINDS (PoolPlan), then these
    allow_lossy: bool = False
    """Permit knobs that change the training beyond float rounding (memory.compression, weights bf16,
    optimizer_state 8bit/4bit/fp8); `ckrun tune --allow-lossy` sets it in the plans it tries, and
    tuned.yaml keeps it so the choice stays visible."""
    max_mem: ByteSize | None = None
    """Hard cap on the step's peak memory (`40GB`, `40GiB`, bytes): exceeding it stops the run."""

    def pool_policies(self) -> list[PoolPolicy]:
        """The policies of the pools beside the activations, one per entry of POOL_KINDS, in its order."""
        return [getattr(self, section) for section in POOL_KINDS]

    def pool_changes(self) -> list[str]:
        """`KEY LABEL` of each pool policy other than its default (`loss chunked:8`), for a log line."""
        return [f"{policy.section} {policy.label()}" for policy in self.pool_policies()
                if policy != type(self).model_fields[policy.section].default_factory()]

    @field_validator("max_mem")
    @classmethod
    def _positive_cap(cls, max_mem: ByteSize | None) -> ByteSize | None:
        if max_mem is not None and max_mem <= 0:  # as `ckrun tune --max-mem 0` is refused
            raise ValueError(f"the cap must be positive but got {max_mem}; leave max_mem out for no cap")
        return max_mem


_SETTING = r"[A-Za-z_]+:(\[[^\]\s]*\]|[^,:\s\[\]]+)"  # roundup_power2_divisions takes a [list]
_ALLOCATOR_SETTINGS = re.compile(rf"{_SETTING}(,{_SETTING})*")


POLICY_FIELDS: dict[str, tuple[type[Policy], ...]] = {
    name: get_args(field.annotation) for name, field in MemoryPlan.model_fields.items()
    if field.discriminator == Policy.discriminator}
"""The plan's fields that hold a policy (checkpointing, offload, compression and the pools' weights,
optimizer state, optimizer step, optimizer offload and loss), each with its classes in union order:
what the per-block solver reads the policies' `block_action`s from (the pools' have none)."""


@dataclass(frozen=True)
class StepFacts:
    """What of the recipe outside its memory section the plan's rules read (the recipe makes it:
    runner/recipe/recipe.py `step_facts`; the tuner has its recipe too)."""

    batch_size: int
    grad_clip: bool
    """train.grad_clip is set: global clipping needs every gradient before any update."""
    precision: str
    adamw: bool
    """train.optimizer is ckrun's adamw: torchao's low-bit and stochastic-rounding AdamW stand in for it."""
    distributed: bool
    """Several processes train (distributed.strategy is not none)."""


def plan_problems(plan: MemoryPlan, facts: StepFacts | None = None) -> list[tuple[tuple[str, ...], str]]:
    """(key path under memory, message) for every combination the plan cannot have, whatever the
    device: the one place these rules live (the recipe, the tuner and apply_plan all ask it). With
    `facts`, also what the plan cannot do with the rest of the recipe (micro-batches, clipping, fp16)."""
    problems = _pool_problems(plan) + (_step_problems(plan, facts) if facts is not None else [])
    if plan.activation_memory_budget is not None and not plan.compile:
        problems.append((("activation_memory_budget",), "memory.activation_memory_budget: is torch.compile's "
                         "partitioner setting, and needs memory.compile: true; set it or leave the budget out"))
    if plan.compression.lossy and not plan.allow_lossy:
        problems.append((("compression",), f"memory.compression: {plan.compression.label()} stores saved activations "
                         "rounded, which changes the gradients; set memory.allow_lossy: true to accept that (or "
                         "`ckrun tune --allow-lossy`), or memory.compression.policy: none"))
    spans, name = plan.checkpointing.spans_blocks, plan.checkpointing.label()
    if plan.adaptive and spans:
        problems.append((("adaptive",), f"memory.adaptive: cannot be combined with memory.checkpointing.policy: "
                         f"{name} (its segments span blocks, which cannot switch per batch); use policy every or layers"))
    if plan.compile and spans:  # a region opened in one block's forward and closed in another's: dynamo cannot trace it
        problems.append((("checkpointing",), f"memory.checkpointing: policy {name} cannot be combined with "
                         "memory.compile: true; use policy full, every, layers or selective"))
    if plan.offload.moves and plan.compile:  # dynamo would trace the offload hooks' streams, events and pool
        problems.append((("offload",), "memory.offload: cannot be combined with memory.compile: true; "
                         "set memory.offload.policy: none or memory.compile: false"))
    if plan.offload.moves and spans:  # per-block offload hooks would interleave with a region spanning blocks
        problems.append((("offload",), f"memory.offload: cannot be combined with memory.checkpointing.policy: {name}; "
                         "use policy full, every or layers with offload"))
    if plan.compression.lossy and plan.compile:
        problems.append((("compression",), "memory.compression: cannot be combined with memory.compile: true; set "
                         "memory.compression.policy: none or memory.compile: false"))
    if plan.compression.lossy and spans:
        problems.append((("compression",), f"memory.compression: cannot be combined with memory.checkpointing.policy: "
                         f"{name}; use policy full, every, layers or selective"))
    return problems


def plan_problem(plan: MemoryPlan, facts: StepFacts | None = None) -> tuple[tuple[str, ...], str] | None:
    """The first of `plan_problems`, or None."""
    problems = plan_problems(plan, facts)
    return problems[0] if problems else None


def _pool_problems(plan: MemoryPlan) -> list[tuple[tuple[str, ...], str]]:
    """What the pools' policies cannot combine with, among themselves and with the activation policies."""
    problems = []
    for policy in plan.pool_policies():
        if policy.lossy and not plan.allow_lossy:
            problems.append(((policy.section,), f"memory.{policy.section}: {policy.label()} changes the training beyond "
                             "float rounding (its error is measured and logged); set memory.allow_lossy: true to "
                             f"accept that (or `ckrun tune --allow-lossy`), or leave memory.{policy.section} out"))
    offload, step = plan.optimizer_offload, plan.optimizer_step
    if offload.moves_state and step.updates_in_backward:
        problems.append((("optimizer_offload",), "memory.optimizer_offload: cannot be combined with memory."
                         "optimizer_step: in_backward (the host's update runs after the backward, on gradients it "
                         "copied); choose one of them"))
    if offload.moves_state and plan.weights.lossy:  # low-bit state is fine: torchao's AdamW on the host's tensors
        problems.append((("optimizer_offload",), f"memory.optimizer_offload: cannot be combined with memory.weights: "
                         f"{plan.weights.label()} (the host keeps float32 weights); choose one"))
    if plan.loss.splits_head and plan.compile:  # the head's pass-through is checked by identity, which compiled code loses
        problems.append((("loss",), "memory.loss: chunked cannot be combined with memory.compile: true; set "
                         "memory.loss.policy: whole or memory.compile: false"))
    return problems


def _step_problems(plan: MemoryPlan, facts: StepFacts) -> list[tuple[tuple[str, ...], str]]:
    """What the pools' policies cannot do with the rest of the recipe."""
    problems = []
    if plan.optimizer_step.updates_in_backward:
        why = _before_any_update(plan, facts)
        if why:
            problems.append((("optimizer_step",), f"memory.optimizer_step: in_backward updates each parameter as soon "
                             f"as its gradient is accumulated, but {why}; or use policy after"))
    if plan.optimizer_offload.masters_on_host and facts.precision != "bf16":
        problems.append((("optimizer_offload",), f"memory.optimizer_offload: {plan.optimizer_offload.label()} holds "
                         "bfloat16 weights on the device for bf16 autocast to read as it would cast them, not "
                         f"precision {facts.precision}; set precision: bf16 or policy cpu"))
    elif plan.optimizer_offload.moves_state and facts.precision == "fp16":
        problems.append((("optimizer_offload",), "memory.optimizer_offload: fp16's loss scaler unscales gradients "
                         "on the device, which the host copies would miss; use precision bf16 or policy none"))
    for policy in (plan.weights, plan.optimizer_state):
        if policy.library is not None and not facts.adamw:
            problems.append(((policy.section,), f"memory.{policy.section}: {policy.label()} is torchao's AdamW, which "
                             "stands in for train.optimizer.name: adamw only; set it, or leave this key out"))
    if plan.weights.holds_bf16 and facts.precision != "bf16":
        problems.append((("weights",), f"memory.weights: bf16 weights run under bf16 autocast (which keeps the ops "
                         f"that need float32 in it), not precision {facts.precision}; set precision: bf16"))
    return problems


def accumulates(plan: MemoryPlan, batch_size: int) -> bool:
    """Several micro-batches make a step: each parameter's gradient is summed over them."""
    return (plan.micro_batch or batch_size) < batch_size


def gradients_final(plan: MemoryPlan, facts: StepFacts) -> bool:
    """Each gradient is complete once the backward accumulates it, and nothing but the update reads
    it: one micro-batch, no global clipping, no fp16 loss scaling."""
    return not _before_any_update(plan, facts)


def _before_any_update(plan: MemoryPlan, facts: StepFacts) -> str:
    """Why every gradient must exist before the first update, or ''."""
    micro = plan.micro_batch or facts.batch_size
    if micro < facts.batch_size and not facts.distributed:  # on ranks, of a rank's share: check_world judges it
        return (f"memory.micro_batch {micro} makes {facts.batch_size // micro} micro-batches and the first would "
                "update the weights the others still need; leave memory.micro_batch out (or set it to "
                "train.batch_size)")
    if facts.grad_clip:
        return "global gradient clipping needs every gradient first; set train.grad_clip: null"
    if facts.precision == "fp16":
        return "fp16's loss scaler must see every gradient for inf/nan first; use precision bf16"
    return ""
