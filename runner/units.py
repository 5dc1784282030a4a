"""Numbers for people to read; no torch here, so a message can be formatted without importing it."""

from __future__ import annotations


def format_bytes(count: int | float) -> str:
    """1.5 GB, 640.0 kB, 1.2 TB: decimal units, as card makers and `--max-mem 40GB` count."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"
