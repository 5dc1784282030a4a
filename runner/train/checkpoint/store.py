"""Training-state checkpoints that are complete or invisible.

A checkpoint is written into a temporary directory, every file fsync'd, a COMPLETE marker
written last, then the directory is renamed into place. Resume only ever looks at directories
whose name is final and whose marker exists, so a save that died halfway is never picked.
The marker holds the sha256 of state.pt: a file damaged after its save (a bad disk, a copy cut
short) is recognised before it is loaded, not trained from. Loading uses
`torch.load(weights_only=True)`: no pickled code is ever run.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy
import torch

from ...disk.checkpoint_files import MARKER, STATE_FILE, CheckpointError, file_sha256, load_checkpoint
from ...disk.files import save_torch

log = logging.getLogger(__name__)

_FINAL = re.compile(r"^step-(\d{8})$")


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Atomically write `state` as ROOT/step-NNNNNNNN; older complete checkpoints beyond `keep` go."""
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    temporary = root / f".tmp-step-{step:08d}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        save_torch(state, temporary / STATE_FILE)
        fsync_path(temporary / STATE_FILE)
        # hashed from the file as written (the page cache), so the digest covers what load will read
        (temporary / MARKER).write_text(f"{step}\nsha256 {file_sha256(temporary / STATE_FILE)} {STATE_FILE}\n")
        fsync_path(temporary / MARKER)
        fsync_path(temporary)
        clear_final(final)
        temporary.rename(final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def clear_final(final: Path) -> None:
    """Make room for a checkpoint at `final`: an earlier complete one (marked) goes; a link goes, never
    what it points at; anything else there is not ckrun's and is renamed aside, never deleted."""
    if final.is_symlink():
        final.unlink()
    elif (final / MARKER).is_file():
        shutil.rmtree(final)
    elif os.path.lexists(final):
        aside, number = final.with_name(f"{final.name}.not-a-checkpoint"), 1
        while os.path.lexists(aside):
            number += 1
            aside = final.with_name(f"{final.name}.not-a-checkpoint-{number}")
        final.rename(aside)
        log.warning("%s was not a checkpoint ckrun wrote: kept as %s", final, aside.name)


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first; temporary and unmarked ones are ignored."""
    if not root.is_dir():
        return []
    # a step directory that is a link is not one this run wrote: never followed out of the run
    found = [p for p in root.iterdir() if _FINAL.match(p.name) and not p.is_symlink() and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_FINAL.match(p.name).group(1)))


def load_latest(root: Path, device: torch.device) -> dict[str, Any] | None:
    """The newest complete checkpoint that loads. A damaged one is moved aside (renamed, never
    deleted) and reported in one line naming the checkpoint taken instead. None when there is
    none; CheckpointError when every one of them is damaged."""
    failures = []
    linked = [p.name for p in root.glob("step-*") if p.is_symlink()] if root.is_dir() else []
    if linked:
        log.warning("--resume: %s %s a symbolic link, not a checkpoint this run wrote; not followed",
                    ", ".join(sorted(linked)), "is" if len(linked) == 1 else "are")
    for checkpoint in reversed(complete_checkpoints(root)):
        try:
            state = load_checkpoint(checkpoint, device)
        except CheckpointError as err:
            failures.append(str(err))
            _set_aside(checkpoint)
            continue
        for failure in failures:
            log.warning("--resume: %s; resuming from %s instead (the damaged one is kept as damaged-%s)",
                        failure, checkpoint.name, failure.split(":")[0])
        if not failures:
            log.info("resuming from %s", checkpoint)
        return state
    if failures:
        raise CheckpointError(f"no complete checkpoint in {root} can be loaded ({'; '.join(failures)}); "
                              "they are kept as damaged-step-*; resume without them by choosing a new output.dir")
    return None


def _set_aside(checkpoint: Path) -> None:
    """Out of resume's sight (the name no longer matches), so later saves and resumes skip it."""
    target = checkpoint.with_name(f"damaged-{checkpoint.name}")
    try:
        shutil.rmtree(target, ignore_errors=True)
        checkpoint.rename(target)
    except OSError as err:  # a read-only directory: the fallback still works, only this resume sees it
        log.warning("--resume: could not rename the damaged %s: %s", checkpoint.name, err.strerror or err)


def prune(root: Path, keep: int) -> None:
    """After a save, for both writers (this one and sharded.py's): the newest `keep` complete checkpoints
    stay, and a temporary directory goes once a complete checkpoint of its step or a later one exists (a
    save killed midway left it); one of a later step may be a save still in progress, and stays."""
    complete = complete_checkpoints(root)
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    newest = complete[-1].name if complete else ""
    for stale in root.glob(".tmp-step-*"):  # .tmp-step-NNNNNNNN-...: the names sort by step
        if stale.name.removeprefix(".tmp-")[:13] <= newest:
            shutil.rmtree(stale, ignore_errors=True)


def rng_state(device: torch.device) -> dict[str, Any]:
    kind, keys, position, has_gauss, cached = numpy.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(numpy.int64)), position, has_gauss, cached),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), position, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
