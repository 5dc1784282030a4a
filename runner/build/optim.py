"""Optimizer, learning-rate schedule and run length from the recipe's `train` section."""

from __future__ import annotations

import logging
import math
from fractions import Fraction

import torch
from torch import nn

from ..recipe import CosineSchedule, Recipe, TrainSpec
from .resolve import BuildError

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, train: TrainSpec, device: torch.device) -> torch.optim.Optimizer:
    # Decay matrices only: decaying biases and norm gains hurts and is what nanoGPT/HF avoid too.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train.optimizer.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    spec = train.optimizer
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)
    fused = device.type == "cuda"
    log.debug("AdamW %s: %s", "fused" if fused else "foreach", "fused kernels need CUDA" if not fused else "on CUDA")
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, fused=fused or None)


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
    """`steps`: the run's length (total_steps), which a cosine schedule decays over."""
    schedule = train.scheduler
    warmup = schedule.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)  # never exactly 0: a zero first step wastes a batch
        if not isinstance(schedule, CosineSchedule):
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        floor = schedule.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
