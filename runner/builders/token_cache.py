"""Tokenised data kept on disk, keyed by everything that shapes it, so a dataset is tokenised once.

The key is a hash of the data files' names, sizes and modification times, the tokenizer's
files, and the settings that change the tokens (fields, lengths, task, labels). Any change
gives a new key, so a stale cache is never read. The cache lives in the user's cache folder
($XDG_CACHE_HOME/ckrun/datasets), as Hugging Face's does, never in the data folder: data folders
are often shared or read-only. A cache that cannot be read is rebuilt, and one that cannot be
written is skipped with a warning: the cache never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from ..problems import first_line
from ..disk.user_cache import cache_folder

log = logging.getLogger(__name__)

def user_cache_folder() -> Path:
    """$XDG_CACHE_HOME/ckrun/datasets, else ~/.cache/ckrun/datasets."""
    return cache_folder() / "datasets"


def files_fingerprint(paths: list[Path]) -> list:
    """[name, size, mtime_ns] of every file under `paths` (folders walked): cheap, and any rewrite changes it."""
    found = []
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            stat = file.stat()
            found.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
    return found


def folder_digest(folder: str | None) -> str | None:
    """A hash of a small folder's contents (a tokenizer): a retrained tokenizer in the same place differs."""
    if folder is None:
        return None
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(folder).expanduser().rglob("*") if p.is_file()):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


class TokenCache:
    """Tensors for one (data, settings) key: `load()` finds them, `save()` writes them atomically."""

    def __init__(self, data_paths: list[Path], parts: dict):
        key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.file = user_cache_folder() / f"{data_paths[0].resolve().name}-{key}.pt"

    def load(self) -> dict | None:
        if not self.file.is_file():
            return None
        try:
            tensors = torch.load(self.file, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a cut-short or foreign file: rebuild it, say why
            log.warning("data: the token cache %s cannot be read (%s); tokenising again", self.file, _reason(err))
            return None
        log.info("data: tokens from the cache %s (the data, tokenizer and settings are unchanged)", self.file)
        return tensors

    def save(self, tensors: dict) -> None:
        try:
            self._write(self.file.parent, tensors)
        except OSError as err:
            log.warning("data: cannot write the token cache at %s (%s); the next run tokenises again "
                        "(XDG_CACHE_HOME picks another folder)", self.file.parent, _reason(err))
            return
        log.info("data: tokens cached at %s", self.file)

    def _write(self, folder: Path, tensors: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(handle, "wb") as out:
                torch.save(tensors, out)
            os.replace(temporary, self.file)  # readers see the whole file or none
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _reason(err: Exception) -> str:
    return first_line(getattr(err, "strerror", None) or err, 160)
