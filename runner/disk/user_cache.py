"""Small JSON tables in the user's cache folder ($XDG_CACHE_HOME/ckrun, else ~/.cache/ckrun), for what
is slow to work out and cheap to look up: `ls`'s parameter counts, `validate`'s passed model checks.

An entry's key is a hash of everything its value depends on (`key_of`), so a stale value is never
found, only missed. A table that cannot be read, is not a JSON object or holds values of the wrong
kind counts as empty and is written again whole: a damaged cache costs one slow run, never a wrong
answer. A table that cannot be written costs only time, never the command. Nothing here imports
torch: reading a table is what lets a later command skip importing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

from .files import write_atomic

MAX_ENTRIES = 2000  # a table stays a few hundred kB however many configs a user tries


def cache_folder() -> Path:
    """$XDG_CACHE_HOME/ckrun, else ~/.cache/ckrun (as Hugging Face's caches do)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckrun"


def read_table(name: str, valid: Callable[[object], bool]) -> dict[str, object]:
    """The table `name`: its entries whose value passes `valid`; {} when it is missing or damaged."""
    try:
        table = json.loads((cache_folder() / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {key: value for key, value in table.items() if isinstance(key, str) and valid(value)}


def write_table(name: str, table: dict[str, object]) -> None:
    """Keep `table` for later commands, its newest MAX_ENTRIES entries (insertion order) at most."""
    path = cache_folder() / name
    kept = dict(list(table.items())[-MAX_ENTRIES:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(kept, sort_keys=True))
    except OSError:
        pass


def key_of(parts: Iterable[str], packages: Iterable[str] = ()) -> str:
    """A hash of `parts`, the Python version and the installed version of each of `packages`."""
    lines = [*parts, f"python {sys.version.split()[0]}"]
    for package in packages:
        try:
            lines.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{package} none")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
