"""memory.weights: the dtype the parameters are held in.

`bf16` casts every floating parameter to bfloat16 in place (the same Parameter objects, so hooks and
the optimizer built afterwards see them); buffers keep their dtype (RoPE's inverse frequencies,
BatchNorm's statistics), and autocast (precision: bf16) runs the forward as with fp32 weights, only
without casting them. The fp32 policy's `cast_cache` is autocast's (runner/train/step.py's
Precision). The undo casts back to float32, which a later plan on the same model (the estimator's)
needs; in training nothing undoes it, and no float32 copy is kept. Within `copies_kept` (the estimator's
fake model, whose every trace applies the plan again: fake tensors have no values to keep in step), each
parameter's bfloat16 copy is made once and given again, and the undo gives back the data it replaced.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from ..plan.pool_policies import WeightsPolicy
from .blocks import Undo

log = logging.getLogger(__name__)


@dataclass
class KeptCopies:
    """The bfloat16 copies `copies_kept` gives again: per parameter its copy, and the line that says them."""

    copies: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    said: str | None = None


_KEPT: ContextVar[KeptCopies | None] = ContextVar("kept_copies", default=None)


@contextlib.contextmanager
def copies_kept(kept: KeptCopies) -> Iterator[None]:
    """Within: `apply_weights` keeps the copies it makes in `kept` and gives them again (module docstring);
    the estimator's 8B traces made 580 casts each, 3.5 s of its tune."""
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)


def apply_weights(model: nn.Module, policy: WeightsPolicy) -> Undo:
    """Hold `model`'s floating parameters as the policy says; returns the undo."""
    if not policy.holds_bf16:
        if not policy.autocast_cache():
            log.info(policy.describe())
        return lambda: None
    cast = [p for p in model.parameters() if p.is_floating_point() and p.dtype != torch.bfloat16]
    kept = _KEPT.get()
    if kept is not None:
        return _give_kept(cast, policy, kept)
    with torch.no_grad():
        for param in cast:
            param.data = param.data.to(torch.bfloat16)
    log.info("%s: %d parameters, %s", policy.describe(), len(cast), _bytes(cast))

    def undo() -> None:
        with torch.no_grad():
            for param in cast:
                param.data = param.data.float()
    return undo


def _give_kept(cast: list[nn.Parameter], policy: WeightsPolicy, kept: KeptCopies) -> Undo:
    """`apply_weights` within `copies_kept`: each parameter's kept copy (made the first time), and an undo that
    gives back the data it replaced."""
    replaced = []
    with torch.no_grad():
        for param in cast:
            replaced.append(param.data)
            if param not in kept.copies:
                kept.copies[param] = replaced[-1].to(torch.bfloat16)
            param.data = kept.copies[param]
    if kept.said is None:
        kept.said = f"{policy.describe()}: {len(cast)} parameters, {_bytes(cast)}"
    log.info("%s", kept.said)

    def undo() -> None:
        for param, data in zip(cast, replaced, strict=True):
            param.data = data
    return undo


def _bytes(params: list[nn.Parameter]) -> str:
    from ..units import format_bytes

    return format_bytes(sum(p.numel() * p.element_size() for p in params))
