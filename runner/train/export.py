"""The end of a run: the final training state as a checkpoint, and the model exported for use.

`finish_run` is the loop's one end-of-run call, made after the last step and after a stop
request (once the step in flight has finished), so a run never ends without its weights:
- `OUTPUT_DIR/checkpoints/step-N` holds the full training state of the last step, whatever
  `output.checkpoint_every` is, so `--resume` with more `train.steps` continues from it;
- `OUTPUT_DIR/model/` holds the model alone: `save_pretrained` output (config.json +
  model.safetensors) for transformers models, a model.safetensors state dict for torchvision and
  python models, and beside either the run's resolved recipe.yaml (and its tokenizer, when the
  data had one), so that `model.pretrained: OUTPUT_DIR/model` rebuilds exactly this model.
The export is written to a temporary directory and renamed into place: a reader never sees half.
Only an earlier export of ckrun's is ever replaced (`is_export`): a run refuses at its start an
OUTPUT_DIR/model that is not one, and one that appeared during the run is left as it is, the
export going to a free name beside it (model-2, ...).
"""

from __future__ import annotations

import logging
import os
import shutil
import secrets
from pathlib import Path

from torch import nn

from ..builders.pretrained import EXPORT_RECIPE, WEIGHTS
from ..files import os_errors_kept
from ..recipe import Recipe
from ..yamlio import dump_yaml
from .checkpoint import checkpoint_dir, complete_checkpoints, save_checkpoint
from .ranked import full_weights, save_state
from .dcp_checkpoint import finish_saving
from .output import EXPORT_HEADER, MODEL_DIR, is_export

log = logging.getLogger(__name__)


def finish_run(trainer, out_dir: Path) -> Path:
    """Save the trainer's state as the final checkpoint and export its model; returns the export."""
    save_final_checkpoint(trainer, out_dir / "checkpoints")
    weights = full_weights(trainer)  # FSDP: gathered on rank 0, a collective every rank joins
    if not trainer.ranks.is_main:
        return out_dir / MODEL_DIR
    exported = export_model(trainer.model, trainer.recipe, out_dir / MODEL_DIR, trainer.step, weights)
    log.info("model exported to %s (start another run from it with model.pretrained=%s)", exported, exported)
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
    given, is its whole state dict (a sharded model's own holds only this rank's shards). A directory
    there that is not an earlier export is kept, and the export goes to a free name beside it."""
    directory = _own_name(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = _fresh(directory, "tmp")
    try:
        _write_weights(model, recipe, temporary, weights)
        _write_tokenizer(recipe, temporary)
        header = (f"{EXPORT_HEADER} {step}: the recipe that trained these weights.\n"
                  f"# start a run from them with model.pretrained={directory}\n")
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
    if recipe.model.source == "transformers":
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


def _own_name(directory: Path) -> Path:
    """`directory` when it is free or an earlier export, else the first free or exported `directory-N`."""
    candidate, number = directory, 1
    while os.path.lexists(candidate) and not is_export(candidate):
        number += 1
        candidate = directory.with_name(f"{directory.name}-{number}")
    if candidate != directory:
        log.warning("%s is not a model ckrun exported (it appeared during the run): left as it is; the model is "
                    "exported to %s", directory, candidate)
    return candidate


def _fresh(directory: Path, kind: str) -> Path:
    """A new empty directory beside `directory` (made here, so nothing of anyone else's is removed
    or written into), with the permissions a plain mkdir gives."""
    while True:
        candidate = directory.with_name(f".{directory.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate


def _replace(directory: Path, temporary: Path) -> None:
    """Rename `temporary` to `directory`; an earlier export (and only that) is moved aside first, then deleted."""
    old = None
    if os.path.lexists(directory):
        old = _fresh(directory, "old")
        directory.rename(old)  # onto the empty directory just made: a name no one else has
    temporary.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
