"""What the estimate does for a model that fake tensors cannot run: a model that trains must estimate.

Two places read tensor values that fake tensors do not have:

- The builder (torchvision's RegNet computes its stage widths with torch and `.tolist()`). The model
  is then built by its own code on real tensors, each parameter moved to the meta device as it is
  registered (so at most one parameter is ever real), and turned into fake CPU tensors after: the
  estimate that follows is the usual one, not an approximation.
- The training step (a model whose forward branches on `.item()`, or takes `nonzero()` shapes). The
  same step then runs on real CPU tensors at the recipe's sizes, the tracker counting live bytes as
  it does on fake ones (`ProbeEstimator`). The bytes are real, but for the stand-in batch's values
  and fresh weights, so the estimate is marked approximate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)

from .estimate import Estimate, EstimateUnavailable, Estimator

READS_VALUES = (DataDependentOutputException, DynamicOutputShapeException)
APPROXIMATE = ("approximate: measured on real CPU tensors (the model reads tensor values, which the fake "
               "tensors of an estimate do not have), with the stand-in batch's values and fresh weights; "
               "a step whose memory depends on those values (routing, masks) may differ")


def build_reading_values(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under the estimator's fake mode; a builder that reads tensor values is run on real
    tensors instead, its parameters kept on the meta device, then made fake CPU tensors."""
    try:
        return build()
    except Exception as err:  # noqa: BLE001 - build_model wraps what it catches; the cause says why
        if not _reads_values(err):
            raise
    with unset_fake_temporarily(), _parameters_on_meta():
        model = build()
    return model.to_empty(device="cpu")  # under the fake mode again: fake tensors, nothing allocated


def _reads_values(err: BaseException | None) -> bool:
    while err is not None:
        if isinstance(err, READS_VALUES):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def _parameters_on_meta():
    register = nn.Module.register_parameter

    def on_meta(module, name, parameter):
        if parameter is not None and parameter.device.type != "meta":
            parameter = type(parameter)(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)
    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


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
        if not _reads_values(err):
            raise
    try:
        return make(ProbeEstimator).estimate()
    except (RuntimeError, NotImplementedError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise EstimateUnavailable(f"the model reads tensor values, and a real CPU step failed too: "
                                  f"{type(err).__name__}: {first}") from None
