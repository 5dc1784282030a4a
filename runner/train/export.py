"""The end of a run: the final training state as a checkpoint, and the model exported for use.

`finish_run` is the loop's one end-of-run call, made after the last step and after a stop
request (once the step in flight has finished), so a run never ends without its weights:
- `OUTPUT_DIR/checkpoints/step-N` holds the full training state of the last step, whatever
  `output.checkpoint_every` is, so `--resume` with more `train.steps` continues from it;
- `OUTPUT_DIR/model/` holds the model alone: `save_pretrained` output (config.json +
  model.safetensors) for transformers models, a model.safetensors state dict for torchvision and
  python models, and beside either the run's resolved recipe.yaml (and its tokenizer, when the
  data had one), so that `model.pretrained: OUTPUT_DIR/model` rebuilds exactly this model.
- under model.lora, `OUTPUT_DIR/adapter/` holds the adapter as `PeftModel.save_pretrained` writes it
  (adapter_config.json + adapter_model.safetensors: `PeftModel.from_pretrained(base, DIR)` loads it),
  and `OUTPUT_DIR/model/` the merged model when model.lora.export_merged asks for it.
The export is written to a temporary directory and renamed into place: a reader never sees half.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from torch import nn

from ..builders.pretrained import EXPORT_RECIPE, WEIGHTS
from ..files import os_errors_kept
from ..recipe import Recipe
from ..yamlio import dump_yaml
from .checkpoint import checkpoint_dir, complete_checkpoints, save_checkpoint
from .ranked import full_weights, save_state
from .dcp_checkpoint import finish_saving

log = logging.getLogger(__name__)

MODEL_DIR = "model"
ADAPTER_DIR = "adapter"


def finish_run(trainer, out_dir: Path) -> Path:
    """Save the trainer's state as the final checkpoint and export its model; returns the export."""
    save_final_checkpoint(trainer, out_dir / "checkpoints")
    weights = full_weights(trainer)  # FSDP: gathered on rank 0, a collective every rank joins
    if not trainer.ranks.is_main:
        return out_dir / MODEL_DIR
    if trainer.recipe.model.lora is not None:
        return _export_adapted(trainer, out_dir, weights)
    exported = export_model(trainer.model, trainer.recipe, out_dir / MODEL_DIR, trainer.step, weights)
    log.info("model exported to %s (start another run from it with model.pretrained=%s)", exported, exported)
    return exported


def _export_adapted(trainer, out_dir: Path, weights: dict | None) -> Path:
    """The adapter, then (model.lora.export_merged) the model with it merged in, as the run's last use of it."""
    recipe = trainer.recipe
    adapter = export_model(trainer.model, recipe, out_dir / ADAPTER_DIR, trainer.step, weights)
    log.info("LoRA adapter exported to %s (peft.PeftModel.from_pretrained(base, %s) loads it)", adapter, adapter)
    if not recipe.model.lora.export_merged:
        return adapter
    from ..builders.adapters import merged

    plain = recipe.model_copy(update={"model": recipe.model.model_copy(update={"lora": None})})
    exported = export_model(merged(trainer.model), plain, out_dir / MODEL_DIR, trainer.step)
    log.info("merged model exported to %s (start another run from it with model.pretrained=%s)", exported, exported)
    return exported


def save_final_checkpoint(trainer, root: Path) -> Path:
    """The last step's training state, unless output.checkpoint_every already saved that step; complete
    on return (a save still in flight is finished first)."""
    finish_saving(trainer)
    final = checkpoint_dir(root, trainer.step)
    if final in complete_checkpoints(root):
        return final
    log.info("saving the final training state (step %d) to %s", trainer.step, final)
    return save_state(trainer, root, save_checkpoint, wait=True)


def export_model(model: nn.Module, recipe: Recipe, directory: Path, step: int, weights: dict | None = None) -> Path:
    """Write `model` as a loadable directory, replacing any earlier export there; `weights`, when
    given, is its whole state dict (a sharded model's own holds only this rank's shards)."""
    temporary = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        _write_weights(model, recipe, temporary, weights)
        _write_tokenizer(recipe, temporary)
        header = (f"# exported by ckrun after step {step}: the recipe that trained these weights.\n"
                  f"# start a run from them with model.pretrained={directory}\n" if recipe.model.lora is None else
                  f"# exported by ckrun after step {step}: the recipe that trained this LoRA adapter.\n"
                  f"# load it onto its base with peft.PeftModel.from_pretrained(base, \"{directory}\")\n")
        (temporary / EXPORT_RECIPE).write_text(header + dump_yaml(recipe.model_dump(mode="json")), encoding="utf-8")
        _replace(directory, temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return directory


def _write_weights(model: nn.Module, recipe: Recipe, directory: Path, weights: dict | None) -> None:
    with os_errors_kept():  # safetensors says "os error 27" in its own exception
        _write_weight_files(model, recipe, directory, weights)


def _write_weight_files(model: nn.Module, recipe: Recipe, directory: Path, weights: dict | None) -> None:
    if recipe.model.source == "transformers" or recipe.model.lora is not None:  # a PeftModel saves its adapter
        from transformers.utils import logging as transformers_logging

        shown = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()  # a one-file "Writing model shards" bar says nothing
        try:
            model.save_pretrained(str(directory), state_dict=weights)  # config.json + model.safetensors, ties handled by transformers
        finally:
            if shown:
                transformers_logging.enable_progress_bar()
        return
    from safetensors.torch import save_file, save_model

    if weights is not None:  # tied names share one tensor: keep the first, as save_model does
        seen: set[tuple[int, int]] = set()
        unique = {}
        for name, tensor in weights.items():
            storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            if storage not in seen or not storage[1]:
                seen.add(storage)
                unique[name] = tensor.contiguous()
        save_file(unique, str(directory / WEIGHTS), metadata={"format": "pt"})
        return
    # save_model, unlike save_file, drops the second name of tied weights instead of refusing them;
    # loading gives the tie back (builders/pretrained.py)
    save_model(model, str(directory / WEIGHTS), metadata={"format": "pt"})


def _write_tokenizer(recipe: Recipe, directory: Path) -> None:
    """Text read with a tokenizer: save it beside the weights, as from_pretrained users expect."""
    tokenizer = getattr(recipe.data, "tokenizer", None)
    if tokenizer is None:
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()), local_files_only=True).save_pretrained(str(directory))


def _replace(directory: Path, temporary: Path) -> None:
    """Rename `temporary` to `directory`; an earlier export is moved aside first, then deleted."""
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    temporary.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
