"""memory.weights: the dtype the parameters are held in.

`bf16` casts every floating parameter to bfloat16 in place (the same Parameter objects, so hooks and
the optimizer built afterwards see them); buffers keep their dtype (RoPE's inverse frequencies,
BatchNorm's statistics), and autocast (precision: bf16) runs the forward as with fp32 weights, only
without casting them. The fp32 policy's `cast_cache` is autocast's (runner/train/step.py's
Precision). The undo casts back to float32, which a later plan on the same model (the estimator's)
needs; in training nothing undoes it, and no float32 copy is kept.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..plan.pool_policies import WeightsPolicy
from .blocks import Undo

log = logging.getLogger(__name__)


def apply_weights(model: nn.Module, policy: WeightsPolicy) -> Undo:
    """Hold `model`'s floating parameters as the policy says; returns the undo."""
    if not policy.holds_bf16:
        if not policy.autocast_cache():
            log.info(policy.describe())
        return lambda: None
    cast = [p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.bfloat16]
    with torch.no_grad():
        for param in cast:
            param.data = param.data.to(torch.bfloat16)
    log.info("%s: %d parameters, %s", policy.describe(), len(cast), _bytes(cast))

    def undo() -> None:
        with torch.no_grad():
            for param in cast:
                param.data = param.data.float()
    return undo


def _bytes(params: list[nn.Parameter]) -> str:
    from ..units import format_bytes

    return format_bytes(sum(p.numel() * p.element_size() for p in params))
