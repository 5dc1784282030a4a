"""What a run writes into output.dir, the interface every output of its records keeps (`Sink`), and
the one line that explains when a write fails.

Two kinds of write failure, told apart by errno. The directory itself being unusable (a file
where a folder should be, a name too long, no permission) is the recipe's output.dir to change:
an InputError, exit 2. Running out of space or an I/O error mid-run is the machine's state: an
OutputError naming the file and what to do, with everything written before it intact (metrics
lines are appended whole or dropped on resume; checkpoints are atomic).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from ...disk.files import write_atomic
from ...problems import EXIT_CANNOT_WRITE, CkrunError, InputError, Place, Problem, one_line
from ...recipe.recipe import Recipe
from ..checkpoint.store import complete_checkpoints

log = logging.getLogger(__name__)

METRICS = "metrics.jsonl"
MODEL_DIR = "model"  # the export (runner/train/output/export.py)
BEST_DIR, BEST_RANKING = "best", "best.json"  # eval.best's exports and their ranking (runner/train/eval/best.py)
EXPORT_HEADER = "# exported by ckrun after step"  # the first line of the recipe.yaml every export carries
SET_ASIDE = "metrics.previous.jsonl"  # the metrics of an attempt that left nothing to resume from
_MACHINE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


class OutputError(CkrunError, OSError):
    """A write into output.dir failed for a reason outside the recipe (disk full, I/O error)."""

    exit_status = EXIT_CANNOT_WRITE

    def lines(self) -> list[str]:
        return [one_line(f"ckrun: {self.strerror}")]


def write_failure(err: OSError, path: Path, source: str) -> Exception:
    """The exception to raise for `err` while writing `path`: OutputError or an output.dir InputError."""
    reason = err.strerror or str(err)
    if err.errno in _MACHINE_ERRORS:
        fix = ("raise the file-size limit (ulimit -f)" if err.errno == errno.EFBIG
               else "free space (or fix the disk)")
        return OutputError(err.errno, f"cannot write {path}: {reason}; everything before it is kept: {fix}, "
                           "then continue with --resume")
    return InputError([Problem(Place(source), "output.dir", f"cannot write {path}: {reason}; choose another "
                               "directory with output.dir=...")])


def prepare_output(out_dir: Path, resume: bool, source: str, recipe: Recipe | None = None) -> None:
    """Refuse to overwrite a finished or running run unless resuming it, or anything of the user's where the
    run will write (`recipe`'s eval.best folder too); make the directory."""
    try:
        _check_output_dir(out_dir, resume, source)
        if recipe is not None and recipe.eval is not None and recipe.eval.best is not None:
            _check_best_dir(out_dir / BEST_DIR, source)
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".ckrun-write-test-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644))  # a read-only directory: found now, not after step 1
        probe.unlink()
    except OSError as err:  # even asking whether a too-long name exists raises
        raise write_failure(err, out_dir, source) from None


def _check_output_dir(out_dir: Path, resume: bool, source: str) -> None:
    if out_dir.is_symlink() and not out_dir.exists():  # exists() follows it: a loop or a dangling link
        raise InputError([Problem(Place(source), "output.dir", f"{out_dir} is a symbolic link to "
                                  f"{os.readlink(out_dir)}, which {_unresolved(out_dir)}; point it at a directory, or "
                                  "choose another directory with output.dir=...")])
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError([Problem(Place(source), "output.dir", f"{out_dir} is a file, not a directory; "
                                  "choose another directory with output.dir=...")])
    if holds_run(out_dir) and not resume:
        raise InputError([Problem(Place(source), "output.dir", f"{out_dir} already holds a run; pass --resume to "
                                  f"continue it, or choose another directory with output.dir=...")])
    export = out_dir / MODEL_DIR
    if os.path.lexists(export) and not is_export(export):  # found now: the run's end would have to keep it
        raise InputError([Problem(Place(source), "output.dir", f"{export} is not a model ckrun exported, and the "
                                  "run exports its model there; move it, or choose another directory with "
                                  "output.dir=...")])


def _unresolved(link: Path) -> str:
    """Why a link leads to no file: it names itself, it ends in a loop, or what it names is not there."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # pathlib's "Symlink loop" before Python 3.13
        return "leads back to itself"
    except OSError as err:
        return "leads back to itself" if err.errno == errno.ELOOP else "does not exist"
    return "does not exist"


def _check_best_dir(best: Path, source: str) -> None:
    """eval.best keeps exports in OUTPUT_DIR/best and deletes the ones that fall out of the top k: a folder
    there that holds anything but what it keeps (best.json, exports ckrun wrote, a save cut short) is the
    user's, refused now, as a user's OUTPUT_DIR/model is, not found after training."""
    if not os.path.lexists(best):
        return
    if best.is_symlink() or not best.is_dir():
        what = "a symbolic link" if best.is_symlink() else "a file"
        raise InputError([Problem(Place(source), "eval.best", f"{best} is {what}, and eval.best keeps the best weights "
                                  "in a folder there; move it, or choose another directory with output.dir=...")])
    foreign = next((entry for entry in sorted(best.iterdir()) if not _kept_by_best(entry)), None)
    if foreign is not None:
        raise InputError([Problem(Place(source), "eval.best", f"{best} holds {foreign.name}, which ckrun did not write, "
                                  "and eval.best keeps its exports there and deletes those that fall out; move it, or "
                                  "choose another directory with output.dir=...")])


def _kept_by_best(entry: Path) -> bool:
    """What eval.best writes into its folder (runner/train/eval/best.py): the ranking, the exports, and a save
    a kill cut short (a hidden temporary beside its final name)."""
    name = entry.name
    if name == BEST_RANKING and entry.is_file() and not entry.is_symlink():
        return True
    if name.startswith(".") and (name.endswith(".tmp") or ".tmp-" in name or ".old-" in name):
        return True
    return re.fullmatch(r"step-\d{8}", name) is not None and is_export(entry)


def is_export(directory: Path) -> bool:
    """Whether `directory` is a model ckrun exported (a real directory whose recipe.yaml starts with
    ckrun's header), which a later export of the same run may replace; anything else is the user's."""
    from ...builders.pretrained import EXPORT_RECIPE

    recipe = directory / EXPORT_RECIPE
    if directory.is_symlink() or not directory.is_dir() or recipe.is_symlink() or not recipe.is_file():
        return False
    try:
        with recipe.open("rb") as file:
            return file.read(len(EXPORT_HEADER)) == EXPORT_HEADER.encode()
    except OSError:
        return False


def holds_run(out_dir: Path) -> bool:
    """A complete checkpoint, or at least one whole line of metrics (an empty file is no run)."""
    metrics = out_dir / METRICS
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return has_metrics or bool(complete_checkpoints(out_dir / "checkpoints"))


def set_aside_unresumable(out_dir: Path) -> None:
    """After an attempt that wrote no checkpoint, nothing can be resumed: keep its metrics under
    another name so the directory takes a fresh run without --resume."""
    metrics = out_dir / METRICS
    if complete_checkpoints(out_dir / "checkpoints") or not metrics.is_file():
        return
    try:
        if metrics.stat().st_size == 0:
            metrics.unlink()
            return
        kept = _free_name(out_dir / SET_ASIDE)
        os.rename(metrics, kept)
    except OSError as err:  # already failing: say it, do not hide the first error behind a second
        log.warning("could not move %s aside: %s", metrics, err.strerror or err)
        return
    log.info("no checkpoint was written, so there is nothing to resume: this attempt's metrics are kept as %s, "
             "and %s takes a new run without --resume", kept, out_dir)


def _free_name(path: Path) -> Path:
    """`path`, or path-2, path-3 ... : an earlier attempt's metrics are never overwritten."""
    number, candidate = 1, path
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name.removesuffix('.jsonl')}-{number}.jsonl")
    return candidate


def strict_record(record: dict) -> dict:
    """`record` with NaN and infinities as null, nested records (eval) too: metrics.jsonl stays JSON
    that every parser reads."""
    return {k: _strict(v) for k, v in record.items()}


def _strict(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return strict_record(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class RunInfo:
    """What a sink learns of the run when it opens."""

    out_dir: Path
    recipe: Recipe
    source: str  # the recipe's file, for located lines
    first_step: int  # 0, or the checkpoint step a resumed run continues after: records come from first_step + 1


Ended = Literal["finished", "stopped", "failed"]  # a run that ran its steps, one a signal stopped, one an error ended


class Sink(Protocol):
    """Where the loop's records go: one per step (`{"step", "loss", "lr", ...}`), one per evaluation
    (`{"step", "eval": {...}}`), and after a --resume-changed resume one `{"step", "resumed_with_changes"}`.
    runner/train/output/sinks.py opens the ones a recipe chooses; records come in step order."""

    def open(self, run: RunInfo) -> None: ...

    def write(self, record: dict) -> None: ...

    def close(self, ended: Ended) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers as the trackers name them: `train/loss`, `train/lr`, ... or `eval/perplexity`."""
    group, values = ("eval", record["eval"]) if isinstance(record.get("eval"), dict) else ("train", record)
    return {f"{group}/{key}": value for key, value in values.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}


class MetricsLog:
    """metrics.jsonl, one record per line, each line written by one append so that a failed write
    leaves at most a partial last line (which resume drops), never a damaged earlier one. The one
    sink every run has: its failure ends the run (OutputError, status 5)."""

    def open(self, run: RunInfo) -> None:
        self.path, self.source = run.out_dir / METRICS, run.source
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise write_failure(err, self.path, self.source) from None

    def write(self, record: dict) -> None:
        line = (json.dumps(strict_record(record), allow_nan=False) + "\n").encode("utf-8")
        try:
            written = os.write(self.fd, line)
            while written < len(line):
                written += os.write(self.fd, line[written:])
        except OSError as err:
            raise write_failure(err, self.path, self.source) from None

    def close(self, ended: Ended) -> None:
        os.close(self.fd)


def read_metrics_lines(path: Path) -> tuple[list[dict], int]:
    """The records of metrics.jsonl and how many lines could not be read (a partial last line
    from a full disk or a kill). NaN tokens that older versions wrote are read as null."""
    records, unread = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=lambda _token: None)
        except ValueError:
            unread += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        else:
            unread += 1
    return records, unread


def write_output(path: Path, text: str, source: str) -> None:
    """write_atomic, with a failure (disk full, read-only) as one located line."""
    try:
        write_atomic(path, text)
    except OSError as err:
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                stale.unlink()
        raise write_failure(err, path, source) from None