"""The weight files a model.pretrained directory is read from, each read as far as its header.

A safetensors file is an 8-byte header length, a JSON header naming every tensor's dtype, shape and
byte range, then the bytes: `safe_open` reads the header and checks that the ranges cover the file
exactly, so a garbage header, a file cut short and an empty file are all found without reading a
tensor. A PyTorch `.bin`/`.pt`/`.pth` file is a zip archive whose pickle names the tensors: it is
unpickled with `weights_only=True` (torch's own allow-list: tensors and plain containers, never a
class or function of the file's choosing) and its tensor data memory-mapped, not read. So `ckrun
validate` finds what the run's load would trip over in milliseconds, whatever the model's size.

The files checked are the ones a load reads, in transformers' order for save_pretrained output
(model.safetensors, else the safetensors index's shards, else pytorch_model.bin, else its index's
shards; a Trainer's training_args.bin beside them is no weight file), and `state_dict_file`'s one
file for torchvision and python models. Each problem is one line naming the file and what to do: for
a snapshot in the Hugging Face cache, the `hf download ... --force-download` that fetches it again.
"""

from __future__ import annotations

import json
import os
import stat
import zipfile
from pathlib import Path

from .hub import redownload_command

SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_WEIGHTS, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")


def state_dict_file(directory: Path) -> Path | None:
    """The one state dict file a torchvision or python model is read from."""
    candidates = [directory / SAFE_WEIGHTS, *(path for suffix in STATE_DICT_SUFFIXES
                                              for path in sorted(directory.glob(f"*{suffix}")))]
    return next((c for c in candidates if c.is_file()), None)


def files_read(directory: Path, transformers: bool) -> list[Path]:
    """The weight files loading `directory` reads (none: it holds none, which its own check says)."""
    if not transformers:
        found = state_dict_file(directory)
        return [found] if found is not None else []
    for single, index in ((SAFE_WEIGHTS, SAFE_INDEX), (TORCH_WEIGHTS, TORCH_INDEX)):
        if os.path.lexists(directory / single):
            return [directory / single]
        if os.path.lexists(directory / index):
            return [directory / index, *(directory / name for name in _shards(directory / index))]
    return []


def check_weight_files(directory: Path, transformers: bool) -> None:
    """A one-line ValueError for the first weight file of `directory` a load could not read."""
    for path in files_read(directory, transformers):
        why = _unreadable(path)
        if why is not None:
            raise ValueError(f"{path} {why}; {_what_to_do(directory, path)}")


def _shards(index: Path) -> list[str]:
    """The shard files an index names, in order; none when it cannot be read (its own check says so)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _unreadable(path: Path) -> str | None:
    """Why `path` cannot be loaded as weights, in words; None when its header reads."""
    try:
        mode = path.stat().st_mode  # a link (a cache snapshot's) followed to its file
    except FileNotFoundError:
        return "is missing (a link to a file that is not there)" if os.path.islink(path) else "is missing"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if path.name.endswith(".index.json"):
        return _index_problem(path)
    return _safetensors_problem(path) if path.suffix == ".safetensors" else _torch_problem(path)


def _index_problem(path: Path) -> str | None:
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "is not a shard index (JSON with a weight_map)"
    return None if isinstance(weight_map, dict) and weight_map else "names no shards (an empty weight_map)"


def _safetensors_problem(path: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except (SafetensorError, OSError) as err:  # its own error type, or the OS's for a file it cannot map
        detail = str(err).removeprefix("Error while deserializing header: ")
        return f"is not a whole safetensors file ({detail}): it was cut short or damaged"


def _torch_problem(path: Path) -> str | None:
    """A PyTorch file unpickled with weights_only, its tensors mapped rather than read (zip archives:
    every torch since 1.6; an older file is read whole)."""
    import torch

    try:
        mapped = zipfile.is_zipfile(path)
        torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as err:  # noqa: BLE001 - torch's errors advise weights_only=False: never pass that on
        text = str(err)
        if "GLOBAL" in text or "Unsupported global" in text:
            return ("holds pickled Python objects, not only tensors; ckrun never unpickles those (loading them could "
                    "run code)")
        if isinstance(err, EOFError) or "central directory" in text or "zip" in text.lower():
            return "is cut short or not a PyTorch file"
        return f"cannot be read as PyTorch weights ({type(err).__name__}): it was cut short or damaged"
    return None


def _what_to_do(directory: Path, path: Path) -> str:
    command = redownload_command(directory, path)
    if command is not None:
        return f"download it again with `{command}`, or give a local directory"
    return "save or copy the weights again, or give another directory"
