"""Located problems in user input, reported all at once, one line each, and every other way a
command ends on purpose.

Every user-facing error in ckrun is a `CkrunError`: it carries its exit status and the lines that
say it. Bad input is an `InputError` of `Problem`s: where it is (a file with line and column, or a
command-line override), the dotted key, and what to do; `KeyedError` is one problem whose key is
known where it is raised but whose line is not yet (runner/recipe/located.py finds it). The CLI's one
map (`ckrun.runner.cli.ending`) prints the lines and exits with the status; nothing here raises a
traceback at the user.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

# Every exit status ckrun gives, in one table: scripts and CI branch on them.
EXIT_BAD_INPUT = 2  # a Problem with what the user gave: one line each on stderr
EXIT_OVER_CAP = 3  # `ckrun run`: the measured peak went over memory.max_mem
EXIT_NOTHING_FITS = 3  # `ckrun tune`: no plan fits under --max-mem (the same case as over the cap)
EXIT_NON_FINITE = 4  # `ckrun run`: the loss stopped being a number (fp16's skipped steps aside)
EXIT_CANNOT_WRITE = 5  # `ckrun run`: the output could not be written (disk full, I/O error)
EXIT_INTERNAL_ERROR = 1  # a bug, ours or in user code: one line, the traceback with -v
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports a process killed by it
EXIT_BROKEN_PIPE = 141  # the reader of stdout went away (`ckrun schema | head`): 128 + SIGPIPE, likewise
EXIT_STATUSES = {EXIT_BAD_INPUT, EXIT_OVER_CAP, EXIT_NON_FINITE, EXIT_CANNOT_WRITE, EXIT_INTERNAL_ERROR,
                 EXIT_INTERRUPTED, EXIT_BROKEN_PIPE}


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


class CkrunError(Exception):
    """A command ended on purpose: `exit_status` for scripts, `lines()` for the person (one each)."""

    exit_status: int = EXIT_BAD_INPUT  # the class's; an instance may carry its own (the ranks' status)
    every_rank: ClassVar[bool] = True  # under torchrun: False when every rank ends alike and rank 0 says it for all

    def lines(self) -> list[str]:
        return [one_line(f"ckrun: {self}")]


class InputError(CkrunError):
    """One or more problems with what the user gave us; the CLI prints them and exits 2."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def lines(self) -> list[str]:
        return [str(problem) for problem in self.problems]


UNPLACED = Place("<recipe>")  # a key's line not known yet: runner/recipe/located.py puts it there


class KeyedError(InputError, ValueError):
    """One problem with the recipe key `key` (dotted, or a path of keys and list indices), raised
    where its line is not known: by a recipe validator (a ValueError, which pydantic collects), by
    the checks after the schema, or while building. `located_errors(doc)` places it."""

    def __init__(self, key: str | tuple[str | int, ...], message: str):
        self.path = key if isinstance(key, tuple) else tuple(int(k) if k.isdigit() else k for k in key.split("."))
        self.key, self.message = dotted(self.path), message
        super().__init__([Problem(UNPLACED, self.key, message)])

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # the arguments it was made from, not Exception's args, so it pickles
        return type(self), (self.key, self.message)

    def at(self, source: str) -> InputError:
        """This problem in the file `source` (its line unknown), for a caller outside `located_errors`."""
        return InputError([Problem(Place(source), self.key, self.message)])


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


def first_line(err: BaseException | str, limit: int = 300) -> str:
    """The first line of an error's message, cut to `limit`: what a one-line report quotes of a library's
    multi-line text. A line that only introduces the next ("Error(s) in loading state_dict for X:") comes
    with it; an error that says nothing is named by its type."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return "" if isinstance(err, str) else type(err).__name__
    return (" ".join(lines[:2]) if lines[0].endswith(":") else lines[0])[:limit]


def keyed_error(err: ValueError, source: str, default_key: str) -> InputError:
    """An InputError from a ValueError raised by runner/memory, whose text starts with the recipe key it
    is about ("memory.checkpointing.layers: block 30 is out of range ..."); a KeyedError keeps its key.
    Only for runner/memory's plan checks, until they raise KeyedError themselves."""
    if isinstance(err, KeyedError):
        return err.at(source)
    key, _, message = str(err).partition(": ")
    if not key.startswith(default_key) or " " in key:
        key, message = default_key, str(err)
    return InputError([Problem(Place(source), key, message)])
