"""The recipe's optimizer and learning-rate schedule (`train.optimizer`, `train.scheduler`).

`adamw` and `sgd` are ckrun's own settings (fused AdamW on CUDA); any other `torch.optim` class
is named as torch spells it, its arguments written beside the name as in torchtune's configs,
and checked against the class when the recipe is validated. 8-bit and paged AdamW come from
bitsandbytes when it is installed. Every schedule is transformers' own (`get_scheduler`), so a
recipe's `cosine` and `linear` are the Trainer's, warm-up included (linear from 0: the first step's
rate is 0), and `warmup_ratio` is the Trainer's too.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ..plan.choices import Strict
from ..problems import KeyedError, suggest

_Beta = Annotated[float, Field(ge=0, lt=1)]  # as torch.optim.AdamW demands


def _pair(betas):
    return tuple(betas) if isinstance(betas, list) else betas  # YAML has lists, not tuples


class AdamW(Strict):
    name: Literal["adamw"]
    """AdamW, fused on CUDA; weight decay applies to matrices only (not biases or norm gains)."""
    lr: float = Field(default=1e-4, gt=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)
    """Adam's decay rates for the first and second moments, written `[0.9, 0.95]` in YAML."""

    _list_as_pair = field_validator("betas", mode="before")(_pair)
    weight_decay: float = Field(default=0.01, ge=0)
    eps: float = Field(default=1e-8, gt=0)


class SGD(Strict):
    name: Literal["sgd"]
    lr: float = Field(default=0.1, gt=0)
    momentum: float = Field(default=0.9, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    nesterov: bool = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGD:
        if self.nesterov and self.momentum <= 0:  # torch.optim.SGD refuses it when built
            raise KeyedError(("train", "optimizer", "nesterov"), "nesterov needs a momentum above 0; "
                                  "set train.optimizer.momentum or nesterov: false")
        return self


# torch.optim's optimizers (torch 2.11 to 2.15), less LBFGS (its step needs a closure that re-runs
# the forward) and SparseAdam (sparse gradients only). A test keeps the list equal to torch's.
TORCH_OPTIMIZERS = ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam", "RAdam",
                    "RMSprop", "Rprop", "SGD")


class TorchOptimizer(Strict):
    """Any torch.optim optimizer, by its class name, with its keyword arguments beside the name:
    `{name: RAdam, lr: 3e-4, betas: [0.9, 0.99], decoupled_weight_decay: true}`."""

    model_config = ConfigDict(extra="allow")  # the class's arguments: checked against its signature below
    name: Literal[TORCH_OPTIMIZERS]
    """A torch.optim class as torch spells it (Adam, RAdam, NAdam, Adagrad, RMSprop, Adafactor, ...)."""
    lr: float | None = Field(default=None, gt=0)
    """The learning rate; unset: the class's own default. `weight_decay`, when the class takes it,
    applies to matrices only, as for adamw."""

    @model_validator(mode="after")
    def _arguments_fit(self) -> TorchOptimizer:
        check_torch_arguments(self.name, self.arguments())
        return self

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments for the class: lr when given and everything written beside the name
        (lists as tuples, as torch's betas and etas are)."""
        given = {key: _pair(value) for key, value in (self.model_extra or {}).items()}
        return {**({"lr": self.lr} if self.lr is not None else {}), **given}


def check_torch_arguments(name: str, arguments: dict[str, Any]) -> None:
    """Each argument is one torch.optim.NAME takes, and the class accepts their values (built once
    on a one-element parameter, which costs nothing)."""
    import torch

    optimizer_class = getattr(torch.optim, name, None)
    if optimizer_class is None:
        raise KeyedError(("train", "optimizer", "name"), f"torch {torch.__version__} has no torch.optim.{name}; "
                              "upgrade torch or choose another optimizer")
    known = [p for p in inspect.signature(optimizer_class.__init__).parameters if p not in ("self", "params")]
    for key in arguments:
        if key not in known:
            raise KeyedError(("train", "optimizer", key), f"torch.optim.{name} takes no argument {key!r}"
                                  f"{suggest(key, known)}; it takes {', '.join(known)}")
    try:
        optimizer_class([torch.zeros(2, 2, requires_grad=True)], **arguments)
    except (ValueError, TypeError, RuntimeError) as err:
        raise KeyedError(("train", "optimizer"), f"torch.optim.{name} refuses these arguments: "
                              f"{' '.join(str(err).split())[:200]}") from None


EIGHT_BIT = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw": "PagedAdamW"}


class EightBitAdamW(AdamW):
    name: Literal["adamw_8bit", "paged_adamw_8bit", "paged_adamw"]
    """bitsandbytes' AdamW, with adamw's settings: `adamw_8bit` keeps both moments in 8 bits (a quarter
    of adamw's state memory), `paged_adamw_8bit` / `paged_adamw` page the state to host memory under
    pressure (CUDA). Needs `pip install bitsandbytes`."""

    @field_validator("name")
    @classmethod
    def _library_installed(cls, name: str) -> str:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"{name} needs the bitsandbytes package, which is not installed: pip install "
                             "bitsandbytes (or choose adamw)")
        return name


Optimizer = Annotated[AdamW | SGD | EightBitAdamW | TorchOptimizer, Field(discriminator="name")]


# --- learning-rate schedules ------------------------------------------------------------------


HFWarmup = Annotated[int, Field(ge=0, description="Steps of linear warm-up from 0, as transformers counts them "
                                                   "(the first step's rate is 0).")]


class _Warmup(Strict):
    """What every schedule shares: its name and its warm-up, in steps or as a share of the run."""

    name: str
    warmup_steps: HFWarmup = 0
    warmup_ratio: float | None = Field(default=None, ge=0, le=1)
    """The warm-up as a fraction of the run's steps (rounded up, as the Trainer's warmup_ratio); instead
    of warmup_steps."""

    @model_validator(mode="after")
    def _one_warmup(self):
        if self.warmup_ratio is not None and self.warmup_steps:
            raise KeyedError(("train", "scheduler", "warmup_ratio"), "give train.scheduler.warmup_steps or "
                             "train.scheduler.warmup_ratio, not both")
        return self

    def warmup(self, steps: int) -> int:
        """Warm-up steps in a run of `steps`."""
        return math.ceil(self.warmup_ratio * steps) if self.warmup_ratio is not None else self.warmup_steps


class ConstantSchedule(_Warmup):
    name: Literal["constant"] = "constant"
    """transformers' `constant` (`constant_with_warmup` with a warm-up): the rate held after the warm-up."""


class CosineSchedule(_Warmup):
    name: Literal["cosine"]
    """transformers' `cosine` (`cosine_with_min_lr` with min_lr_ratio): warm-up, then half a cosine down."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """The final learning rate as a fraction of the peak."""


class LinearSchedule(_Warmup):
    name: Literal["linear"]
    """transformers' `linear` (the Trainer's default): warm-up, then a straight line to 0 at the last step."""


class PolynomialSchedule(_Warmup):
    name: Literal["polynomial"]
    """transformers' `polynomial`: warm-up, then (1 - progress) ** power from the peak down to end_lr."""
    power: float = Field(default=1.0, gt=0)
    """1 is a straight line; 2 falls fast, then levels out."""
    end_lr: float = Field(default=1e-7, ge=0)
    """The rate at the last step (absolute, below train.optimizer.lr)."""


class CosineRestartsSchedule(_Warmup):
    name: Literal["cosine_with_restarts"]
    """transformers' `cosine_with_restarts`: warm-up, then `cycles` cosine decays to 0, each restarting at the peak."""
    cycles: int = Field(default=1, gt=0)
    """How many decays (hard restarts) the steps after warm-up are cut into."""


class WarmupStableDecaySchedule(_Warmup):
    name: Literal["warmup_stable_decay"]
    """transformers' `warmup_stable_decay` (WSD): warm-up, the peak rate held, then a decay over the
    last `decay_steps` steps."""
    decay_steps: int = Field(gt=0)
    """Steps of the final decay; the stable phase is whatever the run's steps leave between."""
    decay_type: Literal["cosine", "linear", "1-sqrt"] = "cosine"
    """The decay's shape."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """The final rate as a fraction of the peak."""


Schedule = Annotated[ConstantSchedule | CosineSchedule | LinearSchedule | PolynomialSchedule | CosineRestartsSchedule
                     | WarmupStableDecaySchedule, Field(discriminator="name")]
