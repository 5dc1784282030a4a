"""Writing files that another process may read at the same moment."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it (`ckrun report` reads while we tune;
    a run killed mid-write must leave metrics.jsonl and recipe.yaml whole for --resume)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
