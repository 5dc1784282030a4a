"""What a checkpoint directory holds and how it is read back: the file format that training writes
(runner/train/checkpoint/store.py saves and resumes) and building reads (runner/builders/pretrained.py starts
a model from a checkpoint's weights). It sits below both so that neither reaches up into the other.

A complete checkpoint is ROOT/step-NNNNNNNN holding state.pt and a COMPLETE marker that records
state.pt's sha256 (older markers did not: then the CRC-32 of every record in torch's zip archive is
checked instead). Both are plain files, never links. Loading uses `torch.load(weights_only=True)`:
no pickled code is ever run.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..problems import CkrunError, first_line

MARKER = "COMPLETE"
STATE_FILE = "state.pt"


class CheckpointError(CkrunError, ValueError):
    """A complete-marked checkpoint that cannot be trusted: damaged, truncated or not tensors only.
    --resume reports it at output.dir (runner/train/checkpoint/resume.py)."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_sha256(checkpoint: Path) -> str | None:
    """The digest the marker recorded for state.pt; None for markers written before digests were."""
    with open(checkpoint / MARKER, "rb") as marker:
        text = marker.read(4096).decode("utf-8", errors="replace")  # a marker is two short lines
    for line in text.splitlines():
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
        _check_own_files(checkpoint)
        expected = recorded_sha256(checkpoint)
        if expected is not None and file_sha256(state_file) != expected:
            raise CheckpointError(f"{checkpoint.name}: state.pt is damaged (its sha256 differs from the one recorded when it was saved)")
        if expected is None:
            _check_zip_crcs(checkpoint)
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


def _check_own_files(checkpoint: Path) -> None:
    """state.pt and the marker are plain files of this checkpoint. ckrun never writes a link: one that
    points elsewhere (/dev/zero: the digest would read forever) or a device or a pipe is not a checkpoint."""
    for name in (MARKER, STATE_FILE):
        mode = os.lstat(checkpoint / name).st_mode
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise CheckpointError(f"{checkpoint.name}: {name} is {kind}; ckrun writes only plain files and never "
                                  "follows a link out of a checkpoint")


def _check_zip_crcs(checkpoint: Path) -> None:
    """A marker written before digests were recorded: the zip archive torch.save wrote checksums every
    record (CRC-32), so a changed byte in the weights is still found."""
    try:
        with zipfile.ZipFile(checkpoint / STATE_FILE) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        raise CheckpointError(f"{checkpoint.name}: state.pt has no recorded digest and is not a whole torch "
                              f"archive ({err}); it cannot be verified") from None
    if bad is not None:
        raise CheckpointError(f"{checkpoint.name}: state.pt is damaged (its record {bad} fails its CRC-32; "
                              "the marker is from before digests were recorded)")


def _why_unloadable(err: Exception) -> str:
    if "weights_only" in str(err) or "Unsupported global" in str(err):
        return "holds pickled Python objects, not only tensors; ckrun never loads those (they could run code)"
    if isinstance(err, EOFError) or "central directory" in str(err) or "ZIP" in str(err):
        return "is truncated or not a torch file"
    return f"cannot be loaded ({type(err).__name__}: {first_line(err, 120)})"
