"""What a checkpoint directory holds and how it is read back: the file format that training writes
(runner/train/checkpoint.py saves and resumes) and building reads (runner/build/pretrained.py starts
a model from a checkpoint's weights). It sits below both so that neither reaches up into the other.

A complete checkpoint is ROOT/step-NNNNNNNN holding state.pt and a COMPLETE marker that records
state.pt's sha256. Loading uses `torch.load(weights_only=True)`: no pickled code is ever run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"
STATE_FILE = "state.pt"


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
