"""Policies for the memory pools beside the activations: weights, gradients, optimizer state, the loss.

Each knob is one class on `PoolPolicy` (runner/plan/policy_base.py), in the house's way
(runner/plan/policies.py): its recipe fields (pydantic, discriminated by `policy`), its tuner labels
(`label()` / `from_argument` / `tuner_labels`), its log line (`describe`), and what it is in the
terms the rest of ckrun asks about:

- `pool`: the memory pool it acts on, named as the estimate's breakdown names it (`parameters`,
  `gradients`, `optimizer_state`, `loss`, `weight_casts`);
- `lossy`: it changes what training computes beyond float rounding (refused without
  memory.allow_lossy, its error measured: runner/train/measure/update_error.py);
- `library`: the optional package it needs (`torchao`), refused in one line when that is absent;
- `saved_as`: what a checkpoint's state depends on of it (the resume fingerprint);
- and the capabilities `plan_problems` (runner/plan/memory_plan.py) combines: `updates_in_backward`,
  `moves_state`, `masters_on_host`, `splits_head`, `holds_bf16`.

Each kind of pool is one union in `POOL_KINDS` at the end, the one table every list of the pools comes
from. Applying them is the memory layer's (runner/memory/apply.py's POOL_APPLIERS: weights.py,
chunked_loss.py; optimizers.py and host_optimizer.py for the optimizer's); the estimator predicts each
to the byte by running that same code on fake tensors.
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
    """How the parameters are held: `fp32` masters (autocast casts copies; `cast_cache: false` keeps
    none for the whole forward), or `bf16` with a stochastically rounded update (lossy)."""

    section: ClassVar[str] = "weights"
    pool: ClassVar[str] = "parameters"
    holds_bf16: ClassVar[bool] = False
    """The model's parameters are held in bfloat16 (2 bytes each), not float32."""

    def autocast_cache(self) -> bool:
        """Whether autocast keeps its cast copies of the weights for the whole forward."""
        return True

    def saved_as(self) -> str:
        return self.tag()  # the parameters' dtype; the cast cache saves the same state

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
    proportion, so small updates are not lost to rounding on average). Gradients are bf16 too; over
    several micro-batches (memory.micro_batch) each is summed in float32 (4 B a parameter while the
    backward runs), never in bf16, and rounded to bf16 once before clipping and the update, as one
    pass over the whole batch would give it. Lossy: needs memory.allow_lossy: true and
    train.optimizer.name: adamw. On ranks: FSDP2 shards the bf16 parameters and each rank rounds its
    own elements; DDP's replicas draw the same random bits (seeded by train.seed, the step and the
    parameter), so they stay identical. Its tolerance there: a run on ranks is no farther from one
    process's losses than twice one process's distance from exact training (another draw of the same
    rounding), plus float summation order."""
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
    """The precision of AdamW's moments: `full` (as the recipe's optimizer keeps them), or `8bit`,
    `4bit`, `fp8` (torchao.optim's low-bit AdamW; lossy)."""

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
    """When the update runs: `after` the backward (every gradient alive until then), or `in_backward`
    (each parameter updated and its gradient freed as soon as it is accumulated; exact)."""

    section: ClassVar[str] = "optimizer_step"
    pool: ClassVar[str] = "gradients"
    updates_in_backward: ClassVar[bool] = False
    """Each parameter is updated, and its gradient freed, as soon as its gradient is accumulated."""

    def saved_as(self) -> None:
        return None  # the same optimizer, stepped at another time: the same state is saved


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
    """Where the optimizer state and update live: on the device (`none`), for a `fraction` of the
    parameters in host memory with the update on the CPU (`cpu`; exact; CUDA only), or with the float32
    master weights on the host too and bfloat16 weights on the device (`master`, ZeRO-Offload's split;
    exact; precision bf16)."""

    section: ClassVar[str] = "optimizer_offload"
    pool: ClassVar[str] = "optimizer_state"
    moves_state: ClassVar[bool] = False
    """The optimizer state (and the update) of some parameters lives in host memory."""
    masters_on_host: ClassVar[bool] = False
    """The float32 master weights live in host memory too, and the device holds bfloat16 copies of those
    autocast would cast anyway (ZeRO-Offload's split): every gradient goes to the host as it is made."""

    def host_fraction(self) -> float:
        """The share of the parameters' bytes whose state and update live in host memory."""
        return 0.0

    def cpu_refusal(self) -> str | None:
        """Why a run on the CPU refuses it (nothing to save there), or None where it runs there too."""
        return None

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

    def cpu_refusal(self) -> str:
        return ("memory.optimizer_offload: moves optimizer state from the GPU to host memory; this run is on the CPU, "
                "so there is nothing to save - set memory.optimizer_offload.policy: none")

    def describe(self) -> str:
        share = "all parameters" if self.fraction == 1 else f"{self.fraction:.0%} of the parameters' bytes"
        return (f"memory.optimizer_offload {self.label()}: the optimizer state and update of {share} in host "
                "memory; their gradients go to the host and the updated weights come back each step")


class HostMasterOffload(OptimizerOffloadPolicy):
    policy: Literal["master"]
    """ZeRO-Offload's split: the float32 master weights, AdamW's moments and the update in pinned host
    memory (torch's fused CPU AdamW, or torchao's low-bit AdamW on the host's tensors with
    memory.optimizer_state 8bit/4bit/fp8), and on the device bfloat16 copies of the weights of the
    nn.Linear layers, recast from the masters after each host step; every other parameter (embeddings,
    norms, a head tied to an embedding or split by the chunked loss) stays float32 on the device. Each
    gradient goes to the host as soon as the backward accumulates it (a post-accumulate-grad hook
    copies it to a pinned buffer on a side stream and frees it on the device), where micro-batches add
    up in float32. Exact: the update is float32 AdamW on float32 gradients, and the forward reads the
    bfloat16 weights that bf16 autocast casts a layer's weight to anyway (the same rounding); needs
    precision bf16. A layer that runs twice in one forward, or outside autocast, is refused at its
    first step (its weight's gradients would add up in bfloat16). On the CPU the host and the device
    are the same memory: it saves nothing there, but runs the same path."""
    moves_state: ClassVar[bool] = True
    masters_on_host: ClassVar[bool] = True

    def host_fraction(self) -> float:
        return 1.0

    @classmethod
    def tuner_labels(cls, device_kind: str = "cuda") -> list[str]:
        return [cls.tag()] if device_kind == "cuda" else []

    def describe(self) -> str:
        return ("memory.optimizer_offload master: float32 master weights, AdamW's moments and update in host memory, "
                "bfloat16 copies of the nn.Linear weights on the device (recast after each host step); each gradient "
                "goes to the host as the backward makes it (exact: float32 AdamW, the weights bf16 autocast casts to)")


OptimizerOffload = Annotated[NoOptimizerOffload | HostOptimizerOffload | HostMasterOffload,
                             Field(discriminator="policy")]


# --- the loss ------------------------------------------------------------------------------------------


class LossPolicy(PoolPolicy):
    """How a language model's loss is computed: from the `whole` logits, or `chunked` over pieces of
    the sequence with each piece's logits recomputed in backward (exact up to summation order)."""

    section: ClassVar[str] = "loss"
    pool: ClassVar[str] = "loss"
    splits_head: ClassVar[bool] = False
    """The model's output projection and the loss run in pieces of the sequence (language models only)."""

    def saved_as(self) -> None:
        return None  # the loss's pieces hold no state

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


# --- the one table -------------------------------------------------------------------------------------

POOL_KINDS: dict[str, tuple[type[PoolPolicy], ...]] = {
    kind[0].section: kind for kind in map(members, (Weights, OptimizerState, OptimizerStep, OptimizerOffload, Loss))}
"""The pools beside the activations: the plan's key -> the classes of its union, in plan order, the first
the default. Everything that lists the pools derives from this table: the plan's fields (runner/plan/memory_plan.py
makes one per entry, documented by `key_doc`), `MemoryPlan.pool_policies()` and the rules over them,
`apply_plan`'s loop (runner/memory/apply.py), the resume fingerprint (`saved_as`), the tuner's pool
knobs (autotune/space/pool_knobs.py) and their lower bound, and a tuner label read back
(ckrun.runner.plan.choices.choice_fields). A new kind of pool is one union added here, last
(tests/runner/plan/test_pool_table.py adds one and follows it everywhere)."""
