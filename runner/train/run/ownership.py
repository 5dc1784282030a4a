"""A run owns its output.dir: OUTPUT_DIR/run.lock (runner/disk/lock.py), held for the run's whole life.

Who holds it: the one process of a single-process run; `ckrun --nproc`'s launcher (before any
rank starts, so a second launch is one line and starts nothing; its ranks find the lock theirs
through CKRUN_RUN_LOCK); rank 0 of a group started by torchrun or srun. A second run on the same
directory, `--resume` included, ends with one line naming the holder and exit 2, before anything
is written. In a group, rank 0 takes the lock right after the ranks join and every rank learns
the outcome before it writes: each ends with exit 2, and only rank 0 says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

from ...parallel.launch import check_launch, launch
from ...parallel.ranks import Ranks, any_rank
from ...parallel.slurm import allocation_hint, srun_step
from ...disk.lock import DirLock, LockHeld, refusal_text
from ...problems import InputError, Place, Problem
from ..output.directory import prepare_output
from ..checkpoint.resume import check_before_ranks

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
LOCK_ENV = "CKRUN_RUN_LOCK"  # the lock a launcher holds for its ranks
WHAT = "`ckrun` run"
FIX = "wait for it to end, or choose another directory with output.dir=..."


def _doing(out_dir: Path) -> str:
    return f"is training into {out_dir}"


@contextlib.contextmanager
def own_output(out_dir: Path, ranks: Ranks, source: str):
    """train(): hold output.dir for the block (rank 0, unless its launcher holds it already)."""
    lock, refusal = None, None
    if ranks.is_main and not _held_by_launcher(out_dir / LOCK_FILE):
        lock, refusal = _take(out_dir)
    if any_rank(refusal is not None, ranks):  # every rank, before any of them writes
        raise _refused(refusal, source) if refusal else InputError([])  # rank 0 says why
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def _refused(refusal: LockHeld, source: str) -> InputError:
    return InputError([Problem(Place(source), "output.dir", refusal_text(refusal, FIX))])


def _take(out_dir: Path) -> tuple[DirLock | None, LockHeld | None]:
    """(the lock, None), or (None, why another holds it or why what sits at run.lock is not taken). A
    directory that cannot hold a lock file (a file in its place, no permission) is left to
    prepare_output, which names the problem."""
    if os.path.lexists(out_dir) and not out_dir.is_dir():  # a file, a link to nothing or to itself: said there
        return None, None
    lock = DirLock(out_dir / LOCK_FILE, WHAT, _doing(out_dir), whole_directory=True)
    try:
        lock.acquire()
    except LockHeld as err:
        return None, err
    except OSError as err:
        log.warning("%s: cannot lock it (%s); training without the lock", out_dir, err.strerror or err)
        return None, None
    return lock, None


def _held_by_launcher(path: Path) -> bool:
    """Whether this rank's launcher (its parent) holds `path` for it."""
    if os.environ.get(LOCK_ENV) != str(path):
        return False
    holder = DirLock(path, WHAT, "").holder()
    return holder is not None and holder.pid == os.getppid() and holder.host == socket.gethostname()


def launch_owned(recipe, source: str, argv: list[str], nproc: int, resume: bool, verbose: bool = False,
                 accept_changes: bool = False) -> int:
    """`ckrun RECIPE --nproc N`: checked once, output.dir held by this launcher, then the ranks. Under
    srun with one task per node, node 0's launcher holds it for every node."""
    step = srun_step()
    check_launch(recipe, source, nproc, step)
    hint = allocation_hint(nproc) if step is None else None
    if hint:
        log.warning(hint)
    out_dir = Path(recipe.output.dir)
    if step is not None and step.node > 0:
        return launch(argv, nproc, verbose, step)
    lock, refusal = _take(out_dir)
    if refusal is not None:
        raise _refused(refusal, source)
    try:
        prepare_output(out_dir, resume, source, recipe)
        if resume:
            check_before_ranks(out_dir, recipe, source, accept_changes)
        if lock is not None:
            os.environ[LOCK_ENV] = str(lock.path)
        return launch(argv, nproc, verbose, step)
    finally:
        os.environ.pop(LOCK_ENV, None)
        if lock is not None:
            lock.release()
