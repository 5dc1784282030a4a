"""`--resume`: the newest checkpoint that loads, checked against the recipe, and metrics cut back to it.

A checkpoint records the model and optimizer sections of the recipe that trained it. Resuming
with a different model or optimizer would either fail deep inside torch or, worse, load: an
SGD run silently continuing from AdamW state. So the two are compared first and every
difference named in one line. The memory plan may change (it never changes what is computed),
and so may train.steps, which is how a finished run is extended.

What else decides the steps to come (the batch size, the data and its seq_len, the seed, the
precision, clipping, the schedule) is recorded too: changed, the run would not be the one it
continues, so --resume refuses, naming each change, unless --resume-changed accepts them; then
the changes are logged, and the loop gives every sink (metrics.jsonl first) the record
`{"step": N, "resumed_with_changes": ...}`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ...disk.checkpoint_files import STATE_FILE
from ...problems import InputError, Place, Problem, first_line
from ...recipe.recipe import Recipe
from .store import CheckpointError, complete_checkpoints, load_latest
from .fingerprint import RUN, fingerprint, run_settings
from .sharded import is_sharded, load_sharded, pick_sharded, read_trainer_state
from ..output.directory import METRICS, read_metrics_lines, set_aside_unresumable, strict_record, write_output

log = logging.getLogger(__name__)


def resume(trainer, out_dir: Path, source: str, accept_changes: bool = False) -> dict[str, list]:
    """Restore `trainer` from the newest loadable checkpoint in out_dir, or start at step 0 when none;
    `accept_changes`: --resume-changed (changed run settings are logged and returned, for the loop to
    record, not refused). Returns those changes, {key: [in the checkpoint, now]}."""
    root = out_dir / "checkpoints"
    try:
        sharded = _resumed_sharded(trainer, root, out_dir, source, accept_changes)
        if sharded is not None:
            return sharded
        # a split model keeps a piece of the whole state each rank reads: read it into host memory, not N
        # times onto GPUs
        sharding = trainer.ranks.joined and trainer.recipe.distributed.shards
        state = load_latest(root, torch.device("cpu") if sharding else trainer.device)
    except CheckpointError as err:
        raise InputError([Problem(Place(source), "output.dir", f"--resume: {err}")]) from None
    if state is None:
        log.info("--resume: no complete checkpoint in %s, starting from step 0", root)
        if trainer.ranks.is_main:
            set_aside_unresumable(out_dir)
        return {}
    name = f"step-{int(state['step']):08d}"
    check_not_past_end(int(state["step"]), trainer.total_steps, trainer.recipe, name, source)
    _check_same_recipe(state.get("recipe"), fingerprint(trainer.recipe), name, source)
    changes = run_changes(state.get("recipe"), trainer.recipe, name, source, accept_changes)
    try:
        trainer.restore(state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise InputError([Problem(Place(source), "model", f"--resume: {name} does not fit the model and optimizer "
                                  f"the recipe builds ({first_line(err, 240)}); resume with the recipe the run started "
                                  "with, or choose a new output.dir")]) from None
    if trainer.ranks.is_main:
        truncate_metrics(out_dir / METRICS, trainer.step, source)
    return changes


def check_not_past_end(step: int, total: int, recipe: Recipe, name: str, source: str) -> None:
    """A run resumed with fewer steps than its checkpoint reached cannot go back (a checkpoint holds the state
    after its step): one line at the key that sets the length, not a silent export of the weights it had. A
    run resumed at its last step (a requeued job that had finished) has nothing to train, and says so."""
    key = "train.steps" if recipe.train.steps is not None else "train.epochs"
    length = f"train.steps {total}" if recipe.train.steps is not None else f"train.epochs {recipe.train.epochs:g} ({total} steps)"
    if step > total:
        raise InputError([Problem(Place(source), key, f"--resume: {name} is at step {step}, already past the run's end "
                                  f"at {length}; a checkpoint cannot go back: give more than {step} steps to train "
                                  "on, start from its weights in a new output.dir (model.pretrained), or leave it")])
    if step == total:
        log.info("--resume: %s is the run's last step (%s): nothing to train; the end is written again", name, length)


def _resumed_sharded(trainer, root: Path, out_dir: Path, source: str, accept_changes: bool) -> dict[str, list] | None:
    """Resume from the newest sharded (DCP) checkpoint, on any world size, returning the accepted
    changes; None when the newest is not one."""
    picked = pick_sharded(root, trainer.ranks)
    if picked is None:
        return None
    checkpoint, state = picked
    check_not_past_end(int(state["step"]), trainer.total_steps, trainer.recipe, checkpoint.name, source)
    _check_same_recipe(state.get("recipe"), fingerprint(trainer.recipe), checkpoint.name, source)
    changes = run_changes(state.get("recipe"), trainer.recipe, checkpoint.name, source, accept_changes)
    try:
        load_sharded(trainer, checkpoint, state)
    except (RuntimeError, ValueError, KeyError) as err:
        raise InputError([Problem(Place(source), "model", f"--resume: {checkpoint.name} does not fit the model and "
                                  f"optimizer the recipe builds ({first_line(err, 240)}); resume with the recipe the run "
                                  "started with, or choose a new output.dir")]) from None
    log.info("resuming from %s (sharded, saved by %s rank(s))", checkpoint, state.get("world_size", "?"))
    if trainer.ranks.is_main:
        truncate_metrics(out_dir / METRICS, trainer.step, source)
    return changes


def _check_same_recipe(saved: dict | None, now: dict[str, str], name: str, source: str) -> None:
    if not isinstance(saved, dict):
        return  # saved before checkpoints recorded it: restore's own shape checks still apply
    problems = []
    for section, text in now.items():
        if section not in saved or saved[section] == text or section == RUN:
            continue
        changes = _differences(json.loads(saved[section]), json.loads(text), section)
        if not changes:  # only keys the checkpoint's ckrun did not have, at their null default
            continue
        key = changes[0][0]  # placed at the first key that changed
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


def run_changes(saved: dict | None, recipe: Recipe, name: str, source: str, accept: bool) -> dict[str, list]:
    """Changed run settings, {key: [in the checkpoint, now]}; an InputError naming each unless `accept`."""
    if not isinstance(saved, dict) or RUN not in saved:
        return {}  # saved before checkpoints recorded them
    before, now = json.loads(saved[RUN]), run_settings(recipe)
    changes = {key: [old, new] for key in now for key, old, new in _leaves(key, before.get(key), now[key]) if old != new}
    if changes and not accept:
        said = "; ".join(f"{key} {json.dumps(old)} in the checkpoint, {json.dumps(new)} now"
                         for key, (old, new) in list(changes.items())[:4])
        raise InputError([Problem(Place(source), next(iter(changes)), f"--resume: {name} was trained with other "
                                  f"settings: {said}; the resumed steps would not continue that run: pass "
                                  "--resume-changed to continue anyway (recorded in metrics.jsonl), put the "
                                  "settings back, or choose a new output.dir")])
    if changes:
        log.warning("--resume-changed: continuing %s with %s", name,
                    "; ".join(f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changes.items()))
    return changes


def _leaves(key: str, before, after):
    """(dotted key, before, after) for each setting under `key` (a whole section when it changed kind)."""
    if isinstance(before, dict) and isinstance(after, dict) and before.get("source") == after.get("source"):
        for sub in dict.fromkeys([*before, *after]):
            yield from _leaves(f"{key}.{sub}", before.get(sub), after.get(sub))
    else:
        yield key, before, after



def check_before_ranks(out_dir: Path, recipe: Recipe, source: str, accept_changes: bool = False) -> None:
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
    if recipe.train.steps is not None and isinstance(saved.get("step"), int):  # epochs: the ranks count their data
        check_not_past_end(saved["step"], recipe.train.steps, recipe, found[-1].name, source)
    _check_same_recipe(saved.get("recipe"), fingerprint(recipe), found[-1].name, source)
    if not accept_changes:  # accepted, each rank logs and records them as it resumes
        run_changes(saved.get("recipe"), recipe, found[-1].name, source, accept=False)


def _peek(checkpoint: Path) -> dict:
    """state.pt's small entries; mmap leaves its tensors on disk."""
    state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    return state if isinstance(state, dict) else {}
