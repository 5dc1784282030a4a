"""Memory-plan policies as types: each checkpointing, offload and compression choice is one class.

A class is the whole policy: its recipe fields (pydantic, discriminated by `policy`), the blocks it
acts on, how the tuner writes it as a choice (`every:3`) and reads it back, which choices it offers
for a model, the line the log gives it, and what it is in the terms the rest of ckrun asks about
(`recomputes`, `spans_blocks`, `caches_ops`, `moves`, `lossy`), and what it does to one block in
the per-block solver's words (`block_action`, `on_blocks`). The rules for combining policies
(runner/plan/memory_plan.py) read those capabilities, never a policy's name; applying a policy to a model is
the memory layer's (runner/memory/), which asks these same methods; the tuner's space and solver
(autotune/) ask them too. Adding a policy is one class here and its place in the union, its tests,
and its line in docs/recipes.md's recipe block.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import ByteSize, Field

from .choices import members
from .policy_base import BlockLayout, BlockList, Policy, short_list

EVERY_K = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # k for "checkpoint every k-th block": spread, not exhaustive


# --- activation checkpointing --------------------------------------------------------------------


class CheckpointingPolicy(Policy):
    section: ClassVar[str] = "checkpointing"
    recomputes: ClassVar[bool] = True
    """It recomputes activations in backward (no plan does not)."""
    spans_blocks: ClassVar[bool] = False
    """One checkpoint region covers several blocks: it cannot switch per batch, and per-block hooks
    (offload, compression), FSDP's gathering and torch.compile cannot run inside it."""
    caches_ops: ClassVar[bool] = False
    """A Python dispatch mode handles every op of its blocks (a host cost per op in eager mode)."""

    @property
    def switchable(self) -> bool:
        """It can be one bucket's plan under memory.adaptive (switched between steps)."""
        return not self.spans_blocks

    def chosen(self, layout: BlockLayout) -> list[int]:
        """The blocks it recomputes."""
        return list(range(len(layout)))

    def regions(self, layout: BlockLayout) -> list[list[int]]:
        """The checkpoint regions, each a run of blocks recomputed as one."""
        return [[index] for index in self.chosen(layout)]

    def kept_ops(self) -> frozenset[str] | None:
        """aten ops whose outputs its recompute keeps instead of recomputing; None: it keeps none."""
        return None

    def kept_product_stride(self) -> int:
        """Of a block's matrix products (aten.mm) that `kept_ops` names, it keeps every n-th (1: all)."""
        return 1

    @classmethod
    def tuner_labels(cls, layout: BlockLayout) -> list[str]:
        """The choices it offers the tuner for a model of these blocks."""
        return [cls.tag()]

    def describe(self, layout: BlockLayout) -> str:
        """What the log says it does."""
        return "all"


class NoCheckpointing(CheckpointingPolicy):
    policy: Literal["none"] = "none"
    """Keep every activation: fastest, most memory."""
    recomputes: ClassVar[bool] = False
    block_action: ClassVar[str] = "keep"
    covers: ClassVar[str] = "none"
    tuner_starts: ClassVar[tuple[str, ...]] = ("none",)

    def chosen(self, layout: BlockLayout) -> list[int]:
        return []

    def describe(self, layout: BlockLayout) -> str:
        return "none"


class FullCheckpointing(CheckpointingPolicy):
    policy: Literal["full"]
    """Recompute every block in backward: about one extra forward of the blocks."""
    block_action: ClassVar[str] = "recompute"
    covers: ClassVar[str] = "every"
    tuner_starts: ClassVar[tuple[str, ...]] = ("full",)


class EveryKthCheckpointing(CheckpointingPolicy):
    policy: Literal["every"]
    every: int = Field(gt=0)
    """Checkpoint blocks 0, k, 2k, ...: most of the saving at a fraction of the recompute."""
    block_action: ClassVar[str] = "recompute"
    tuner_starts: ClassVar[tuple[str, ...]] = ("every:2",)

    def chosen(self, layout: BlockLayout) -> list[int]:
        return list(range(0, len(layout), self.every))

    def label(self) -> str:
        return f"every:{self.every}"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"every": int(argument)}

    @classmethod
    def tuner_labels(cls, layout: BlockLayout) -> list[str]:
        return [f"every:{k}" for k in EVERY_K if k < len(layout)]

    def describe(self, layout: BlockLayout) -> str:
        return f"every {_ordinal(self.every)}: {short_list(self.chosen(layout))}"


class LayerListCheckpointing(BlockList, CheckpointingPolicy):
    policy: Literal["layers"]
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Indices of the blocks to checkpoint (0-based, as `ckrun show --blocks` lists them)."""
    block_action: ClassVar[str] = "recompute"

    @classmethod
    def tuner_labels(cls, layout: BlockLayout) -> list[str]:
        return []  # the solver's per-block plans join the space as they are proposed

    def describe(self, layout: BlockLayout) -> str:
        return f"layers {short_list(self.chosen(layout))}"


class SqrtCheckpointing(CheckpointingPolicy):
    policy: Literal["sqrt"]
    """Split the blocks into about sqrt(L) segments and keep only segment boundaries."""
    spans_blocks: ClassVar[bool] = True

    def regions(self, layout: BlockLayout) -> list[list[int]]:
        return sqrt_segments(layout)[:-1]  # as checkpoint_sequential: backward needs the last segment first

    def chosen(self, layout: BlockLayout) -> list[int]:
        return [index for segment in self.regions(layout) for index in segment]

    @classmethod
    def tuner_labels(cls, layout: BlockLayout) -> list[str]:
        return ["sqrt"] if len(sqrt_segments(layout)) > 1 else []  # one segment would checkpoint nothing

    def describe(self, layout: BlockLayout) -> str:
        segments = sqrt_segments(layout)
        last = segments[-1] if segments else []
        kept = (f"{last[0]}-{last[-1]}" if len(last) > 1 else str(last[0])) if last else "-"
        return (f"sqrt: {len(segments)} segments of up to {max(map(len, segments), default=0)} blocks, each "
                f"recomputed as one unit; the last segment {kept} is kept")


class SelectiveCheckpointing(CheckpointingPolicy):
    policy: Literal["selective"]
    save_ops: list[str] = Field(
        default_factory=lambda: ["mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                                 "_scaled_dot_product_flash_attention_for_cpu"]
    )
    """aten ops whose outputs are kept; every other op in a block is recomputed in backward."""
    products_kept_every: int = Field(1, ge=1)
    """Of each block's matrix products and convolutions (aten mm, addmm, bmm, baddbmm, convolution, each
    op counted on its own in the order the forward runs it), keep every n-th output, the first
    included, and recompute the others: 1 keeps them all; 2 on a model whose blocks multiply with mm
    (Llama, GPT) is torchtitan's 'selective op', about half the products' bytes for one in two
    recomputed."""
    caches_ops: ClassVar[bool] = True
    block_action: ClassVar[str] = "selective"
    covers: ClassVar[str] = "every"

    def kept_ops(self) -> frozenset[str]:
        return frozenset(self.save_ops)

    def kept_product_stride(self) -> int:
        return self.products_kept_every

    def label(self) -> str:
        return "selective" if self.products_kept_every == 1 else f"selective:{self.products_kept_every}"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"products_kept_every": int(argument)}

    @classmethod
    def tuner_labels(cls, layout: BlockLayout) -> list[str]:
        return ["selective", "selective:2"]  # every product kept, or every second (torchtitan's 'selective op')

    def describe(self, layout: BlockLayout) -> str:
        stride = f" (of products, every {_ordinal(self.products_kept_every)})" if self.products_kept_every > 1 else ""
        return f"selective: keeping outputs of {', '.join(self.save_ops)}{stride}; recomputing the rest"


Checkpointing = Annotated[
    NoCheckpointing | FullCheckpointing | EveryKthCheckpointing | LayerListCheckpointing | SqrtCheckpointing
    | SelectiveCheckpointing,
    Field(discriminator="policy"),
]


def sqrt_segments(layout: BlockLayout) -> list[list[int]]:
    """About sqrt(L) runs of consecutive block indices, split at container boundaries (T5's encoder
    and decoder stacks have code in between, which a segment's replay would skip)."""
    count = len(layout)
    size = math.ceil(count / max(1, round(math.sqrt(count)))) if count else 1
    runs: dict[str, list[int]] = {}  # container -> its block indices
    for index, container in enumerate(layout.containers or [""] * count):
        runs.setdefault(container, []).append(index)
    segments = []
    for run in runs.values():
        # near-equal pieces, longer first: 5 blocks at up to 4 a segment split 3+2, not 4+1
        base, longer = divmod(len(run), math.ceil(len(run) / size))
        while run:
            take = base + (1 if longer > 0 else 0)
            segments.append(run[:take])
            run, longer = run[take:], longer - 1
    return segments


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return "block" if k == 1 else f"{k}{suffix}"


# --- activation offload ----------------------------------------------------------------------------


class OffloadPolicy(Policy):
    section: ClassVar[str] = "offload"
    moves: ClassVar[bool] = True
    """It moves saved activations to host memory (CUDA only)."""

    def chosen(self, layout: BlockLayout) -> list[int]:
        """The blocks whose saved activations go to the host."""
        return list(range(len(layout)))

    @classmethod
    def tuner_labels(cls, device_kind: str) -> list[str]:
        return [cls.tag()] if device_kind == "cuda" else []


class NoOffload(OffloadPolicy):
    policy: Literal["none"] = "none"
    """Saved activations stay on the device."""
    moves: ClassVar[bool] = False
    block_action: ClassVar[str] = "keep"
    covers: ClassVar[str] = "none"
    tuner_starts: ClassVar[tuple[str, ...]] = ("none",)

    def chosen(self, layout: BlockLayout) -> list[int]:
        return []

    @classmethod
    def tuner_labels(cls, device_kind: str) -> list[str]:
        return ["none"]


class AllBlocksOffload(OffloadPolicy):
    policy: Literal["all"]
    min_bytes: ByteSize = ByteSize(1 << 20)
    """Saved tensors smaller than this stay on the device (copying them costs more than it saves)."""
    block_action: ClassVar[str] = "offload"
    # covers no set: the solver lists the blocks it offloads (LayerListOffload), all of them included


class LayerListOffload(BlockList, OffloadPolicy):
    policy: Literal["layers"]
    layers: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    """Indices of the blocks whose saved activations go to pinned host memory."""
    min_bytes: ByteSize = ByteSize(1 << 20)
    """Saved tensors smaller than this stay on the device."""
    block_action: ClassVar[str] = "offload"

    @classmethod
    def tuner_labels(cls, device_kind: str) -> list[str]:
        return []  # the solver's per-block plans


Offload = Annotated[NoOffload | AllBlocksOffload | LayerListOffload, Field(discriminator="policy")]


# --- activation compression (lossy) ----------------------------------------------------------------

def float8():
    """torch.float8_e4m3fn, or None on a torch without float8. Imported here, not at the top:
    validating a recipe must not import torch."""
    import torch

    return getattr(torch, "float8_e4m3fn", None)


class CompressionPolicy(Policy):
    lossy: ClassVar[bool] = True
    """It stores saved activations rounded: backward computes with them, so the gradients change."""

    def unsupported(self) -> str | None:
        """Why this torch cannot run it, or None."""
        return None

    @classmethod
    def tuner_labels(cls) -> list[str]:
        return [cls.tag()]


class NoCompression(CompressionPolicy):
    policy: Literal["none"] = "none"
    """Saved activations keep their dtype: exact."""
    lossy: ClassVar[bool] = False
    tuner_starts: ClassVar[tuple[str, ...]] = ("none",)


class CastCompression(CompressionPolicy):
    policy: Literal["bf16", "fp8"]
    """`bf16`: fp32 saved activations of every block are stored as bfloat16 (half the bytes). `fp8`:
    every floating saved activation of 2 or more bytes is stored as float8_e4m3fn with one scale per
    tensor (a quarter of fp32's bytes; torch without float8 refuses it). Lossy: backward computes
    with rounded activations, so it needs memory.allow_lossy: true."""
    min_bytes: ByteSize = ByteSize(1 << 10)
    """Saved tensors smaller than this keep their dtype (casting them costs more than it saves)."""

    def stored_dtype(self):
        """The torch dtype saved activations are stored in (None: this torch has no float8)."""
        import torch

        return torch.bfloat16 if self.policy == "bf16" else float8()

    def unsupported(self) -> str | None:
        """Why this torch cannot run it, or None."""
        if self.stored_dtype() is None:
            from torch import __version__

            return (f"memory.compression: policy {self.policy} needs torch.float8_e4m3fn, which torch "
                    f"{__version__} does not have; use policy bf16")
        return None

    @classmethod
    def tuner_labels(cls) -> list[str]:
        return ["bf16"] + (["fp8"] if float8() is not None else [])


Compression = Annotated[NoCompression | CastCompression, Field(discriminator="policy")]


# --- the tuner's labels -------------------------------------------------------------------------------


CHECKPOINTING: tuple[type[CheckpointingPolicy], ...] = members(Checkpointing)
OFFLOAD: tuple[type[OffloadPolicy], ...] = members(Offload)
COMPRESSION: tuple[type[CompressionPolicy], ...] = members(Compression)


def checkpointing_choices(layout: BlockLayout) -> list[str]:
    return [label for cls in CHECKPOINTING for label in cls.tuner_labels(layout)]


def offload_choices(device_kind: str) -> list[str]:
    return [label for cls in OFFLOAD for label in cls.tuner_labels(device_kind)]


def compression_choices() -> list[str]:
    return [label for cls in COMPRESSION for label in cls.tuner_labels()]
