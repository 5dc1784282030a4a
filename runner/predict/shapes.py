"""A model and batch built for their shapes under the estimator's fake mode: fake CPU tensors, no
weights read or initialised (`weight_init_skipped`), the batch's values made fake (`batch_to_fake`).

A builder that reads tensor values (torchvision's RegNet computes its stage widths with torch and
`.tolist()`) is run by its own code on real tensors, each parameter moved to the meta device as it
is registered (so at most one parameter is ever real), and turned into fake CPU tensors after: the
estimate that follows is the usual one, not an approximation (fallback.py handles a training step
that reads values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)

from ..builders.data import Batch
from ..builders.model import build_model
from ..recipe.recipe import ModelSpec

CPU = torch.device("cpu")
READS_VALUES = (DataDependentOutputException, DynamicOutputShapeException)


def build_for_shapes(spec: ModelSpec) -> torch.nn.Module:
    """The model with the right shapes (and model.lora's adapters); pretrained weights are not read
    (they change no shape), except a transformers directory's config, which defines the architecture."""
    if spec.lora is not None:  # peft moves its adapters with Module.to, which cannot swap fake parameters
        with unset_fake_temporarily():
            model = build_model(spec, "meta", weights=False)
        return _fake_like(model)
    return build_reading_values(lambda: build_model(spec, CPU, weights=False))


def _fake_like(model: torch.nn.Module) -> torch.nn.Module:
    """`model`'s meta tensors as fake CPU tensors of the active fake mode, each shared one (tied weights)
    made once, requires_grad kept: what building under the mode gives, without moving a fake tensor."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the meta tensor, kept so no id is reused; its fake)

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            empty = torch.empty_like(tensor, device=CPU)
            made[id(tensor)] = tensor, (torch.nn.Parameter(empty, tensor.requires_grad)
                                        if isinstance(tensor, torch.nn.Parameter) else empty)
        return made[id(tensor)][1]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    table[name] = fake(tensor)
    return model


def build_reading_values(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under the estimator's fake mode; a builder that reads tensor values is run on real
    tensors instead, its parameters kept on the meta device, then made fake CPU tensors."""
    try:
        return build()
    except Exception as err:  # noqa: BLE001 - build_model wraps what it catches; the cause says why
        if not reads_values(err):
            raise
    with unset_fake_temporarily(), _parameters_on_meta():
        model = build()
    return model.to_empty(device="cpu")  # under the fake mode again: fake tensors, nothing allocated


def reads_values(err: BaseException | None) -> bool:
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


# --- the batch, and the weights not initialised ---------------------------------------------------


@contextlib.contextmanager
def weight_init_skipped():
    """torch.nn.init's in-place initialisers as no-ops while building: fake weights have no values
    to set, and some (trunc_normal_'s rejection loop) read them, which fake tensors cannot."""
    tables = [vars(torch.nn.init)]
    try:  # transformers 5 keeps its own references to the originals
        from transformers.initialization import TORCH_INIT_FUNCTIONS

        tables.append(TORCH_INIT_FUNCTIONS)
    except ImportError:
        pass
    saved = [(table, name, function) for table in tables for name, function in list(table.items())
             if name.endswith("_") and not name.startswith("_") and callable(function)]
    for table, name, _ in saved:
        table[name] = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        for table, name, function in saved:
            table[name] = function


def batch_to_fake(batch: Batch, fake_mode: FakeTensorMode) -> tuple[Batch, list[torch.Tensor]]:
    """The batch as fake tensors, and the inputs the model is not given.

    An all-ones attention mask is left out of the model's inputs: transformers skips such a mask
    in a real run (so SDPA may use flash attention), but cannot tell it is all ones on fake
    tensors. It still counts as memory, as part of the batch."""
    inputs = dict(batch.inputs)
    dropped = []
    mask = inputs.get("attention_mask")
    if mask is not None and bool(mask.all()):
        dropped.append(inputs.pop("attention_mask"))
    fake = lambda t: fake_mode.from_tensor(t)  # noqa: E731
    positions = None if batch.positions is None else fake(batch.positions)
    return (Batch({k: fake(v) for k, v in inputs.items()}, fake(batch.labels), batch.by_keyword, positions),
            [fake(t) for t in dropped])
