"""`--resume`: the newest checkpoint that loads, checked against the recipe, and metrics cut back to it.

A checkpoint records the model and optimizer sections of the recipe that trained it. Resuming
with a different model or optimizer would either fail deep inside torch or, worse, load: an
SGD run silently continuing from AdamW state. So the two are compared first and every
difference named in one line. The memory plan may change (it never changes what is computed),
and so may train.steps, which is how a finished run is extended.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..checkpoint_files import STATE_FILE
from ..problems import InputError, Place, Problem
from ..recipe import Recipe
from .checkpoint import CheckpointError, complete_checkpoints, load_latest
from .sharded import is_sharded, load_sharded, pick_sharded, read_trainer_state
from .output import METRICS, read_metrics_lines, set_aside_unresumable, strict_record, write_output

log = logging.getLogger(__name__)


def fingerprint(recipe: Recipe) -> dict[str, str]:
    """What a checkpoint must agree with to be resumed, as JSON strings (torch.load(weights_only) reads those)."""
    model = recipe.model.model_dump(mode="json", exclude={"pretrained"})  # initial weights only: moot once trained
    return {"model": json.dumps(model, sort_keys=True),
            "train.optimizer": json.dumps(recipe.train.optimizer.model_dump(mode="json"), sort_keys=True)}


def resume(trainer, out_dir: Path, source: str) -> None:
    """Restore `trainer` from the newest loadable checkpoint in out_dir, or start at step 0 when none."""
    root = out_dir / "checkpoints"
    try:
        if _resumed_sharded(trainer, root, out_dir, source):
            return
        # FSDP keeps a shard of the whole state each rank reads: read it into host memory, not N times onto GPUs
        sharding = trainer.ranks.joined and trainer.recipe.distributed.strategy == "fsdp"
        state = load_latest(root, torch.device("cpu") if sharding else trainer.device)
    except CheckpointError as err:
        raise InputError([Problem(Place(source), "output.dir", f"--resume: {err}")]) from None
    if state is None:
        log.info("--resume: no complete checkpoint in %s, starting from step 0", root)
        if trainer.ranks.is_main:
            set_aside_unresumable(out_dir)
        return
    name = f"step-{int(state['step']):08d}"
    _check_same_recipe(state.get("recipe"), fingerprint(trainer.recipe), name, source)
    try:
        trainer.restore(state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise InputError([Problem(Place(source), "model", f"--resume: {name} does not fit the model and optimizer "
                                  f"the recipe builds ({_first_line(err)}); resume with the recipe the run started "
                                  "with, or choose a new output.dir")]) from None
    if trainer.ranks.is_main:
        truncate_metrics(out_dir / METRICS, trainer.step, source)


def _resumed_sharded(trainer, root: Path, out_dir: Path, source: str) -> bool:
    """Resume from the newest sharded (DCP) checkpoint, on any world size; False when the newest is not one."""
    picked = pick_sharded(root, trainer.ranks)
    if picked is None:
        return False
    checkpoint, state = picked
    _check_same_recipe(state.get("recipe"), fingerprint(trainer.recipe), checkpoint.name, source)
    try:
        load_sharded(trainer, checkpoint, state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise InputError([Problem(Place(source), "model", f"--resume: {checkpoint.name} does not fit the model and "
                                  f"optimizer the recipe builds ({_first_line(err)}); resume with the recipe the run "
                                  "started with, or choose a new output.dir")]) from None
    log.info("resuming from %s (sharded, saved by %s rank(s))", checkpoint, state.get("world_size", "?"))
    if trainer.ranks.is_main:
        truncate_metrics(out_dir / METRICS, trainer.step, source)
    return True


def _check_same_recipe(saved: dict | None, now: dict[str, str], name: str, source: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before checkpoints recorded it: restore's own shape checks still apply
    problems = []
    for section, text in now.items():
        if section not in saved or saved[section] == text:
            continue
        changes = _differences(json.loads(saved[section]), json.loads(text), section)
        key = changes[0][0] if changes else section  # placed at the first key that changed
        problems.append(Problem(Place(source), key, f"--resume: {name} was trained with a different {section.split('.')[-1]}: "
                                f"{'; '.join(text for _key, text in changes[:4])}; resume with the recipe the run "
                                "started with, or choose a new output.dir"))
    if problems:
        raise InputError(problems)


def _differences(before, after, key: str) -> list[tuple[str, str]]:
    """(key, 'model.config.hidden_size 32 in the checkpoint, 64 now') for every leaf that differs."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = list(dict.fromkeys([*before, *after]))
        kinds = [k for k in ("source", "name") if before.get(k) != after.get(k)]
        keys = kinds or keys  # another kind of optimizer or model: its other settings differ as a matter of course
        return [change for k in keys for change in _differences(before.get(k), after.get(k), f"{key}.{k}")]
    if before == after:
        return []
    return [(key, f"{key} {json.dumps(before)} in the checkpoint, {json.dumps(after)} now")]


def truncate_metrics(path: Path, step: int, source: str) -> None:
    """Drop the metrics of steps after the checkpoint (they run again) and any line a full disk or
    a kill cut short: a partial last line must never make every later --resume fail."""
    if not path.exists():
        return
    records, unread = read_metrics_lines(path)
    if unread:
        log.warning("--resume: dropped %d unreadable line(s) of %s (a write that was cut short)", unread, path)
    kept = [strict_record(r) for r in records if r["step"] <= step]
    write_output(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), source)


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    # load_state_dict's first line only says "Error(s) in loading state_dict for X:"; the next says which
    return (" ".join(lines[:2]) if lines[0].endswith(":") else lines[0])[:240]


def check_before_ranks(out_dir: Path, recipe: Recipe, source: str) -> None:
    """`--nproc --resume`: the newest complete checkpoint checked against the recipe once, before any
    rank starts (each rank would find the same difference, and say it once per rank). One that cannot
    be read is left to the ranks, which set it aside and take an older one."""
    found = complete_checkpoints(out_dir / "checkpoints")
    if not found:
        return
    try:
        saved = read_trainer_state(found[-1]) if is_sharded(found[-1]) else _peek(found[-1])
    except (CheckpointError, OSError, RuntimeError, ValueError):
        return
    _check_same_recipe(saved.get("recipe"), fingerprint(recipe), found[-1].name, source)


def _peek(checkpoint: Path) -> dict:
    """state.pt's small entries; mmap leaves its tensors on disk."""
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    return state if isinstance(state, dict) else {}

