"""Policies for the memory pools beside the activations: weights, gradients, optimizer state, the loss.

Each knob is one class on `PoolPolicy` (runner/policy_base.py), in the house's way
(runner/policies.py): its recipe fields (pydantic, discriminated by `policy`), its tuner labels
(`label()` / `from_argument` / `tuner_labels`), its log line (`describe`), and what it is in the
terms the rest of ckrun asks about:

- `pool`: the memory pool it acts on, named as the estimate's breakdown names it (`parameters`,
  `gradients`, `optimizer_state`, `loss`, `weight_casts`);
- `lossy`: it changes what training computes beyond float rounding (refused without
  memory.allow_lossy, its error measured: runner/train/measure/update_error.py);
- `library`: the optional package it needs (`torchao`), refused in one line when that is absent;
- and the capabilities `plan_problems` (runner/plan.py) combines: `updates_in_backward`,
  `moves_state`, `splits_head`, `holds_bf16`.

Applying them is the memory layer's (runner/memory/weights.py, optimizers.py, host_optimizer.py,
chunked_loss.py); the estimator predicts each to the byte by running that same code on fake tensors.
Pure data: importing this module imports neither torch nor torchao.
"""

from __future__ import annotations

import importlib.util
from abc import abstractmethod
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from .choices import members
from .policy_base import TORCHAO, PoolPolicy


# --- weight precision ----------------------------------------------------------------------------------


class WeightsPolicy(PoolPolicy):
    section: ClassVar[str] = "weights"
    pool: ClassVar[str] = "parameters"
    holds_bf16: ClassVar[bool] = False
    """The model's parameters are held in bfloat16 (2 bytes each), not float32."""

    def autocast_cache(self) -> bool:
        """Whether autocast keeps its cast copies of the weights for the whole forward."""
        return True

    @abstractmethod
    def holds(self, precision: str) -> str:
        """What the weights hold under `precision` (fp32, bf16, fp16), for the estimate's notes."""


class MasterWeights(WeightsPolicy):
    policy: Literal["fp32"] = "fp32"
    """Parameters in float32 (4 bytes each), the optimizer's master copy; under bf16/fp16 autocast
    every op that computes in half precision casts the weights it reads (2 bytes a parameter)."""
    cast_cache: bool = True
    """Keep autocast's cast copies for the whole forward (torch's default: a weight read twice is cast
    once). false: each op casts again and the copy is freed with the op unless backward saves it;
    under activation checkpointing the checkpointed blocks then hold no cast weights from their
    forward to the end of the forward (exact: the same values are cast)."""
    active: ClassVar[bool] = False

    def autocast_cache(self) -> bool:
        return self.cast_cache

    def label(self) -> str:
        return "fp32" if self.cast_cache else "fp32:uncached"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        if argument != "uncached":
            raise ValueError(f"weights fp32 takes the argument uncached, not {argument!r}")
        return {"cast_cache": False}

    @classmethod
    def tuner_labels(cls, precision: str = "bf16") -> list[str]:
        return ["fp32"] + (["fp32:uncached"] if precision != "fp32" else [])

    def holds(self, precision: str) -> str:
        if precision == "fp32":
            return "weights: fp32 parameters (4 B each), used as they are: no cast copies"
        cached = ("cached for the whole forward (autocast's cache: a weight read twice is cast once)" if self.cast_cache
                  else "made by each op and freed with it unless backward saves it (memory.weights fp32:uncached)")
        return (f"weights: fp32 masters (4 B a parameter) for the optimizer, and {precision} copies cast by autocast "
                f"(2 B a parameter of the weights the forward reads), {cached}")

    def describe(self) -> str:
        return ("memory.weights fp32:uncached: autocast casts each weight per op (its cast cache off), so "
                "checkpointed blocks hold no cast weights between their forward and their backward")


class BF16Weights(WeightsPolicy):
    policy: Literal["bf16"]
    """Parameters held in bfloat16 (2 bytes each, no fp32 master copy), updated by torchao's AdamW
    with stochastic rounding (the update is computed in fp32 and rounded up or down at random in
    proportion, so small updates are not lost to rounding on average). Gradients are bf16 too. Lossy:
    needs memory.allow_lossy: true and train.optimizer.name: adamw. On ranks: FSDP2 shards the bf16
    parameters and each rank rounds its own elements; DDP's replicas draw the same random bits (seeded
    by train.seed, the step and the parameter), so they stay identical. Its tolerance there: a run on
    ranks is no farther from one process's losses than twice one process's distance from exact
    training (another draw of the same rounding), plus float summation order."""
    lossy: ClassVar[bool] = True
    library: ClassVar[str | None] = TORCHAO
    holds_bf16: ClassVar[bool] = True

    def holds(self, precision: str) -> str:
        return ("weights: bf16 parameters (2 B each) and bf16 gradients; no fp32 master copy (the update rounds "
                "stochastically) and no cast copies")

    def describe(self) -> str:
        return ("memory.weights bf16: parameters and gradients held in bfloat16, AdamW's update rounded "
                "stochastically (torchao); lossy")


Weights = Annotated[MasterWeights | BF16Weights, Field(discriminator="policy")]


# --- optimizer state precision ---------------------------------------------------------------------


class OptimizerStatePolicy(PoolPolicy):
    section: ClassVar[str] = "optimizer_state"
    pool: ClassVar[str] = "optimizer_state"

    def optimizer_class(self) -> str | None:
        """The torchao.optim class that keeps the state (None: the recipe's own optimizer)."""
        return None

    def moment_bytes(self) -> float | None:
        """The fewest bytes a moment keeps per parameter element, its scales left out (the tuner's lower
        bound: autotune/space/pool_floor.py); None: the parameter's own dtype."""
        return None

    def unsupported(self) -> str | None:
        """Why this torch cannot run it, or None."""
        return None


class FullState(OptimizerStatePolicy):
    policy: Literal["full"] = "full"
    """The recipe's optimizer as it is: AdamW keeps two moments in the parameters' dtype (8 B a
    float32 parameter)."""
    active: ClassVar[bool] = False


_LOW_BIT = {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}
_MOMENT_BYTES = {"8bit": 1.0, "4bit": 0.5, "fp8": 1.0}


class LowBitState(OptimizerStatePolicy):
    policy: Literal["8bit", "4bit", "fp8"]
    """AdamW's two moments quantized block-wise by torchao.optim: `8bit` (AdamW8bit, 2 B a parameter
    with its scales, a quarter of fp32's), `4bit` (AdamW4bit, about 1 B), `fp8` (AdamWFp8, float8 with
    one scale per block: 2 B). Tensors under 4096 elements keep full precision, as bitsandbytes
    does. Lossy: needs memory.allow_lossy: true and train.optimizer.name: adamw. On ranks: DDP's
    replicas quantize as one process does; FSDP2's shards each quantize their own elements (a shard
    under 4096 elements keeps full precision). Its tolerance there: a run on ranks is no farther from
    one process's losses than twice one process's distance from exact training, plus float summation
    order."""
    full_precision_embeddings: bool = True
    """Keep the moments of embedding tables (nn.Embedding weights, and a head tied to one) in full
    precision, as bitsandbytes advises: rows of tokens a batch lacks get no gradient, and a block's
    scale, set by the rows that do, rounds their second moment to 0, so their update divides by eps
    (measured by runner/train/measure/update_error.py on tests/runner/memory/tiny_lm.py's WIDE Llama: 8-bit's
    error of the update over 3 steps is 2.8 with quantized embeddings, 0.009 with these kept).
    false (the tuner's `8bit:embeddings`): torchao's default, every large moment quantized."""
    lossy: ClassVar[bool] = True
    library: ClassVar[str | None] = TORCHAO

    def optimizer_class(self) -> str:
        return _LOW_BIT[self.policy]

    def moment_bytes(self) -> float:
        return _MOMENT_BYTES[self.policy]

    def label(self) -> str:
        return self.policy if self.full_precision_embeddings else f"{self.policy}:embeddings"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        if argument != "embeddings":
            raise ValueError(f"optimizer_state low-bit takes the argument embeddings, not {argument!r}")
        return {"full_precision_embeddings": False}

    def unsupported(self) -> str | None:
        import torch

        if self.optimizer_class() == "AdamWFp8" and not hasattr(torch, "float8_e4m3fn"):
            return (f"memory.optimizer_state: policy fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
                    "does not have; use policy 8bit")
        return None

    @classmethod
    def tuner_labels(cls) -> list[str]:
        return list(_LOW_BIT) if importlib.util.find_spec(TORCHAO) is not None else []

    def describe(self) -> str:
        return (f"memory.optimizer_state {self.policy}: AdamW's moments quantized block-wise (torchao.optim."
                f"{self.optimizer_class()}); lossy")


OptimizerState = Annotated[FullState | LowBitState, Field(discriminator="policy")]


# --- when the update runs ---------------------------------------------------------------------------


class OptimizerStepPolicy(PoolPolicy):
    section: ClassVar[str] = "optimizer_step"
    pool: ClassVar[str] = "gradients"
    updates_in_backward: ClassVar[bool] = False
    """Each parameter is updated, and its gradient freed, as soon as its gradient is accumulated."""


class StepAfterBackward(OptimizerStepPolicy):
    policy: Literal["after"] = "after"
    """One optimizer step after the last micro-batch's backward: every gradient is alive until then
    (4 B a float32 parameter)."""
    active: ClassVar[bool] = False


class StepInBackward(OptimizerStepPolicy):
    policy: Literal["in_backward"]
    """Update each parameter inside the backward, as soon as its gradient is accumulated, and free
    that gradient then (a post-accumulate-grad hook, as torchtune's optimizer_in_bwd): at most the
    gradients of the parameters whose backward is under way are alive. The same arithmetic as the
    step after backward, so exact, but only with one micro-batch, no global gradient clipping
    (train.grad_clip: null) and no fp16 loss scaling, which all need every gradient first. On ranks:
    fsdp, hsdp and tp update each rank's shard once FSDP2 has reduce-scattered (and averaged) it;
    refused under ddp, which averages a gradient only after autograd has accumulated it."""
    updates_in_backward: ClassVar[bool] = True

    def describe(self) -> str:
        return ("memory.optimizer_step in_backward: each parameter is updated and its gradient freed as soon as "
                "the backward has accumulated it")


OptimizerStep = Annotated[StepAfterBackward | StepInBackward, Field(discriminator="policy")]


# --- where the optimizer state and update live -----------------------------------------------------


class OptimizerOffloadPolicy(PoolPolicy):
    section: ClassVar[str] = "optimizer_offload"
    pool: ClassVar[str] = "optimizer_state"
    moves_state: ClassVar[bool] = False
    """The optimizer state (and the update) of some parameters lives in host memory."""

    def host_fraction(self) -> float:
        """The share of the parameters' bytes whose state and update live in host memory."""
        return 0.0

    @classmethod
    def tuner_labels(cls, device_kind: str = "cuda") -> list[str]:
        return [cls.tag()]


class NoOptimizerOffload(OptimizerOffloadPolicy):
    policy: Literal["none"] = "none"
    """The optimizer state and the update stay on the training device."""
    active: ClassVar[bool] = False


OFFLOAD_FRACTIONS = (0.5, 1.0)  # what the tuner offers; any fraction in (0, 1] is valid in a recipe


class HostOptimizerOffload(OptimizerOffloadPolicy):
    policy: Literal["cpu"]
    """Keep the optimizer state of a fraction of the parameters, with a float32 copy of them, in
    pinned host memory and run their update on the CPU (torch's fused CPU AdamW), as Megatron's
    fractional optimizer offload: each step copies those gradients to the host and the updated
    parameters back. With one micro-batch and no clipping or loss scaling, each gradient is copied
    as soon as the backward has accumulated it (overlapping the rest of the backward) and freed on
    the device. Exact: the same update, computed on the host. CUDA only, one process: on ranks the host
    offload is FSDP2's (memory.sharding.offload: cpu, under fsdp, hsdp or tp)."""
    fraction: float = Field(default=1.0, gt=0, le=1)
    """The share of the parameters' bytes whose state and update go to the host, taken in the model's
    parameter order (1: all of them)."""
    moves_state: ClassVar[bool] = True

    def host_fraction(self) -> float:
        return self.fraction

    def label(self) -> str:
        return "cpu" if self.fraction == 1 else f"cpu:{self.fraction:g}"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"fraction": float(argument)}

    @classmethod
    def tuner_labels(cls, device_kind: str = "cuda") -> list[str]:
        if device_kind != "cuda":
            return []
        return [cls(policy="cpu", fraction=fraction).label() for fraction in OFFLOAD_FRACTIONS]

    def describe(self) -> str:
        share = "all parameters" if self.fraction == 1 else f"{self.fraction:.0%} of the parameters' bytes"
        return (f"memory.optimizer_offload {self.label()}: the optimizer state and update of {share} in host "
                "memory; their gradients go to the host and the updated weights come back each step")


OptimizerOffload = Annotated[NoOptimizerOffload | HostOptimizerOffload, Field(discriminator="policy")]


# --- the loss ------------------------------------------------------------------------------------------


class LossPolicy(PoolPolicy):
    section: ClassVar[str] = "loss"
    pool: ClassVar[str] = "loss"
    splits_head: ClassVar[bool] = False
    """The model's output projection and the loss run in pieces of the sequence (language models only)."""

    def pieces(self) -> int:
        """How many pieces of the sequence the loss runs over (1: the whole logits at once)."""
        return 1


class WholeLogits(LossPolicy):
    policy: Literal["whole"] = "whole"
    """The model's logits over the whole vocabulary for every position at once, then the loss (in
    float32): [batch, sequence, vocabulary] logits, their fp32 copy and their gradient."""
    active: ClassVar[bool] = False


class ChunkedLoss(LossPolicy):
    policy: Literal["chunked"]
    """Cross-entropy over `chunks` pieces of the sequence, each piece's logits computed from the
    model's last hidden states by its output projection and recomputed in the backward (a
    checkpoint per piece: torchtune's chunked loss, Liger's fused linear cross-entropy idea): one
    piece's logits live at a time instead of the whole sequence's. Exact up to float summation
    order (the loss is a sum of per-piece sums; the head's weight gradient a sum over pieces);
    with `chunks: 1` the arithmetic is the same. Needs a language-model head that is one Linear
    whose output the model returns as its logits. On ranks each rank splits its own share; under
    FSDP2 the root's parameters (the head among them) stay gathered from the forward to the backward."""
    chunks: int = Field(default=8, gt=0)
    """Pieces of the sequence (a piece is at least one position)."""
    splits_head: ClassVar[bool] = True

    def pieces(self) -> int:
        return self.chunks

    def label(self) -> str:
        return f"chunked:{self.chunks}"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"chunks": int(argument)}

    @classmethod
    def tuner_labels(cls) -> list[str]:
        return ["chunked:8"]

    def describe(self) -> str:
        return (f"memory.loss chunked:{self.chunks}: the output projection and cross-entropy run over {self.chunks} "
                "pieces of the sequence, each piece's logits recomputed in backward")


Loss = Annotated[WholeLogits | ChunkedLoss, Field(discriminator="policy")]


# --- the tuner's labels -------------------------------------------------------------------------------

WEIGHTS: tuple[type[WeightsPolicy], ...] = members(Weights)
OPTIMIZER_STATE: tuple[type[OptimizerStatePolicy], ...] = members(OptimizerState)
OPTIMIZER_STEP: tuple[type[OptimizerStepPolicy], ...] = members(OptimizerStep)
OPTIMIZER_OFFLOAD: tuple[type[OptimizerOffloadPolicy], ...] = members(OptimizerOffload)
LOSS: tuple[type[LossPolicy], ...] = members(Loss)
POOL_KINDS = {"weights": WEIGHTS, "optimizer_state": OPTIMIZER_STATE, "optimizer_step": OPTIMIZER_STEP,
              "optimizer_offload": OPTIMIZER_OFFLOAD, "loss": LOSS}
"""The plan's key -> the classes of its union: a tuner label reads back with ckrun.runner.choices.choice_fields."""
