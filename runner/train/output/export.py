"""The end of a run: the final training state as a checkpoint, and the model exported for use.

`finish_run` is the loop's one end-of-run call, made after the last step and after a stop
request (once the step in flight has finished), so a run never ends without its weights:
- `OUTPUT_DIR/checkpoints/step-N` holds the full training state of the last step, whatever
  `output.checkpoint_every` is, so `--resume` with more `train.steps` continues from it;
- `OUTPUT_DIR/model/` holds the model alone: `save_pretrained` output (config.json +
  model.safetensors) for transformers models, a model.safetensors state dict for torchvision and
  python models, and beside either the run's resolved recipe.yaml (with the label names the data
  used, and its tokenizer, when the data had one), so that `model.pretrained: OUTPUT_DIR/model`
  rebuilds exactly this model, and inputs.json: how text becomes ids (the tokenizer, or UTF-8 bytes
  + 2) and what each class id means, for using it outside ckrun. A transformers model trained on a
  tokenizer carries that tokenizer's bos, eos and pad ids in config.json and generation_config.json.
- under model.lora, `OUTPUT_DIR/adapter/` holds the adapter as `PeftModel.save_pretrained` writes it
  (adapter_config.json + adapter_model.safetensors: `PeftModel.from_pretrained(base, DIR)` loads it),
  and `OUTPUT_DIR/model/` the merged model when model.lora.export_merged asks for it.
The export is written to a temporary directory and renamed into place: a reader never sees half.
Only an earlier export of ckrun's is ever replaced (`is_export`): a run refuses at its start an
OUTPUT_DIR/model that is not one, and one that appeared during the run is left as it is, the
export going to a free name beside it (model-2, ...).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import secrets
from pathlib import Path

from torch import nn

from ...builders.data import MASK_ID
from ...builders.pretrained import EXPORT_RECIPE, WEIGHTS
from ...disk.files import os_errors_kept, write_atomic
from ...recipe.data import BYTE_VOCAB
from ...recipe.recipe import Recipe, infer_task
from ...recipe.yamlio import dump_yaml
from ..checkpoint.store import checkpoint_dir, complete_checkpoints, save_checkpoint
from ..ranked import full_weights, save_state
from ..checkpoint.sharded import finish_saving
from .directory import EXPORT_HEADER, MODEL_DIR, is_export

log = logging.getLogger(__name__)

INPUTS = "inputs.json"  # how to feed the model and read its outputs outside ckrun (model_inputs)
ADAPTER_DIR = "adapter"


def finish_run(trainer, out_dir: Path, best=None) -> Path:
    """Save the trainer's state as the final checkpoint and export its model; returns the export.
    `best` (runner/train/eval/best.py): with eval.best.restore, the export is the best evaluation's weights."""
    save_final_checkpoint(trainer, out_dir / "checkpoints")
    weights = full_weights(trainer)  # FSDP: gathered on rank 0, a collective every rank joins
    if not trainer.ranks.is_main:
        return out_dir / MODEL_DIR
    if trainer.recipe.model.lora is not None:
        return _export_adapted(trainer, out_dir, weights, best)
    exported = export_model(trainer.model, trainer.recipe, out_dir / MODEL_DIR, trainer.step, weights,
                            getattr(trainer.data, "label_ids", None))
    log.info("model exported to %s (start another run from it with model.pretrained=%s)", exported, exported)
    if best is not None:
        best.restore(exported)
    elif trainer.recipe.eval is not None and trainer.recipe.eval.early_stopping is not None:
        log.info("the export holds the last step's weights; eval.best: {restore: true} exports the best evaluation's")
    return exported


def _export_adapted(trainer, out_dir: Path, weights: dict | None, best=None) -> Path:
    """The adapter (the best evaluation's with eval.best.restore), then (model.lora.export_merged) the
    model with the last step's adapter merged in, as the run's last use of it."""
    recipe = trainer.recipe
    adapter = export_model(trainer.model, recipe, out_dir / ADAPTER_DIR, trainer.step, weights)
    log.info("LoRA adapter exported to %s (peft.PeftModel.from_pretrained(base, %s) loads it)", adapter, adapter)
    if best is not None:
        best.restore(adapter)
    if not recipe.model.lora.export_merged:
        return adapter
    if best is not None:
        log.warning("model.lora.export_merged: the merged model holds the last step's adapter; %s holds the best "
                    "evaluation's", adapter)
    from ...builders.adapters import merged

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


def export_model(model: nn.Module, recipe: Recipe, directory: Path, step: int, weights: dict | None = None,
                 label_ids: dict[str, int] | None = None) -> Path:
    """Write `model` as a loadable directory, replacing any earlier export there; `weights`, when
    given, is its whole state dict (a sharded model's own holds only this rank's shards); `label_ids`,
    the data's label names and their ids, go into the exported recipe and inputs.json. A directory
    there that is not an earlier export is kept, and the export goes to a free name beside it."""
    directory = _own_name(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    temporary = _fresh(directory, "tmp")
    try:
        align_special_tokens(model, recipe)
        _write_weights(model, recipe, temporary, weights)
        _write_tokenizer(recipe, temporary)
        header = (f"{EXPORT_HEADER} {step}: the recipe that trained these weights.\n"
                  f"# start a run from them with model.pretrained={directory}\n" if recipe.model.lora is None else
                  f"{EXPORT_HEADER} {step}: the recipe that trained this LoRA adapter.\n"
                  f"# load it onto its base with peft.PeftModel.from_pretrained(base, \"{directory}\")\n")
        data = recipe.model_dump(mode="json")
        names = _label_names(label_ids)
        held_out = (data.get("eval") or {}).get("data") or {}  # held-out records take the training data's ids
        for section in (data["data"], held_out):
            if names and "labels" in section:  # the map the run used, not `null`: a rebuilt run uses the same ids
                section["labels"] = list(names)  # a copy each: one list twice would be dumped as a YAML alias
        (temporary / EXPORT_RECIPE).write_text(header + dump_yaml(data), encoding="utf-8")
        write_atomic(temporary / INPUTS, json.dumps(model_inputs(recipe, model, names), indent=1) + "\n")
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


def align_special_tokens(model: nn.Module, recipe: Recipe) -> None:
    """A transformers model trained on a tokenizer's ids gets that tokenizer's bos, eos and pad ids in its
    config and generation config (GPT-2's config says 50256, which a 2000-token tokenizer does not have,
    so `generate` could never stop), unless the recipe's model.config sets them (validate checked those).
    A tokenizer without a pad token pads with its end token, as transformers' own examples do."""
    directory = getattr(recipe.data, "tokenizer", None)
    config = getattr(model, "config", None)
    if directory is None or config is None or recipe.model.source != "transformers":
        return
    from ...builders.tokenizer_facts import tokenizer_facts

    ids = dict(tokenizer_facts(directory).special)
    if "pad" not in ids and "eos" in ids:
        ids["pad"] = ids["eos"]
    generation = getattr(model, "generation_config", None)
    for name in ("bos", "eos", "pad"):
        setting = f"{name}_token_id"
        if name not in ids or setting in recipe.model.config:
            continue
        setattr(config, setting, ids[name])
        if generation is not None:
            setattr(generation, setting, ids[name])


def _label_names(label_ids: dict[str, int] | None) -> list[str] | None:
    """Label names in id order, when the ids are 0..n-1 (as every source gives them)."""
    if not label_ids or sorted(label_ids.values()) != list(range(len(label_ids))):
        return None
    return [name for name, _ in sorted(label_ids.items(), key=lambda item: item[1])]


def model_inputs(recipe: Recipe, model: nn.Module, labels: list[str] | None) -> dict:
    """inputs.json: what using the model outside ckrun needs to know about its inputs and outputs,
    which a state dict alone does not say: how text becomes ids, and what each output class means."""
    data = recipe.data
    task = getattr(data, "task", None) or infer_task(recipe.model)
    found: dict = {"format": 1, "task": task, "model": {"source": recipe.model.source, "name": recipe.model.name}}
    if hasattr(data, "seq_len"):
        found["seq_len"] = data.seq_len
    if getattr(data, "tokenizer", None) is not None:
        found["token_ids"] = {"kind": "tokenizer", "directory": ".", "how": "AutoTokenizer.from_pretrained(this "
                              "directory); ids are the tokenizer's"}
    elif data.tokenised:  # text, records, a dataset without a tokenizer: UTF-8 bytes
        vocab = getattr(data, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None) \
            or getattr(model, "vocab_size", None) or BYTE_VOCAB
        found["token_ids"] = {"kind": "utf-8 bytes", "id": "byte + 2, modulo vocab_size", "vocab_size": int(vocab),
                              "pad_id": 0, "mask_id": MASK_ID,
                              "how": "ids = [(b + 2) % vocab_size for b in text.encode('utf-8')]; 0 pads (attention "
                                     "mask 0), 1 masks (masked_lm)"}
    if labels:
        found["labels"] = dict(enumerate(labels))
    return found


def _replace(directory: Path, temporary: Path) -> None:
    """Rename `temporary` to `directory`; an earlier export (and only that) is moved aside first, then deleted."""
    old = None
    if os.path.lexists(directory):
        old = _fresh(directory, "old")
        directory.rename(old)  # onto the empty directory just made: a name no one else has
    temporary.rename(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
