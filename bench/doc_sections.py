"""A benchmark's section of a docs page, between its own markers: rewritten in place on each run,
so several benchmarks can share one page without overwriting each other."""

from __future__ import annotations

from pathlib import Path

from ckrun.runner.disk.files import write_atomic


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: start -->", f"<!-- {name}: end -->"


def write_section(path: Path, name: str, body: str) -> None:
    """Put `body` between the markers of `name` in `path`: in place when they are there, else at the top."""
    start, end = markers(name)
    text = f"{start}\n{body.strip()}\n{end}"
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + text + rest.split(end, 1)[1]
    else:
        new = text + "\n\n" + old
    write_atomic(path, new)
