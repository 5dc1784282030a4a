"""The memory plan: the recipe's `memory` section, which the tuner searches over.

Every closed choice is a discriminated union on `policy`, so a plan is plain data that can be
written into a recipe, compared, hashed and proposed by the tuner.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator


class Strict(BaseModel):
    """Base of every recipe section: strict types, unknown keys rejected, docstrings as help."""

    model_config = ConfigDict(strict=True, extra="forbid", use_attribute_docstrings=True, frozen=True)


# --- activation checkpointing --------------------------------------------------------------


class NoCheckpointing(Strict):
    policy: Literal["none"] = "none"
    """Keep every activation: fastest, most memory."""


class FullCheckpointing(Strict):
    policy: Literal["full"]
    """Recompute every block in backward: about one extra forward of the blocks."""


class EveryKthCheckpointing(Strict):
    policy: Literal["every"]
    every: int = Field(gt=0)
    """Checkpoint blocks 0, k, 2k, ...: most of the saving at a fraction of the recompute."""


class LayerListCheckpointing(Strict):
    policy: Literal["layers"]
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Indices of the blocks to checkpoint (0-based, as `ckrun show --blocks` lists them)."""

    @field_validator("layers")
    @classmethod
    def _unique(cls, layers: list[int]) -> list[int]:
        if len(set(layers)) != len(layers):
            raise ValueError("a block index is listed twice")
        return sorted(layers)


class SqrtCheckpointing(Strict):
    policy: Literal["sqrt"]
    """Split the blocks into about sqrt(L) segments and keep only segment boundaries."""


class SelectiveCheckpointing(Strict):
    policy: Literal["selective"]
    save_ops: list[str] = Field(
        default_factory=lambda: ["mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                                 "_scaled_dot_product_flash_attention_for_cpu"]
    )
    """aten ops whose outputs are kept; every other op in a block is recomputed in backward."""


Checkpointing = Annotated[
    NoCheckpointing
    | FullCheckpointing
    | EveryKthCheckpointing
    | LayerListCheckpointing
    | SqrtCheckpointing
    | SelectiveCheckpointing,
    Field(discriminator="policy"),
]

# --- activation offload ---------------------------------------------------------------------


class NoOffload(Strict):
    policy: Literal["none"] = "none"
    """Saved activations stay on the device."""


class AllBlocksOffload(Strict):
    policy: Literal["all"]
    min_bytes: ByteSize = ByteSize(1 << 20)
    """Saved tensors smaller than this stay on the device (copying them costs more than it saves)."""


class LayerListOffload(Strict):
    policy: Literal["layers"]
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Indices of the blocks whose saved activations go to pinned host memory."""
    min_bytes: ByteSize = ByteSize(1 << 20)
    """Saved tensors smaller than this stay on the device."""


Offload = Annotated[NoOffload | AllBlocksOffload | LayerListOffload, Field(discriminator="policy")]

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


# --- activation compression (lossy) ----------------------------------------------------------


class NoCompression(Strict):
    policy: Literal["none"] = "none"
    """Saved activations keep their dtype: exact."""


class CastCompression(Strict):
    policy: Literal["bf16", "fp8"]
    """`bf16`: fp32 saved activations of every block are stored as bfloat16 (half the bytes). `fp8`:
    every floating saved activation of 2 or more bytes is stored as float8_e4m3fn with one scale per
    tensor (a quarter of fp32's bytes; torch without float8 refuses it). Lossy: backward computes
    with rounded activations, so it needs memory.allow_lossy: true."""
    min_bytes: ByteSize = ByteSize(1 << 10)
    """Saved tensors smaller than this keep their dtype (casting them costs more than it saves)."""


Compression = Annotated[NoCompression | CastCompression, Field(discriminator="policy")]


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
        if any(bucket.checkpointing.policy == "sqrt" for bucket in buckets):
            raise ValueError("a bucket cannot use policy sqrt (its segments span blocks, which cannot switch "
                             "per batch); use policy every or layers")
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


def plan_problem(plan: MemoryPlan) -> tuple[tuple[str, ...], str] | None:
    """(key path, message) for a combination the plan's fields cannot have; None when it is fine."""
    if plan.activation_memory_budget is not None and not plan.compile:
        return ("activation_memory_budget",), ("memory.activation_memory_budget: is torch.compile's partitioner "
                                               "setting, and needs memory.compile: true; set it or leave the budget out")
    if plan.compression.policy != "none" and not plan.allow_lossy:
        return ("compression",), (f"memory.compression: {plan.compression.policy} stores saved activations rounded, "
                                  "which changes the gradients; set memory.allow_lossy: true to accept that (or "
                                  "`ckrun tune --allow-lossy`), or memory.compression.policy: none")
    return None
