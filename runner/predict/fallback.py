"""What the estimate does for a model that fake tensors cannot run: a model that trains must estimate.

Two places read tensor values that fake tensors do not have:

- The builder (torchvision's RegNet computes its stage widths with torch and `.tolist()`): shapes.py
  builds such a model on real tensors, its parameters on meta, and the estimate is the usual one.
- The training step (a model whose forward branches on `.item()`, or takes `nonzero()` shapes). The
  same step then runs on real CPU tensors at the recipe's sizes, the tracker counting live bytes as
  it does on fake ones (`ProbeEstimator`). The bytes are real, but for the stand-in batch's values
  and fresh weights, so the estimate is marked approximate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .estimate import Estimate, EstimateUnavailable, Estimator
from .shapes import reads_values

APPROXIMATE = ("approximate: measured on real CPU tensors (the model reads tensor values, which the fake "
               "tensors of an estimate do not have), with the stand-in batch's values and fresh weights; "
               "a step whose memory depends on those values (routing, masks) may differ")


class _RealTensors:
    """Stands in for the estimator's FakeTensorMode: tensors stay real."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def from_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class ProbeEstimator(Estimator):
    """The estimator's own step (plan, micro-batches, tracker, CUDA modelling) on real CPU tensors."""

    fake_mode = property(lambda self: _RealTensors(), lambda self, value: None)

    def _prepare(self, model: nn.Module) -> nn.Module:
        with torch.no_grad():  # built with the initialisers off: give the weights finite values
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.02)
        return super()._prepare(model)

    def estimate(self, *args, **kwargs) -> Estimate:
        estimate = super().estimate(*args, **kwargs)
        estimate.notes.insert(0, APPROXIMATE)
        return estimate


def estimate_or_probe(make: Callable[[type[Estimator]], Estimator]) -> Estimate:
    """`make(Estimator).estimate()`; where fake tensors cannot run the step, the real probe's."""
    try:
        return make(Estimator).estimate()
    except EstimateUnavailable as err:
        if not reads_values(err):
            raise
    try:
        return make(ProbeEstimator).estimate()
    except (RuntimeError, NotImplementedError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise EstimateUnavailable(f"the model reads tensor values, and a real CPU step failed too: "
                                  f"{type(err).__name__}: {first}") from None
