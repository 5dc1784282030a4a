"""Optimizer, learning-rate schedule and run length from the recipe's `train` section."""

from __future__ import annotations

import functools
import inspect
import logging
import math
from fractions import Fraction

import torch
from torch import nn

from ..recipe.recipe import Recipe, TorchOptimizer, TrainSpec
from ..recipe.train import EIGHT_BIT
from .resolve import BuildError

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, train: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    return optimizer_over([p for p in model.parameters() if p.requires_grad], train, device)


def optimizer_over(params: list[torch.Tensor], train: TrainSpec, device: torch.device,
                   fused_on_cpu: bool = False) -> torch.optim.Optimizer:
    """The recipe's optimizer over `params` (a model's trainable parameters, or the host copies of some
    of them: runner/memory/host_optimizer.py); `fused_on_cpu`: torch's fused CPU AdamW, which the host
    side of an optimizer offload runs (a CPU-only run keeps the unfused kernels its baseline uses)."""
    spec = train.optimizer
    if spec.name == "sgd":
        one_by_one = _one_by_one(params, torch.optim.SGD)
        return torch.optim.SGD(decay_groups(params, spec.weight_decay), lr=spec.lr, momentum=spec.momentum,
                               nesterov=spec.nesterov, **one_by_one)
    if spec.name == "adamw":
        one_by_one = _one_by_one(params, torch.optim.AdamW)
        fused = (device.type == "cuda" or fused_on_cpu) and not one_by_one
        log.debug("AdamW %s: %s", "fused" if fused else "foreach", "fused kernels need CUDA" if not fused else "on CUDA")
        return torch.optim.AdamW(decay_groups(params, spec.weight_decay), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                 **(one_by_one or {"fused": fused or None}))
    if spec.name in EIGHT_BIT:
        import bitsandbytes

        optimizer_class = getattr(bitsandbytes.optim, EIGHT_BIT[spec.name])
        return optimizer_class(decay_groups(params, spec.weight_decay), lr=spec.lr, betas=spec.betas, eps=spec.eps)
    return _torch_optimizer(spec, params)


def _one_by_one(params: list[torch.Tensor], optimizer_class: type) -> dict:
    """foreach and fused off, where `optimizer_class` takes them, for parameters that mix DTensors with plain
    tensors (tensor parallelism alone splits some layers and leaves the norms and embeddings whole): DTensor
    refuses plain operands, so no fused or foreach kernel takes both, and torch's default picks foreach on
    CUDA. {} otherwise."""
    if len({getattr(p, "device_mesh", None) is None for p in params}) < 2:  # a DTensor has its mesh (grad_norm.py)
        return {}
    takes = inspect.signature(optimizer_class.__init__).parameters
    log.info("%s steps parameter by parameter (no fused or foreach kernel): tensor parallelism's split layers are "
             "DTensors beside plain tensors, and one kernel cannot take both", optimizer_class.__name__)
    return {option: False for option in ("foreach", "fused") if option in takes}


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    # Decay matrices only: decaying biases and norm gains hurts and is what nanoGPT/HF avoid too.
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _torch_optimizer(spec: TorchOptimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """torch.optim.NAME with the recipe's arguments; its weight decay (given, or the class's default)
    on matrices only. A refusal only real parameters show (Muon takes matrices only) is one line."""
    optimizer_class = getattr(torch.optim, spec.name)
    arguments = spec.arguments()
    decay = inspect.signature(optimizer_class.__init__).parameters.get("weight_decay")
    groups = params if decay is None else decay_groups(params, arguments.pop("weight_decay", decay.default))
    try:
        return optimizer_class(groups, **arguments, **_one_by_one(params, optimizer_class))
    except (ValueError, TypeError, RuntimeError) as err:
        raise BuildError("train.optimizer.name", f"torch.optim.{spec.name} cannot train this model: "
                         f"{' '.join(str(err).split())[:200]}") from None


def total_steps(recipe: Recipe, data) -> int:
    """train.steps, or the steps train.epochs takes over the built data: ceil(epochs * rows / batch_size)."""
    train = recipe.train
    if train.epochs is None:
        return train.steps
    rows = getattr(data, "rows", None)  # finite sources say how many samples an epoch holds
    if rows is None:
        raise BuildError("train.epochs", f"data.source {recipe.data.source} has no fixed number of rows, so no "
                         "epochs; give train.steps")
    # the decimal the user wrote, exactly: 0.7 epochs of 10 rows at batch 1 is 7 steps, not 8
    steps = max(1, math.ceil(Fraction(repr(train.epochs)) * rows / train.batch_size))
    log.info("steps %d: %s epoch%s of %d rows at batch %d", steps, f"{train.epochs:g}", "" if train.epochs == 1 else "s",
             rows, train.batch_size)
    return steps


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The Trainer's schedules: `constant` and `cosine` by transformers' own formulas (written here, since
    importing transformers.optimization pulls in the Trainer's helpers and peft: seconds, for any
    model; tests/runner/builders/test_optim.py holds them equal to transformers' functions), the
    rest from transformers' get_scheduler. `steps`: the run's length, which a decaying schedule decays over."""
    schedule = train.scheduler
    warmup = schedule.warmup(steps)
    if schedule.warmup_ratio is not None:
        log.info("warm-up: %d steps (train.scheduler.warmup_ratio %g of %d steps, rounded up)", warmup,
                 schedule.warmup_ratio, steps)
    if warmup >= steps > 0:
        key = "warmup_ratio" if schedule.warmup_ratio is not None else "warmup_steps"
        log.warning("train.scheduler.%s: the warm-up (%d steps) is as long as the run's %d steps or longer, so the "
                    "learning rate rises the whole run and its last step takes %.0f%% of train.optimizer.lr; shorten "
                    "the warm-up (warmup_ratio: 0.05 takes a share of the run) or train longer", key, warmup, steps,
                    100 * (steps - 1) / warmup)
    if schedule.name in ("constant", "cosine"):
        floor = getattr(schedule, "min_lr_ratio", 0.0)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
            _transformers_factor, warmup=warmup, steps=steps, floor=floor, decays=schedule.name == "cosine"))
    return _transformers_schedule(optimizer, schedule, warmup, steps)


def _transformers_factor(step: int, *, warmup: int, steps: int, floor: float, decays: bool) -> float:
    """transformers' get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup and
    get_cosine_with_min_lr_schedule_with_warmup (num_cycles 0.5, min_lr_rate `floor`), operation for
    operation: the warm-up rises from 0 (the first step's rate is 0), then holds or follows half a cosine."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if not decays:
        return 1.0
    progress = float(step - warmup) / float(max(1, steps - warmup))
    factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
    factor = factor * (1 - floor) + floor
    return max(0, factor)


def _transformers_schedule(optimizer: torch.optim.Optimizer, schedule, warmup: int,
                           steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' get_scheduler, the Trainer's own schedules and not a copy of their formulas."""
    from transformers import get_scheduler

    decay = getattr(schedule, "decay_steps", 0)
    if decay and warmup + decay > steps:  # the stable phase would be negative
        raise BuildError("train.scheduler.decay_steps", f"warm-up ({warmup}) and decay ({decay}) steps "
                         f"are more than the run's {steps} steps; shorten them or train longer")
    kwargs = {theirs: getattr(schedule, ours) for ours, theirs in _SCHEDULE_ARGUMENTS.get(schedule.name, {}).items()}
    try:
        return get_scheduler(schedule.name, optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                             scheduler_specific_kwargs=kwargs)
    except ValueError as err:  # polynomial: end_lr above the optimizer's rate
        raise BuildError("train.scheduler", f"{schedule.name}: {' '.join(str(err).split())[:200]}") from None


# the recipe's names for transformers' scheduler arguments
_SCHEDULE_ARGUMENTS = {"polynomial": {"power": "power", "end_lr": "lr_end"}, "cosine_with_restarts": {"cycles": "num_cycles"},
                       "warmup_stable_decay": {"decay_steps": "num_decay_steps", "decay_type": "decay_type",
                                               "min_lr_ratio": "min_lr_ratio"}}
