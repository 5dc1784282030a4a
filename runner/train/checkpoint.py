"""Training-state checkpoints that are complete or invisible.

A checkpoint is written into a temporary directory, every file fsync'd, a COMPLETE marker
written last, then the directory is renamed into place. Resume only ever looks at directories
whose name is final and whose marker exists, so a save that died halfway is never picked.
The marker holds the sha256 of state.pt: a file damaged after its save (a bad disk, a copy cut
short) is recognised before it is loaded, not trained from. Loading uses
`torch.load(weights_only=True)`: no pickled code is ever run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy
import torch

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
STATE_FILE = "state.pt"
_FINAL = re.compile(r"^step-(\d{8})$")


def _fsync_path(path: Path) -> None:
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
        torch.save(state, temporary / STATE_FILE)
        _fsync_path(temporary / STATE_FILE)
        # hashed from the file as written (the page cache), so the digest covers what load will read
        (temporary / MARKER).write_text(f"{step}\nsha256 {file_sha256(temporary / STATE_FILE)} {STATE_FILE}\n")
        _fsync_path(temporary / MARKER)
        _fsync_path(temporary)
        if final.exists():
            shutil.rmtree(final)
        temporary.rename(final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first; temporary and unmarked ones are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _FINAL.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(_FINAL.match(p.name).group(1)))


class CheckpointError(ValueError):
    """A complete-marked checkpoint that cannot be trusted: damaged, truncated or not tensors only."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_sha256(checkpoint: Path) -> str | None:
    """The digest the marker recorded for state.pt; None for markers written before digests were."""
    for line in (checkpoint / MARKER).read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "sha256" and parts[2] == STATE_FILE:
            return parts[1]
    return None


def load_checkpoint(checkpoint: Path, device: torch.device) -> dict[str, Any]:
    """The state saved in `checkpoint`, checked against its digest; CheckpointError in one line if it
    cannot be trusted. torch's own errors are not passed on: they are multi-line, and one of them
    advises loading with weights_only=False, which would run whatever code the file holds."""
    state_file = checkpoint / STATE_FILE
    try:
        expected = recorded_sha256(checkpoint)
        if expected is not None and file_sha256(state_file) != expected:
            raise CheckpointError(f"{checkpoint.name}: state.pt is damaged (its sha256 differs from the one recorded when it was saved)")
        state = torch.load(state_file, map_location=device, weights_only=True)
    except CheckpointError:
        raise
    except OSError as err:
        raise CheckpointError(f"{checkpoint.name}: cannot read state.pt: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001 - zip, pickle and EOF errors all mean "not a usable checkpoint"
        raise CheckpointError(f"{checkpoint.name}: state.pt {_why_unloadable(err)}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{checkpoint.name}: state.pt holds no training state")
    return state


def _why_unloadable(err: Exception) -> str:
    if "weights_only" in str(err) or "Unsupported global" in str(err):
        return "holds pickled Python objects, not only tensors; ckrun never loads those (they could run code)"
    if isinstance(err, EOFError) or "central directory" in str(err) or "ZIP" in str(err):
        return "is truncated or not a torch file"
    return f"cannot be loaded ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else 'no detail'})"


def load_latest(root: Path, device: torch.device) -> dict[str, Any] | None:
    """The newest complete checkpoint that loads. A damaged one is moved aside (renamed, never
    deleted) and reported in one line naming the checkpoint taken instead. None when there is
    none; CheckpointError when every one of them is damaged."""
    failures = []
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


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        if not stale.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a run that was killed mid-save


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
