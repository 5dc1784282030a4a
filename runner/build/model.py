"""Build the recipe's model: a transformers class from its config, a torchvision builder, or a
user factory given by import path. Weights come only from local directories."""

from __future__ import annotations

import inspect
import logging
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
        model = model_class.from_pretrained(spec.pretrained, local_files_only=True, **spec.config)
    else:
        model = model_class(config_class(**spec.config))
    if getattr(model.config, "use_cache", False) and "use_cache" not in spec.config:
        # a KV cache serves generation; in training it only holds every layer's keys and values
        model.config.use_cache = False
        log.debug("%s: use_cache off for training (the KV cache would hold every layer's K/V)", spec.name)
    return model


def _build_torchvision(spec: ModelSpec) -> nn.Module:
    import torchvision

    builder = torchvision.models.get_model_builder(spec.name)
    try:
        model = builder(weights=None, **spec.config)
    except (TypeError, ValueError) as err:
        raise BuildError("model.config", f"{spec.name}: {err}") from None
    if spec.pretrained:
        _load_local_state(model, Path(spec.pretrained))
    return model


def _build_python(spec: ModelSpec) -> nn.Module:
    factory = resolve_import_path(spec.name)
    _check_kwargs(factory, spec.config)
    model = factory(**spec.config)
    if spec.pretrained and isinstance(model, nn.Module):
        _load_local_state(model, Path(spec.pretrained))
    return model


def _check_kwargs(factory, given: dict) -> None:
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
    except Exception as err:  # noqa: BLE001 - torch's own error advises weights_only=False: never pass that on
        why = "holds pickled Python objects, not only tensors" if "weights_only" in str(err) else "cannot be read"
        raise BuildError("model.pretrained", f"{path} {why} ({type(err).__name__}); ckrun loads only tensor "
                         "files: save a state_dict or model.safetensors") from None
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
