"""How far a lossy plan (memory.compression) moves the gradient: measured, never assumed.

On one micro-batch, the gradients of every parameter are computed twice from the same weights and the
same RNG state (dropout draws the same masks): once with the plan as applied, once with the
compression hooks switched off, which is the exact plan. The error is the relative L2 norm over
all parameter gradients together, ||g_lossy - g_exact|| / ||g_exact||. Nothing of the training
changes: gradients are cleared, and the RNG and the buffers (BatchNorm's running statistics) are
put back as they were.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ...builders.data import Batch
from ...memory.chunked_loss import SplitHead
from ...memory.compress import ActivationCompression
from ..checkpoint.store import restore_rng_state, rng_state
from ..step import Precision, label_count, micro_batch_loss

log = logging.getLogger(__name__)


def gradient_error(model: nn.Module, compression: ActivationCompression, batch: Batch, micro_batch: int,
                   precision: Precision, device: torch.device, head: SplitHead | None = None) -> float:
    """The relative L2 error of the gradients on `batch` that `compression` causes (`head`: the loss's
    split head, memory.loss chunked, as the step computes it)."""
    state, buffers = rng_state(device), {name: b.clone() for name, b in model.named_buffers()}
    try:
        lossy = _gradients(model, batch, micro_batch, precision, head)
        restore_rng_state(state, device)
        with _switched_off(compression):
            exact = _gradients(model, batch, micro_batch, precision, head)
    finally:
        restore_rng_state(state, device)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        model.zero_grad(set_to_none=True)
    difference = sum(float((a.double() - b.double()).square().sum()) for a, b in zip(lossy, exact, strict=True))
    norm = sum(float(b.double().square().sum()) for b in exact)
    return (difference / norm) ** 0.5 if norm > 0 else float(difference > 0)


def _gradients(model: nn.Module, batch: Batch, micro_batch: int, precision: Precision,
               head: SplitHead | None) -> list[torch.Tensor]:
    """Every parameter's gradient of the step's loss on `batch` (zeros where a parameter gets none)."""
    model.zero_grad(set_to_none=True)
    total = label_count(batch.labels)
    for start in range(0, len(batch.labels), micro_batch):
        micro = batch.slice(start, start + micro_batch)
        (micro_batch_loss(model, micro, precision, head) / total).backward()
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def _switched_off(compression: ActivationCompression):
    compression.enabled = False
    try:
        yield
    finally:
        compression.enabled = True


def report_gradient_error(error: float, policy: str) -> str:
    return (f"memory.compression {policy} is lossy: relative gradient error {error:.2e} against the exact plan "
            "(L2 over all parameter gradients, one micro-batch)")
