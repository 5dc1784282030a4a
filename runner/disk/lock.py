"""A directory one ckrun process owns at a time: a run's output.dir (run.lock), a tune's study (tune.lock).

The lock is a file its holder flocks for as long as it runs and in which it records who it is (lock_holder.py):
host, pid, the pid's start time and the host's boot id, what it runs and since when; a thread
touches the file every HEARTBEAT_S seconds. The kernel drops a flock when its holder dies, so a
holder killed by SIGKILL blocks nobody. What it leaves is its record, and a record whose lock is
free is judged, then reported in a warning before it is taken over, never broken silently:
- on this host: the pid no longer runs, or runs another process (its start time differs), or the
  host rebooted since (another boot id): the holder is gone, for certain;
- from another host: ckrun cannot see that host's processes, and a network file system may not
  pass flocks between hosts. The heartbeat says what the kernel cannot: the lock is watched for
  three heartbeats, and only a record whose file no one touched in that time is taken over.
A live holder, or one whose state cannot be told, is refused with its record: the caller turns
that into one located line (exit 2) before anything is written.
On a file system without flock (ENOLCK: some NFS mounts), the record and its heartbeat are all
there is: two runs started within a moment of each other could both pass.

The lock file is one ckrun made, or nothing is written: a symbolic link at its path is never
followed (O_NOFOLLOW, and what was opened is checked to be what was looked at), and a directory,
FIFO, device, hard-linked file or a file holding something ckrun does not write is refused in one
line, never emptied. A record ckrun would not write (a pid of -1 or "abc") is refused the same way,
not judged. A run's output.dir is held whole (`whole_directory`): deleting run.lock while the run
trains lets no second run in.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ..environment import DURATIONS, HEARTBEAT_ENV, seconds
from .lock_holder import RECORD_BYTES, Holder
from ..problems import InputError, Place, Problem

log = logging.getLogger(__name__)

HEARTBEAT_S: float | None = None  # None: CKRUN_LOCK_HEARTBEAT_S, else 5 s (tests set a number)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def heartbeat_s() -> float:
    return HEARTBEAT_S if HEARTBEAT_S is not None else seconds(HEARTBEAT_ENV, DURATIONS[HEARTBEAT_ENV])


class LockHeld(Exception):
    """Someone else holds the lock (or may: a state that cannot be told is not taken over)."""


class LockRefused(LockHeld):
    """What sits at the lock's path is not a lock file ckrun made (a link, a directory, a file of the
    user's): ckrun neither writes nor empties it. The message says what to do."""


class DirLock:
    """`with DirLock(path, "`ckrun tune`", "is running this study"):` holds `path` for the block;
    LockHeld, saying who holds it in those words, when another does.

    `whole_directory`: the directory itself is flocked too, so deleting or replacing the lock file
    while the holder runs lets nobody in (the holder writes its record again on its next heartbeat).
    A run's output.dir is held so; a tune's study directory is not, because the training a tune ends
    with may write into that same directory and take its run lock there, from the same process."""

    def __init__(self, path: Path, what: str, doing: str, whole_directory: bool = False):
        self.path, self.what, self.doing, self.whole_directory = Path(path), what, doing, whole_directory
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._stop = threading.Event()
        self._swap = threading.Lock()  # the heartbeat may put a new record file in place of a deleted one

    def acquire(self) -> None:
        beat = heartbeat_s()  # a bad CKRUN_LOCK_HEARTBEAT_S is one line before anything is taken
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dir_fd = fd = None
        try:
            if self.whole_directory:
                dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                if _flock(dir_fd) is None:
                    raise self._held(self._peek())
            fd = _open_own(self.path)
            flocked = _flock(fd)
            if flocked is None:
                raise self._held(self._peek())
            self._judge(self._record(fd), fd, flocked)
            _write_record(fd, self.what)
        except BaseException:
            for each in (fd, dir_fd):  # closing drops a flock taken
                if each is not None:
                    os.close(each)
            raise
        self._fd, self._dir_fd, self._stop = fd, dir_fd, threading.Event()  # a new event: an old heartbeat keeps its own
        _HELD.update(each for each in (fd, dir_fd) if each is not None)
        threading.Thread(target=self._beat, args=(self._stop, beat), name=f"heartbeat {self.path.name}",
                         daemon=True).start()

    def _held(self, holder: Holder | None, detail: str = "") -> LockHeld:
        if holder is None:
            return LockHeld(f"another process {self.doing}{detail}")
        return LockHeld(f"another {holder.what} ({holder.words()}) {self.doing}{holder.since()}{detail}")

    def _record(self, fd: int) -> Holder | None:
        try:
            return _read(fd)
        except ValueError as err:
            raise LockRefused(f"{self.path} is not a lock ckrun wrote ({err}), and ckrun does not empty a file it did "
                              "not write: remove it if no ckrun is using the directory") from None

    def _peek(self) -> Holder | None:
        """The record of the holder that has the flock, to name it; None when it cannot be read."""
        try:
            return self.holder()
        except ValueError:
            return None

    def _judge(self, holder: Holder | None, fd: int, flocked: bool) -> None:
        """Refuse (LockHeld) unless the record is empty or provably left by a holder that has ended."""
        if holder is None:
            return
        gone = holder.gone_here()
        if gone is None and holder.host != socket.gethostname():
            self._judge_remote(holder, fd)
        elif gone is None:
            raise self._held(holder, f" (this host cannot tell whether pid {holder.pid} is still that process)")
        elif not gone:  # flocked: alive here, yet it let go of its flock without clearing its record
            raise self._held(holder, f" (it runs, though it no longer locks {self.path}: delete that file if it "
                             "is not using the directory)" if flocked else "")
        else:
            log.warning("%s: left by %s %s, which has ended (killed before it could let go); taking it over",
                        self.path, holder.what, holder.words())

    def _judge_remote(self, holder: Holder, fd: int) -> None:
        """Another host's record: its processes cannot be seen from here, its heartbeat can."""
        wait = 3 * heartbeat_s()
        beats = _beating(fd, wait)
        seen = f"ckrun cannot see {holder.host}'s processes, and its heartbeat in the lock " + (
            "beats" if beats else f"did not beat for {wait:.0f} s")
        if beats:
            raise self._held(holder, f" ({seen})")
        log.warning("%s: left by %s %s (%s): it has ended; taking it over", self.path, holder.what, holder.words(),
                    seen)

    def _beat(self, stop: threading.Event, every: float) -> None:
        """Touch the record (through the open file: never a path that may have become a link), and see
        that the path still names it."""
        said = False
        while not stop.wait(every):
            with self._swap:
                if self._fd is None:
                    return
                with contextlib.suppress(OSError, LockHeld):  # the directory went away: the holder's writes say so
                    os.utime(self._fd)
                    if not _names(self.path, self._fd):
                        said = self._lost(said)

    def _lost(self, said: bool) -> bool:
        """The record file was deleted or replaced under the holder: with the directory held, write it
        again where it is gone (a second run is refused either way); else say so, once."""
        if self.whole_directory and not os.path.lexists(self.path):
            fd = _open_own(self.path)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _write_record(fd, self.what)
            _HELD.discard(self._fd)
            os.close(self._fd)
            self._fd = fd
            _HELD.add(fd)
            log.warning("%s was deleted while this run held the directory; written again (the directory stays "
                        "locked)", self.path)
            return said
        if not said:
            log.warning("%s was %s while this process held it; %s", self.path,
                        "replaced" if os.path.lexists(self.path) else "deleted",
                        "the directory stays locked" if self.whole_directory else
                        "another process could now take it: do not delete a lock file in use")
        return True

    def holder(self) -> Holder | None:
        """The record in the lock file now (ours while we hold it); None when there is none to read.
        ValueError when the file holds what ckrun does not write. Never follows a link."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return _read(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
        finally:
            os.close(fd)

    def release(self) -> None:
        with self._swap:
            if self._fd is None:
                return
            self._stop.set()
            for fd in (self._fd, self._dir_fd):
                _HELD.discard(fd)
            os.ftruncate(self._fd, 0)  # an empty record: ended cleanly, nothing to judge (our own file, by its fd)
            os.close(self._fd)  # closing drops the flock; the empty file stays
            if self._dir_fd is not None:
                os.close(self._dir_fd)
            self._fd = self._dir_fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_HELD: set[int] = set()  # the lock files this process holds open


def _close_in_child() -> None:
    """A forked child (a data-loader worker) shares the holder's flock through the copied descriptor,
    and would hold the lock after a kill -9 of the holder until it noticed and exited: it lets go."""
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


@contextlib.contextmanager
def locked(path: Path, what: str, doing: str, fix: str, place: Place, key: str = ""):
    """Hold `path` for the block; when another holds it, one located line (`fix` says what to do)."""
    lock = DirLock(path, what, doing)
    try:
        lock.acquire()
    except LockHeld as err:
        raise InputError([Problem(place, key, refusal_text(err, fix))]) from None
    try:
        yield lock
    finally:
        lock.release()


def refusal_text(err: LockHeld, fix: str) -> str:
    """The line's text: who holds it and `fix`, or what sits at the lock's path and what to do with it."""
    return str(err) if isinstance(err, LockRefused) else f"{err}; {fix}"


def _flock(fd: int) -> bool | None:
    """True when flocked, None when another holds it, False when the file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            raise
        log.debug("no flock on this file system (%s): the lock's record and heartbeat decide", err.strerror)
        return False
    return True


def _open_own(path: Path) -> int:
    """The lock file, opened for reading and writing, created when missing; LockRefused for anything else
    at `path` (a symbolic link, which is never followed; a directory, FIFO or device; a file with other
    names, a hard link to a file that is not ckrun's)."""
    for _ in range(3):  # created or removed by another process between the look and the open: look again
        try:
            seen = os.lstat(path)
        except FileNotFoundError:
            seen = None
        if seen is not None and not stat.S_ISREG(seen.st_mode):
            raise LockRefused(_not_a_file(path, seen.st_mode))
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if seen is None else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except (FileExistsError, FileNotFoundError):
            continue
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise LockRefused(_not_a_file(path, stat.S_IFLNK)) from None
            raise
        found = os.fstat(fd)
        if seen is not None and (found.st_ino, found.st_dev) != (seen.st_ino, seen.st_dev):
            os.close(fd)
            continue
        if found.st_nlink > 1 or found.st_size > RECORD_BYTES:
            os.close(fd)
            why = f"has {found.st_nlink} names (a hard link)" if found.st_nlink > 1 else f"holds {found.st_size} bytes"
            raise LockRefused(f"{path} {why}, so it is not a lock file ckrun made, and ckrun writes into no file it did "
                              "not make: remove it if no ckrun is using the directory")
        return fd
    raise LockHeld(f"{path} kept changing while ckrun opened it: another process is taking it")


def _not_a_file(path: Path, mode: int) -> str:
    kinds = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
             stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
    kind = kinds.get(stat.S_IFMT(mode), "not a regular file")
    return (f"{path} is {kind}, not a lock file ckrun made; ckrun follows no link and writes into nothing it did "
            f"not make: remove or rename it")


def _names(path: Path, fd: int) -> bool:
    """Whether `path` (not followed) is the file open as `fd`."""
    try:
        at, open_ = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (at.st_ino, at.st_dev) == (open_.st_ino, open_.st_dev)


def _write_record(fd: int, what: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(asdict(Holder.me(what))) + "\n").encode(), 0)
    os.fsync(fd)


def _read(fd: int) -> Holder | None:
    return Holder.parse(os.pread(fd, RECORD_BYTES, 0).decode(errors="replace"))


def _beating(fd: int, window: float) -> bool:
    """Whether someone touches the file within `window` seconds: its holder's heartbeat."""
    before, deadline = os.fstat(fd).st_mtime_ns, time.monotonic() + window
    while time.monotonic() < deadline:
        time.sleep(min(0.5, window))
        if os.fstat(fd).st_mtime_ns != before:
            return True
    return False
