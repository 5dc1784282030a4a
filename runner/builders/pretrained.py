"""What `model.pretrained` may name, and how its weights get into a built model.

A Hub name (`org/name`, at model.revision) is found in huggingface_hub's cache, and fetched into it
where the Hub is reachable (runner/builders/hub.py); its snapshot directory is then read as any
save_pretrained output is. Three kinds of local directory hold weights ckrun can start from:
- an export, `OUTPUT_DIR/model` (written at the end of every run): transformers `save_pretrained`
  output (config.json + model.safetensors), or for torchvision and python models a
  model.safetensors state dict; either way with the run's resolved recipe.yaml beside it;
- a training checkpoint, `OUTPUT_DIR/checkpoints/step-N`: its model weights are taken, the
  optimizer state is left behind;
- any other directory of local weights: transformers `save_pretrained` output, or a
  model.safetensors / .pt / .pth / .bin state dict (loaded with weights_only: never pickled code).

`check_pretrained_dir` runs when the recipe is validated, so `ckrun validate` already says when a
directory cannot fit the recipe's model; anything it cannot tell before building (tensor shapes)
is reported by `load_state` as one line naming model.pretrained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from ..disk.checkpoint_files import MARKER, STATE_FILE, load_checkpoint
from ..problems import first_line
from .hub import hub_name, locate
from .weight_files import check_weight_files, state_dict_file

log = logging.getLogger(__name__)

EXPORT_RECIPE = "recipe.yaml"  # the resolved recipe an export carries beside its weights
WEIGHTS = "model.safetensors"
LORA_CHECKPOINT = ("is a LoRA run's checkpoint, which holds the adapter and not the model it adapts; continue that "
                   "run with --resume, or start from its merged export (model.lora.export_merged: true)")
ADAPTER_CONFIG = "adapter_config.json"  # peft's: a LoRA adapter, not a model
TRAINABLE_ONLY = "trainable_only"  # a checkpoint's mark: its model state holds what trains, not the frozen base
FRESH = "_ckrun_fresh_weights"  # on a model from_pretrained built: the weights its directory lacked, made fresh


def pretrained_directory(spec, weights: bool = True) -> Path | None:
    """Where model.pretrained's files are: the local directory it names, or a Hub model's snapshot in the
    cache; None without model.pretrained. `weights=False`: a transformers model's config is all the
    caller reads (the checks before training), so a Hub model's weights are not fetched for it."""
    if not spec.pretrained:
        return None
    repo = hub_name(spec.pretrained)
    if repo is None:
        return Path(spec.pretrained).expanduser()
    return locate(repo, spec.revision, weights=weights or spec.source != "transformers")


def config_of(directory: Path | None) -> dict:
    """The config.json of save_pretrained output as a dict ({} for a checkpoint or a state dict): the
    architecture a transformers model is built with before model.config's keys change it."""
    path = directory / "config.json" if directory is not None else None
    if path is None or is_checkpoint(directory) or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return {}  # check_pretrained_dir says so in its own line
    return config if isinstance(config, dict) else {}


def is_checkpoint(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file() and (directory / MARKER).is_file()


def exported_from(directory: Path) -> tuple[str, str] | None:
    """(model.source, model.name) of the run that exported `directory`; None when it is no export."""
    path = directory / EXPORT_RECIPE
    if not path.is_file():
        return None
    import yaml

    try:
        model = yaml.safe_load(path.read_text(encoding="utf-8"))["model"]
        return str(model["source"]), str(model["name"])
    except (yaml.YAMLError, TypeError, KeyError, UnicodeDecodeError):
        return None  # not one of ours: judge the directory by its weights alone


def check_pretrained_dir(directory: Path, source: str | None, name: str | None) -> None:
    """A one-line ValueError when `directory` cannot hold weights for this model, or a weight file it
    holds cannot be read (read as far as its header: runner/builders/weight_files.py)."""
    if not directory.is_dir():
        raise ValueError(f"no local directory {str(directory)!r}; give a directory holding the weights, "
                         "e.g. a finished run's OUTPUT_DIR/model")
    if is_checkpoint(directory):
        refuse_adapter_checkpoint(directory)
        return
    if (directory / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{directory} holds a LoRA adapter, not a model; start from its base model with the same "
                         "model.lora, or from the merged model a run exports with model.lora.export_merged: true")
    exported = exported_from(directory)
    # a transformers export may start another class of its architecture (a classifier from a masked
    # LM: the config's model_type decides); a user factory may have moved; torchvision names fix the shapes
    if exported is not None and source is not None and (exported[0] != source or
                                                         (source == "torchvision" and exported[1] != name)):
        raise ValueError(f"{directory} was exported from {exported[0]} model {exported[1]}, but this recipe builds "
                         f"{source} model {name}; set model.source and model.name to match it")
    if source == "transformers":
        _check_transformers_dir(directory, name)
    elif state_dict_file(directory) is None:
        raise ValueError(f"{directory} holds no {WEIGHTS} or .pt/.pth/.bin state dict; give a run's OUTPUT_DIR/model "
                         "or OUTPUT_DIR/checkpoints/step-N")
    check_weight_files(directory, source == "transformers")


def refuse_adapter_checkpoint(checkpoint: Path) -> None:
    """A LoRA run's checkpoint holds the adapter alone: refused before a model is built for it (a recipe
    without model.config would build its class's default config, a 7B Llama, only to find that out). Its
    pickle is read with the tensors memory-mapped; one that cannot be read is left to the load to say."""
    try:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - damaged: load_checkpoint checks its digest and says which way
        return
    if isinstance(state, dict) and state.get(TRAINABLE_ONLY):
        raise ValueError(f"{checkpoint} {LORA_CHECKPOINT}")


def _check_transformers_dir(directory: Path, name: str | None) -> None:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} holds no config.json; give a directory written by save_pretrained "
                         "(a run's OUTPUT_DIR/model) or a checkpoint OUTPUT_DIR/checkpoints/step-N")
    try:
        model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"{config_path} is not a JSON config") from None
    wanted = _config_model_type(name)
    if model_type and wanted and model_type != wanted:
        raise ValueError(f"{directory} holds a {model_type!r} model, but {name} needs {wanted!r} weights; "
                         "point model.pretrained at weights of this architecture")


def _config_model_type(name: str | None) -> str | None:
    import transformers

    model_class = getattr(transformers, name or "", None)
    return getattr(getattr(model_class, "config_class", None), "model_type", None) or None


def read_state(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The model weights a directory holds, and the file they came from; a one-line ValueError
    when they cannot be read (never torch's advice to load with weights_only=False)."""
    if is_checkpoint(directory):  # checked against the digest its marker recorded
        state = load_checkpoint(directory, torch.device("cpu"))
        if state.get(TRAINABLE_ONLY):
            raise ValueError(f"{directory} {LORA_CHECKPOINT}")
        return state["model"], directory / STATE_FILE
    path = state_dict_file(directory)
    if path is None:
        raise ValueError(f"{directory} holds no {WEIGHTS} or .pt/.pth/.bin state dict")
    check_weight_files(directory, transformers=False)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path)), path
        return torch.load(path, map_location="cpu", weights_only=True), path
    except Exception as err:  # noqa: BLE001 - read past a sound header: torch's own error advises weights_only=False
        raise ValueError(f"{path} cannot be read ({type(err).__name__}: {first_line(err, 120)}); save or copy the "
                         "weights again") from None


def load_state(model: nn.Module, directory: Path) -> None:
    """Copy the directory's weights into `model`; a one-line ValueError when they do not fit it."""
    state, path = read_state(directory)
    _restore_tied(model, state)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes that differ: torch lists them all on many lines
        first = next((line.strip() for line in str(err).splitlines()[1:] if line.strip()), str(err))
        raise ValueError(f"{path} does not fit the model: {first}") from None
    if missing or unexpected:
        raise ValueError(f"{path} does not fit the model: {len(missing)} missing and {len(unexpected)} unexpected "
                         f"keys (e.g. {(missing or unexpected)[0]})")
    log.info("loaded weights from %s", path)


def from_pretrained(model_class, directory: Path, config: dict) -> nn.Module:
    """`model_class.from_pretrained` on a local directory, its report table and progress bar kept
    quiet: weights whose shape differs from the model are a one-line ValueError, weights the
    directory lacks (a new head on a base model) are initialised fresh and logged."""
    from transformers.utils import logging as transformers_logging

    check_weight_files(directory, transformers=True)  # transformers' own errors would be a traceback's
    verbosity, bar = transformers_logging.get_verbosity(), transformers_logging.is_progress_bar_enabled()
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    try:
        model, info = model_class.from_pretrained(str(directory), local_files_only=True, ignore_mismatched_sizes=True,
                                                  output_loading_info=True, **config)
    except (OSError, ValueError, RuntimeError) as err:  # an unreadable or foreign file
        raise ValueError(f"{directory}: {first_line(err)}") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bar:
            transformers_logging.enable_progress_bar()
    _report_loading(directory, info)
    model.__dict__[FRESH] = sorted(info.get("missing_keys") or [])  # model.lora warns of the frozen ones
    return model


def _report_loading(directory: Path, info: dict) -> None:
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        key, stored, wanted = mismatched[0]
        raise ValueError(f"{directory} does not fit the model: {len(mismatched)} tensors differ in shape, e.g. {key} is "
                         f"{list(stored)} there and {list(wanted)} in the model; make model.config match its config.json")
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    if missing:
        log.info("%d weights are not in %s and start fresh (e.g. %s)", len(missing), directory, missing[0])
    if unexpected:
        log.info("%d weights in %s are not used by the model (e.g. %s)", len(unexpected), directory, unexpected[0])
    log.info("loaded weights from %s", directory)


def _restore_tied(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """safetensors keeps one name of tensors that share memory (tied weights): give the others back."""
    for names in _shared_names(model):
        present = next((n for n in names if n in state), None)
        for other in names:
            if present is not None and other not in state:
                state[other] = state[present]


def _shared_names(model: nn.Module) -> list[list[str]]:
    by_storage: dict[tuple, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if tensor.device.type != "meta" and tensor.numel():
            by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.dtype, tensor.shape), []).append(key)
    return [names for names in by_storage.values() if len(names) > 1]
