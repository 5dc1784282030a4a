"""What the tuner knows of the device and of the model, as their child processes reported them: the
tuner itself never touches CUDA and never builds the user's model. The space (autotune/space/space.py)
and its knobs (autotune/space/knobs.py, autotune/space/sharding.py) read these; nothing here imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckrun.runner.memory.blocks import Block, BlockList
from ckrun.runner.memory.floor import ParameterFacts

from .tp_facts import TensorFacts


@dataclass(frozen=True)
class Device:
    """What the probe child saw: the parent never touches CUDA itself."""

    kind: str  # "cpu" or "cuda"
    name: str
    total_bytes: int  # 0 on the CPU: no card-level limit to compare a cap with
    precisions: tuple[str, ...]  # the autocast precisions the device runs
    torch: str
    cuda: str | None = None
    context_bytes: int = 0  # the CUDA context once a step's kernels are loaded; counts against a card-level cap
    count: int = 1  # GPUs on this machine: ranks for tune --nproc

    @classmethod
    def from_json(cls, data: dict) -> Device:
        return cls(data["kind"], data["name"], data["total_bytes"], tuple(data["precisions"]), data["torch"],
                   data.get("cuda"), int(data.get("context_bytes") or 0), int(data.get("count") or 1))


@dataclass(frozen=True)
class ModelFacts:
    """What the space needs to know of the model, as the model child reported it (the tuner never
    builds the user's model itself)."""

    blocks: BlockList  # names and containers; the modules stay in the child
    batchnorm: tuple[str, ...] = ()  # BatchNorm layers: they normalise over each micro-batch
    dropout: tuple[str, ...] = ()  # dropout layers with p > 0: masks are drawn per micro-batch
    tensor: TensorFacts | None = None  # its tensor-parallel plan (tp under --nproc); None: the child did not say
    parameters: ParameterFacts | None = None  # counts and bytes of its parameters; None: the child did not say
    loss_split: str | None = "the model child did not say whether the model's head can be split"
    """Why memory.loss chunked cannot split its output projection, or None where it can."""

    @classmethod
    def from_json(cls, data: dict) -> ModelFacts:
        blocks = [Block(i, name, None) for i, name in enumerate(data["blocks"])]
        tensor = data.get("tensor_parallel")
        parameters = data.get("parameters")
        return cls(BlockList(data["container_name"], blocks, list(data["containers"])),
                   tuple(data.get("batchnorm", ())), tuple(data.get("dropout", ())),
                   TensorFacts.from_json(tensor) if tensor else None,
                   ParameterFacts(**parameters) if parameters else None,
                   data.get("loss_split", cls.loss_split))
