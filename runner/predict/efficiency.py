"""How much of a device's datasheet peaks each class of kernel reaches: the time model's calibration.

One share for every kernel (70 % of the matrix peak, 75 % of bandwidth) made a ResNet's convolutions
as fast as a transformer's large products and an attention kernel as fast as cuBLAS. The time
model now prices each op by its class (`OP_CLASSES`):
- matmul: products (mm, addmm, bmm, baddbmm), a share of the dtype's matrix peak, per dtype, then
  wave quantisation: a product of m x n outputs is cut into `tile` x `tile` tiles, one per streaming
  multiprocessor at a time; a last, partial wave leaves SMs idle (NVIDIA, Matrix Multiplication
  Background User's Guide, "Wave Quantization");
- conv: cuDNN's convolutions, forward and backward, a share of the matrix peak per dtype;
- attention: the fused attention kernels by family (flash, efficient, cudnn), a share of the
  matrix peak of their dtype;
- memory: everything else (elementwise, normalisation, reductions, copies), a share of bandwidth;
- optimizer: the optimizer's step after the last backward, a share of bandwidth.

The figures live in `calibration.json` beside this module, one entry per device key (`h100`), per
compute capability (`sm90`) or `*`, each with its source, the device it was measured on (or the
literature it comes from), the date and the versions it holds for. A GPU campaign that measures a
card writes its entry with `write_entry`; `entry_for` takes the most specific entry that applies.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Dtype = Literal["fp32", "tf32", "bf16", "fp16"]
Share = Annotated[float, Field(gt=0, le=1)]
OP_CLASSES = ("matmul", "conv", "attention", "memory", "optimizer")
ATTENTION_FAMILIES = ("flash", "efficient", "cudnn")
CALIBRATION_PATH = Path(__file__).with_name("calibration.json")


class Efficiency(BaseModel):
    """Shares of a device's datasheet peaks that each class of kernel reaches in an eager step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    matmul: dict[Dtype, Share]
    """Large products, per compute dtype (tf32: fp32 inputs on tensor cores), before wave quantisation."""
    conv: dict[Dtype, Share]
    """Convolutions (cuDNN), forward and backward, per compute dtype."""
    attention: dict[Literal["flash", "efficient", "cudnn"], Share]
    """Fused attention kernels by family, forward and backward, of their dtype's matrix peak."""
    memory: Share
    """Elementwise, normalisation, reduction and copy kernels: a share of memory bandwidth."""
    optimizer: Share
    """The optimizer's step (fused or foreach kernels over every parameter): a share of bandwidth."""
    tile: int = Field(128, gt=0)
    """The output tile edge of a product, for wave quantisation."""

    def compute(self, op_class: str, dtype: str, family: str = "") -> float:
        """The share of the matrix peak an op of `op_class` computed in `dtype` reaches."""
        if op_class == "attention":
            return self.attention.get(family, min(self.attention.values()))
        table = self.conv if op_class == "conv" else self.matmul
        return table.get(dtype) or table.get("fp32") or min(table.values())

    def traffic(self, op_class: str) -> float:
        """The share of bandwidth an op of `op_class` reaches for its bytes."""
        return self.optimizer if op_class == "optimizer" else self.memory


class CalibrationEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    applies_to: str
    """A `--gpu` key (`h100`), a compute capability (`sm90`), or `*` for any GPU."""
    efficiency: Efficiency
    source: str
    """Where each figure comes from: the literature cited, or the campaign run that measured it."""
    device: str
    """The device the figures were measured on, or `datasheets and literature`."""
    date: str
    versions: str
    """The software the figures hold for (torch, CUDA, cuDNN), or what the literature ran."""

    def label(self) -> str:
        return f"calibration {self.applies_to!r} ({self.device}, {self.date})"


class Calibration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    about: str = ""
    entries: list[CalibrationEntry]

    def entry_for(self, key: str, capability: tuple[int, int] | None) -> CalibrationEntry:
        """The device's own entry, else its compute capability's, else `*`."""
        wanted = [key, f"sm{capability[0]}{capability[1]}" if capability else None, "*"]
        for name in wanted:
            for entry in self.entries:
                if entry.applies_to == name:
                    return entry
        raise LookupError(f"{CALIBRATION_PATH.name} has no entry for {key} and no '*' entry")


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
