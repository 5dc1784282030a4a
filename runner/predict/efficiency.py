"""How much of a device's datasheet peaks each class of kernel reaches: the time model's calibration.

One share for every kernel (70 % of the matrix peak, 75 % of bandwidth) made a ResNet's convolutions
as fast as a transformer's large products and an attention kernel as fast as cuBLAS. The time
model now prices each op by its class (`OP_CLASSES`):
- matmul: products (mm, addmm, bmm, baddbmm), a share of the dtype's matrix peak, per dtype, then
  wave quantisation: a product of m x n outputs is cut into `tile` x `tile` tiles, one per streaming
  multiprocessor at a time; a last, partial wave leaves SMs idle (NVIDIA, Matrix Multiplication
  Background User's Guide, "Wave Quantization"); plus a fixed fill time per product where the
  device's entry gives one (`matmul_fill_us`: a small product never reaches the large ones' share);
- conv: cuDNN's convolutions, forward and backward, a share of the matrix peak per dtype;
- attention: the fused attention kernels by family (flash, efficient, cudnn), a share of the
  matrix peak of their dtype, forward (`attention`, `attention_causal`) and backward
  (`attention_backward`) apart where the entry says so; the memory-efficient kernel in fp32 runs
  `efficient_fp32_slowdown` times slower than in half precision (its products are CUTLASS's 3xTF32);
- memory: everything else (elementwise, reductions, copies), a share of bandwidth; normalisation
  kernels (layer norm, RMS norm, group norm) their own (`norm`, forward and backward);
- optimizer: the optimizer's step after the last backward, a share of bandwidth.

The figures live in `calibration.json` beside this module: entries per device key (`h100`), per
compute capability (`sm90`) or `*`, each a list of rows, one figure each with its own source
(`Figure`); a figure a specific entry leaves out comes from the next less specific one, so `sm90`
lists only what differs on Hopper. A GPU campaign that measures a card writes its entry with
`write_entry`; `entry_for` merges the entries that apply, the most specific figure winning.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["fp32", "tf32", "bf16", "fp16"]
Family = Literal["flash", "efficient", "cudnn"]
Share = Annotated[float, Field(gt=0, le=1)]
OP_CLASSES = ("matmul", "conv", "attention", "norm", "memory", "optimizer")
ATTENTION_FAMILIES = ("flash", "efficient", "cudnn")
CALIBRATION_PATH = Path(__file__).with_name("calibration.json")


class Efficiency(BaseModel):
    """Shares of a device's datasheet peaks that each class of kernel reaches in an eager step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul: dict[Dtype, Share]
    """Large products, per compute dtype (tf32: fp32 inputs on tensor cores), before wave quantisation."""
    matmul_fill_us: dict[Dtype, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    """A product's fixed time beside its FLOPs, per dtype, microseconds (0 where not given)."""
    conv: dict[Dtype, Share]
    """Convolutions (cuDNN), forward and backward, per compute dtype."""
    attention: dict[Family, Share]
    """Fused attention kernels by family, forward without a causal mask, of their dtype's matrix peak
    (causal attention's FLOPs are the half of the scores it computes, as the kernels' authors count)."""
    attention_causal: dict[Family, Share] = Field(default_factory=dict)
    """Forward with a causal mask, where it differs (unset: `attention`)."""
    attention_backward: dict[Family, Share] = Field(default_factory=dict)
    """Backward, where it differs (unset: `attention`); causal backward scales it as causal forward does."""
    efficient_fp32_slowdown: float = Field(6.0, ge=1)
    """How many times slower the memory-efficient kernel runs in fp32 than in half precision."""
    memory: Share
    """Elementwise, reduction and copy kernels: a share of memory bandwidth."""
    norm: dict[Literal["forward", "backward"], Share] = Field(default_factory=dict)
    """Normalisation kernels (layer, RMS and group norm), a share of bandwidth (unset: `memory`)."""
    optimizer: Share
    """The optimizer's step (fused or foreach kernels over every parameter): a share of bandwidth."""
    tile: int = Field(128, gt=0)
    """The output tile edge of a product, for wave quantisation."""
    launch_us: float | None = Field(None, ge=0)
    """The least an op costs on this device (unset: the device facts' `launch_us`)."""

    def compute(self, op_class: str, dtype: str, family: str = "", backward: bool = False,
                causal: bool = False) -> float:
        """The share of the matrix peak an op of `op_class` computed in `dtype` reaches."""
        if op_class == "attention":
            return self.attention_share(family, backward, causal)
        table = self.conv if op_class == "conv" else self.matmul
        return table.get(dtype) or table.get("fp32") or min(table.values())

    def attention_share(self, family: str, backward: bool, causal: bool) -> float:
        forward = self.attention.get(family, min(self.attention.values()))
        share = self.attention_backward.get(family, forward) if backward else forward
        if causal:
            share *= self.attention_causal.get(family, forward) / forward
        return share

    def traffic(self, op_class: str, backward: bool = False) -> float:
        """The share of bandwidth an op of `op_class` reaches for its bytes."""
        if op_class == "optimizer":
            return self.optimizer
        if op_class == "norm":
            return self.norm.get("backward" if backward else "forward", self.memory)
        return self.memory


class Figure(BaseModel):
    """One fact of the calibration: a dotted field of `Efficiency` (`matmul.bf16`, `attention_backward.flash`,
    `memory`), its value and where it comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    figure: str
    value: float
    source: str = Field(min_length=1)
    """The publication, table and row (or the campaign run) the value is read or fitted from."""


class CalibrationEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    applies_to: str
    """A `--gpu` key (`h100`), a compute capability (`sm90`), or `*` for any GPU."""
    figures: tuple[Figure, ...]
    """One row per fact, each with its source; the entries less specific than this one give the rest."""
    source: str
    """What the entry as a whole rests on (the campaign run, or the literature its rows cite)."""
    device: str
    """The device the figures were measured on, or `datasheets and literature`."""
    date: str
    versions: str
    """The software the figures hold for (torch, CUDA, cuDNN), or what the literature ran."""

    @model_validator(mode="after")
    def _one_row_a_figure(self) -> CalibrationEntry:
        names = [f.figure for f in self.figures]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"calibration entry {self.applies_to!r}: figure(s) {', '.join(twice)} given twice")
        unknown = [n for n in names if n.split(".")[0] not in Efficiency.model_fields]
        if unknown:
            raise ValueError(f"calibration entry {self.applies_to!r}: no such figure {', '.join(unknown)}")
        return self

    def label(self) -> str:
        return f"calibration {self.applies_to!r} ({self.device}, {self.date})"

    def over(self, base: CalibrationEntry) -> CalibrationEntry:
        """This entry with the figures it leaves out taken from `base`."""
        own = {f.figure for f in self.figures}
        figures = (*self.figures, *(f for f in base.figures if f.figure not in own))
        return CalibrationEntry.model_validate({**self.model_dump(exclude={"figures"}), "figures": figures})

    @functools.cached_property
    def efficiency(self) -> Efficiency:
        """The figures as the time model reads them; fails where a figure an `Efficiency` needs is missing."""
        nested: dict = {}
        for figure in self.figures:
            head, _, key = figure.figure.partition(".")
            value = int(figure.value) if head == "tile" else figure.value
            if key:
                nested.setdefault(head, {})[key] = value
            else:
                nested[head] = value
        return Efficiency.model_validate(nested)


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    about: str = ""
    entries: list[CalibrationEntry]

    def entry_for(self, key: str, capability: tuple[int, int] | None) -> CalibrationEntry:
        """The device's own figures, then its compute capability's, then `*`'s, as one entry labelled by the
        most specific of them."""
        wanted = [key, f"sm{capability[0]}{capability[1]}" if capability else None, "*"]
        found = [entry for name in wanted for entry in self.entries if entry.applies_to == name]
        if not found or found[-1].applies_to != "*":
            raise LookupError(f"{CALIBRATION_PATH.name} has no entry for {key} and no '*' entry")
        merged = found[-1]
        for entry in reversed(found[:-1]):
            merged = entry.over(merged)
        return merged


@functools.cache
def calibration(path: Path = CALIBRATION_PATH) -> Calibration:
    return Calibration.model_validate(json.loads(path.read_text(encoding="utf-8")))


def write_entry(entry: CalibrationEntry, path: Path = CALIBRATION_PATH) -> None:
    """Put `entry` into the table at `path`, replacing the one for the same device, capability or `*`
    (what a GPU campaign calls with the figures it measured)."""
    table = Calibration.model_validate(json.loads(path.read_text(encoding="utf-8")))
    kept = [old for old in table.entries if old.applies_to != entry.applies_to]
    updated = table.model_copy(update={"entries": [*kept, entry]})
    path.write_text(json.dumps(updated.model_dump(mode="json"), indent=1) + "\n", encoding="utf-8")
    calibration.cache_clear()
