"""The memory plan: the recipe's `memory` section, which the tuner searches over.

Every closed choice is a discriminated union on `policy` whose members are the policy types of
runner/policies.py, so a plan is plain data that can be written into a recipe, compared, hashed
and proposed by the tuner. `plan_problems` is the one place that says which combinations a plan
cannot have, in terms of what the policies are (`spans_blocks`, `moves`, `lossy`), not their names.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import ByteSize, Field, field_validator

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
    Policy,
    SelectiveCheckpointing,
    SqrtCheckpointing,
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


class MemoryPlan(Strict):
    """How a step trades time for memory. Checkpointing, offload and compile never change what is
    computed; micro_batch does where the model looks across samples (BatchNorm, dropout masks)."""

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
    allow_lossy: bool = False
    """Permit knobs that change the gradients (memory.compression); `ckrun tune --allow-lossy` sets it
    in the plans it tries, and tuned.yaml keeps it so the choice stays visible."""
    max_mem: ByteSize | None = None
    """Hard cap on the step's peak memory (`40GB`, `40GiB`, bytes): exceeding it stops the run."""

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
"""The plan's fields that hold a policy (checkpointing, offload, compression), each with its classes
in union order: what the per-block solver reads the policies' `block_action`s from."""


def plan_problems(plan: MemoryPlan) -> list[tuple[tuple[str, ...], str]]:
    """(key path under memory, message) for every combination the plan cannot have, whatever the
    device: the one place these rules live (the recipe, the tuner and apply_plan all ask it)."""
    problems = []
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


def plan_problem(plan: MemoryPlan) -> tuple[tuple[str, ...], str] | None:
    """The first of `plan_problems`, or None."""
    problems = plan_problems(plan)
    return problems[0] if problems else None
