"""Build the recipe's model: a transformers class from its config, a torchvision builder, or a
user factory given by import path. Weights come only from local directories."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import traceback
from pathlib import Path

import torch
from torch import nn

from ..problems import InputError, Place, Problem, suggest
from ..recipe import ModelSpec, Task, _transformers_class, resolve_import_path

log = logging.getLogger("ckrun")


class BuildError(ValueError):
    """The model could not be built from the recipe; `key` names the recipe key to change."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key

    def as_input_error(self, source: str) -> InputError:
        return InputError([Problem(Place(source), self.key, str(self))])


def build_model(spec: ModelSpec, device: str | torch.device = "cpu") -> nn.Module:
    """The model, its parameters created directly on `device` ("meta" allocates nothing)."""
    builders = {"transformers": _build_transformers, "torchvision": _build_torchvision, "python": _build_python}
    with torch.device(device):
        model = builders[spec.source](spec)
    if not isinstance(model, nn.Module):
        raise BuildError("model.name", f"{spec.name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _build_transformers(spec: ModelSpec) -> nn.Module:
    model_class = _transformers_class(spec.name)
    config_class = model_class.config_class
    if spec.pretrained:
        with _recipe_fault("model.pretrained", f"transformers cannot load {spec.name} from {spec.pretrained}"):
            model = model_class.from_pretrained(spec.pretrained, local_files_only=True, **spec.config)
    else:
        with _recipe_fault("model.config", f"{spec.name} cannot be built from this config"):
            model = model_class(config_class(**spec.config))
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
        _load_local_state(model, Path(spec.pretrained))
    return model


def _build_python(spec: ModelSpec) -> nn.Module:
    try:
        factory = resolve_import_path(spec.name)
    except ValueError as err:
        raise BuildError("model.name", str(err)) from None
    check_factory(factory, spec.name)
    check_kwargs(factory, spec.config)
    try:
        model = factory(**spec.config)
    except (Exception, SystemExit) as err:  # the user's code: one line naming it and where it raised
        key = next((f"model.config.{k}" for k in spec.config if re.search(rf"\b{re.escape(k)}\b", str(err))), "model.name")
        raise BuildError(key, f"{spec.name} raised {type(err).__name__}: {err}{_where_in(err, factory)}; "
                              "fix the factory or its arguments in model.config") from None
    if spec.pretrained and isinstance(model, nn.Module):
        _load_local_state(model, Path(spec.pretrained))
    return model


def check_factory(factory, name: str) -> None:
    """A BuildError unless `factory` can be called (`math:pi` names a float)."""
    if not callable(factory):
        kind = type(factory).__name__
        raise BuildError("model.name", f"{name} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, not a function or class; "
                                       "name a factory that returns a torch.nn.Module")


def _where_in(err: Exception, factory) -> str:
    """" (at models.py:12)": the deepest line of the factory's own file the error passed through."""
    try:
        own_file = inspect.getsourcefile(factory)
    except TypeError:
        return ""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == own_file]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


@contextlib.contextmanager
def _recipe_fault(key: str, what: str):
    """Turn what a library raises while building from the recipe into a BuildError at `key`. Running
    out of memory is not a recipe fault here: the training loop reports it against the cap."""
    try:
        yield
    except (BuildError, torch.OutOfMemoryError):
        raise
    except Exception as err:
        detail = " ".join(str(err).split())
        detail = detail if isinstance(err, ValueError) else f"{type(err).__name__}: {detail}"
        raise BuildError(key, f"{what}: {detail}") from None


def check_kwargs(factory, given: dict) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: let the call itself complain
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for key in given:
        if key not in params:
            raise BuildError(f"model.config.{key}", f"{getattr(factory, '__name__', factory)} takes no argument {key!r}{suggest(key, params)}")


def _load_local_state(model: nn.Module, directory: Path) -> None:
    """Weights from `directory`: model.safetensors, or a .pt/.pth/.bin state dict (never unpickled code)."""
    candidates = [directory / "model.safetensors", *sorted(directory.glob("*.pt")), *sorted(directory.glob("*.pth")),
                  *sorted(directory.glob("*.bin"))]
    path = next((c for c in candidates if c.is_file()), None)
    if path is None:
        raise BuildError("model.pretrained", f"{directory} holds no model.safetensors or .pt/.pth/.bin state dict")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, corrupt, or pickled code: never suggest weights_only=False
        reason = "it holds more than tensors, and ckrun never unpickles code" if "weights_only" in str(err) \
            else f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'unreadable'}"
        raise BuildError("model.pretrained", f"cannot read {path}: {reason}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise BuildError("model.pretrained", f"{path.name} does not match the model: "
                         f"{len(missing)} missing and {len(unexpected)} unexpected keys (e.g. {(missing or unexpected)[0]})")
    log.info("loaded weights from %s", path)


def infer_task(spec: ModelSpec) -> Task | None:
    """The training task a model class implies, or None when the recipe must say (data.task)."""
    if spec.source == "torchvision":
        return "image_classification"
    if spec.source != "transformers":
        return None
    suffixes = {
        "ForMaskedLM": "masked_lm", "ForCausalLM": "causal_lm", "LMHeadModel": "causal_lm",
        "ForConditionalGeneration": "seq2seq", "ForSequenceClassification": "sequence_classification",
        "ForImageClassification": "image_classification",
    }
    return next((task for suffix, task in suffixes.items() if spec.name.endswith(suffix)), None)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied embeddings counted once); works on the meta device."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
