"""Located problems in user input, reported all at once, one line each.

Every user-facing error in ckrun ends up as a `Problem`: where it is (a file with line and
column, or a command-line override), the dotted key, and what to do. The CLI prints them and
exits with status 2; nothing here raises a traceback at the user.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass

# Every exit status ckrun gives, in one table: scripts and CI branch on them.
EXIT_BAD_INPUT = 2  # a Problem with what the user gave: one line each on stderr
EXIT_OVER_CAP = 3  # `ckrun run`: the measured peak went over memory.max_mem
EXIT_NOTHING_FITS = 3  # `ckrun tune`: no plan fits under --max-mem (the same case as over the cap)
EXIT_NON_FINITE = 4  # `ckrun run`: the loss stopped being a number (fp16's skipped steps aside)
EXIT_CANNOT_WRITE = 5  # `ckrun run`: the output could not be written (disk full, I/O error)
EXIT_INTERNAL_ERROR = 1  # a bug, ours or in user code: one line, the traceback with -v
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports a process killed by it
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (`ckrun schema | head`): 128 + SIGPIPE, likewise


@dataclass(frozen=True)
class Place:
    """Where a value came from: `file:line:col`, or the override that set it."""

    file: str
    line: int = 0  # 1-based; 0 when unknown
    col: int = 0
    override: str | None = None

    def __str__(self) -> str:
        if self.override is not None:
            return f"override {self.override!r}"
        if self.line:
            return f"{self.file}:{self.line}:{self.col}"
        return self.file


@dataclass(frozen=True)
class Problem:
    place: Place
    key: str  # dotted path, e.g. "train.steps"; "" for the whole document
    message: str

    def __str__(self) -> str:
        key = f" {self.key}:" if self.key else ""
        return one_line(f"{self.place}:{key} {self.message}")


class InputError(Exception):
    """One or more problems with what the user gave us; the CLI prints them and exits 2."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


_LINE_BREAK = re.compile(r"\s*[\n\r\v\f\x1c-\x1e\x85\u2028\u2029]+\s*")
_MAX_LINE = 1000
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # controls; lone surrogates from undecodable argv


def one_line(text: str) -> str:
    """`text` as one printable line: line breaks (a library's multi-line message) become spaces,
    other control characters (from a file name or value) are shown escaped, as \\x00."""
    text = _LINE_BREAK.sub(" ", text.strip())
    if len(text) > _MAX_LINE:  # a megabyte-long value quoted in a message
        text = f"{text[: _MAX_LINE // 2]} ... {text[-_MAX_LINE // 2:]}"
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest choice, or '' when nothing is close."""
    choices = list(choices)
    same_but_case = [c for c in choices if str(c).lower() == str(word).lower()]  # radam: RAdam, not adamw
    close = same_but_case or difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def dotted(path: Iterable[object]) -> str:
    return ".".join(str(part) for part in path)


def keyed_error(err: ValueError, source: str, default_key: str) -> InputError:
    """An InputError from a ValueError whose text starts with the recipe key it is about
    ("memory.checkpointing.layers: block 30 is out of range ..."), as the memory plan raises them."""
    key, _, message = str(err).partition(": ")
    if not key.startswith(default_key) or " " in key:
        key, message = default_key, str(err)
    return InputError([Problem(Place(source), key, message)])
