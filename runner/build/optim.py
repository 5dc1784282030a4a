"""Optimizer and learning-rate schedule from the recipe's `train` section."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..recipe import CosineSchedule, TrainSpec

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


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec) -> torch.optim.lr_scheduler.LambdaLR:
    schedule, steps = train.scheduler, train.steps
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
