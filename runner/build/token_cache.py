"""Tokenised data kept on disk, keyed by everything that shapes it, so a dataset is tokenised once.

The key is a hash of the data files' names, sizes and modification times, the tokenizer's
files, and the settings that change the tokens (fields, lengths, task, labels). Any change
gives a new key, so a stale cache is never read. The cache lives beside the data, in a
`.ckrun-cache` folder; where that cannot be written (a read-only data folder) it goes to the
user's cache folder instead, and the log says which. A cache that cannot be read is rebuilt,
and one that cannot be written is skipped with a warning: the cache never stops a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FOLDER = ".ckrun-cache"


def user_cache_folder() -> Path:
    """$XDG_CACHE_HOME/ckrun/datasets, else ~/.cache/ckrun/datasets."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "ckrun" / "datasets"


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
        first = data_paths[0].resolve()
        self.name = f"{first.name}-{key}.pt"
        self.beside = first.parent / FOLDER

    def load(self) -> dict | None:
        for folder in (self.beside, user_cache_folder()):
            file = folder / self.name
            if file.is_file():
                try:
                    tensors = torch.load(file, map_location="cpu", weights_only=True)
                except Exception as err:  # noqa: BLE001 - a cut-short or foreign file: rebuild it, say why
                    log.warning("data: the token cache %s cannot be read (%s); tokenising again", file, _reason(err))
                    continue
                log.info("data: tokens from the cache %s (the data, tokenizer and settings are unchanged)", file)
                return tensors
        return None

    def save(self, tensors: dict) -> None:
        try:
            self._write(self.beside, tensors)
            log.info("data: tokens cached at %s", self.beside / self.name)
            return
        except OSError as err:
            beside_reason = _reason(err)
        fallback = user_cache_folder()
        try:
            self._write(fallback, tensors)
            log.info("data: cannot write the cache beside the data (%s: %s); cached at %s instead",
                     self.beside, beside_reason, fallback / self.name)
        except OSError as err:
            log.warning("data: cannot write the token cache beside the data (%s) nor at %s (%s); "
                        "the next run tokenises again", beside_reason, fallback, _reason(err))

    def _write(self, folder: Path, tensors: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
        try:
            with os.fdopen(handle, "wb") as out:
                torch.save(tensors, out)
            os.replace(temporary, folder / self.name)  # readers see the whole file or none
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _reason(err: Exception) -> str:
    text = getattr(err, "strerror", None) or str(err) or type(err).__name__
    return text.splitlines()[0][:160]
