"""Build the recipe's model: a transformers class from its config, a torchvision builder, or a
user factory given by import path. Weights come from model.pretrained: a local directory, or a Hub
model's snapshot in huggingface_hub's cache (runner/builders/hub.py)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import traceback
from pathlib import Path

import torch
from torch import nn

from ..recipe.recipe import ModelSpec
from .adapters import apply_lora, pretrained_settings
from .contract import adapted_user_model, adopt_user_model
from .experts import settle_experts
from .oom import describe_out_of_memory, is_out_of_memory
from .pretrained import (config_of, from_pretrained, is_checkpoint, load_state, pretrained_directory,
                         refuse_adapter_checkpoint)
from .resolve import BuildError, check_factory, check_kwargs, not_a_module, resolve_import_path, transformers_class
from .user_code import Overdue, UserExit, bounded

log = logging.getLogger(__name__)


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", weights: bool = True) -> nn.Module:
    """The model, its parameters created directly on `device` ("meta" allocates nothing). `weights=False`:
    the shapes alone (estimates, plan checks): model.pretrained's weights are not read, only a
    transformers directory's config.json, which defines the architecture."""
    if not weights:
        return _build_shapes(spec, device)
    builders = {"transformers": _build_transformers, "torchvision": _build_torchvision, "python": _build_python}
    with torch.device(device):
        model = builders[spec.source](spec)
        if not isinstance(model, nn.Module):
            raise BuildError("model.name", not_a_module(spec.name, model))
        if spec.source == "transformers":  # which expert kernel a mixture-of-experts model runs by, logged
            settle_experts(model, spec.config, say=torch.device(device).type != "meta")
        if spec.source == "python":
            model = adopt_user_model(model, spec.name)
        if spec.lora is None:
            return model
        return adapted_user_model(apply_lora(model, spec, say=torch.device(device).type != "meta"), model)


def _build_shapes(spec: ModelSpec, device: str | torch.device) -> nn.Module:
    """The model's modules and shapes (QLoRA's base unquantized: its 4-bit layers are made as weights load)."""
    lora = spec.lora.model_copy(update={"quantize_base": None}) if spec.lora is not None else None
    without_weights = spec.model_copy(update={"pretrained": None, "revision": None, "lora": lora})
    config = config_of(_located(spec, weights=False)) if spec.source == "transformers" else {}
    if config:
        without_weights = without_weights.model_copy(update={"config": {**config, **spec.config}})
    return build_model(without_weights, device)


def _located(spec: ModelSpec, weights: bool = True) -> Path | None:
    try:
        return pretrained_directory(spec, weights)
    except ValueError as err:
        raise BuildError("model.pretrained", str(err)) from None


def _build_transformers(spec: ModelSpec) -> nn.Module:
    model_class = transformers_class(spec.name)
    config_class = model_class.config_class
    directory = _located(spec)
    if directory is not None and not is_checkpoint(directory):
        model = _from_pretrained(model_class, directory, pretrained_settings(spec, torch.get_default_device()))
    else:
        if directory is not None:  # before the build: its config is model.config's alone, maybe the class's default
            _checked(refuse_adapter_checkpoint, directory)
        with _recipe_fault("model.config", f"{spec.name} cannot be built from this config"):
            model = model_class(config_class(**spec.config))
        if directory is not None:  # a training checkpoint holds weights but no config.json
            _load_local_state(model, directory)
    if getattr(model.config, "use_cache", False) and "use_cache" not in spec.config:
        # a KV cache serves generation; in training it only holds every layer's keys and values
        model.config.use_cache = False
        log.debug("%s: use_cache off for training (the KV cache would hold every layer's K/V)", spec.name)
    return model


def _build_torchvision(spec: ModelSpec) -> nn.Module:
    import torchvision

    builder = torchvision.models.get_model_builder(spec.name)
    with _recipe_fault("model.config", spec.name):  # vit_b_16 asserts image_size % patch_size == 0
        model = builder(weights=None, **spec.config)
    if spec.pretrained:
        _load_local_state(model, _located(spec))
    return model


def _build_python(spec: ModelSpec) -> nn.Module:
    try:
        factory = resolve_import_path(spec.name)
    except ValueError as err:
        raise BuildError("model.name", str(err)) from None
    check_factory(factory, spec.name)
    check_kwargs(factory, spec.config)
    try:
        with bounded(f"{spec.name} to build the model"):
            model = factory(**spec.config)
    except Overdue as err:
        raise BuildError("model.name", str(err)) from None
    except (Exception, SystemExit, UserExit) as err:  # the user's code: one line naming it and where it raised
        if is_out_of_memory(err):
            raise _too_large(spec.name, err) from None
        key = next((f"model.config.{k}" for k in spec.config if re.search(rf"\b{re.escape(k)}\b", str(err))), "model.name")
        raise BuildError(key, f"{spec.name} {_raised(err)}{_where_in(err, factory)}; "
                              "fix the factory or its arguments in model.config") from None
    if spec.pretrained and isinstance(model, nn.Module):
        _load_local_state(model, _located(spec))
    return model


def _raised(err: BaseException) -> str:
    if isinstance(err, UserExit):
        return f"called os._exit({err.code})"
    return f"called sys.exit({err.code!r})" if isinstance(err, SystemExit) else f"raised {type(err).__name__}: {err}"


def _where_in(err: Exception, factory) -> str:
    """" (at models.py:12)": the deepest line of the factory's own file the error passed through."""
    try:
        own_file = inspect.getsourcefile(factory)
    except TypeError:
        return ""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == own_file]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def _too_large(what: str, err: BaseException) -> BuildError:
    return BuildError("model.config", f"{what} ran out of memory ({describe_out_of_memory(err)}); make the model smaller")


@contextlib.contextmanager
def _recipe_fault(key: str, what: str):
    """Turn what a library raises while building from the recipe into a BuildError at `key`."""
    try:
        yield
    except BuildError:
        raise
    except Exception as err:
        if is_out_of_memory(err):
            raise _too_large(what, err) from None
        detail = " ".join(str(err).split())
        detail = detail if isinstance(err, ValueError) else f"{type(err).__name__}: {detail}"
        raise BuildError(key, f"{what}: {detail}") from None


def _from_pretrained(model_class, directory: Path, config: dict) -> nn.Module:
    return _checked(from_pretrained, model_class, directory, config)


def _load_local_state(model: nn.Module, directory: Path) -> None:
    """Weights from an export, a checkpoint or a state dict file (never unpickled code)."""
    _checked(load_state, model, directory)


def _checked(read, *args):
    """`read(*args)`, its one-line ValueError about model.pretrained's files a BuildError at that key."""
    try:
        return read(*args)
    except ValueError as err:
        raise BuildError("model.pretrained", str(err)) from None


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once); works on the meta device."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
