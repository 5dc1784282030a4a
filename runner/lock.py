"""A directory one ckrun process owns at a time: a run's output.dir (run.lock), a tune's study (tune.lock).

The lock is a file its holder flocks for as long as it runs and in which it records who it is:
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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .problems import InputError, Place, Problem

log = logging.getLogger(__name__)

HEARTBEAT_S = float(os.environ.get("CKRUN_LOCK_HEARTBEAT_S", "5"))
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class LockHeld(Exception):
    """Someone else holds the lock (or may: a state that cannot be told is not taken over)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: float  # time.time() when it took the lock
    what: str  # `ckrun tune`, `ckrun` run
    ticks: int | None = None  # the pid's start time (/proc), so a reused pid is not mistaken for it
    boot: str | None = None  # the host's boot id: after a reboot no pid of the record runs

    @staticmethod
    def me(what: str) -> Holder:
        return Holder(socket.gethostname(), os.getpid(), time.time(), what, _start_ticks(os.getpid()), _boot_id())

    @staticmethod
    def parse(text: str) -> Holder | None:
        """The record; None for an empty one, or a bare pid: the tune lock wrote only that and relied on
        the flock alone, so a free flock says its holder is gone."""
        if not text.strip() or text.strip().isdigit():
            return None
        try:
            return Holder(**json.loads(text))
        except (ValueError, TypeError):
            return Holder("?", 0, 0.0, f"process that wrote {text.strip()[:40]!r}")  # judged by its heartbeat

    def words(self) -> str:
        return f"pid {self.pid}" + ("" if self.host == socket.gethostname() else f" on {self.host}")

    def since(self) -> str:
        if not self.started:
            return ""
        when = time.localtime(self.started)
        today = time.strftime("%Y-%m-%d") == time.strftime("%Y-%m-%d", when)
        return time.strftime(" since %H:%M" if today else " since %Y-%m-%d %H:%M", when)

    def gone_here(self) -> bool | None:
        """Whether this host's holder has ended: True, False, or None when this host cannot tell."""
        if self.host != socket.gethostname():
            return None
        if self.boot and _boot_id() and self.boot != _boot_id():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
        now = _start_ticks(self.pid)
        return None if now is None or self.ticks is None else now != self.ticks


class DirLock:
    """`with DirLock(path, "`ckrun tune`", "is running this study"):` holds `path` for the block;
    LockHeld, saying who holds it in those words, when another does."""

    def __init__(self, path: Path, what: str, doing: str):
        self.path, self.what, self.doing = Path(path), what, doing
        self._fd: int | None = None
        self._stop = threading.Event()

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            flocked = _flock(fd, self._held)
            self._judge(_read(fd), fd, flocked)
        except BaseException:
            os.close(fd)  # closing drops the flock, if it was taken
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(Holder.me(self.what))) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd, self._stop = fd, threading.Event()  # a new event: an old heartbeat thread keeps its own
        _HELD.add(fd)
        threading.Thread(target=self._beat, args=(self._stop,), name=f"heartbeat {self.path.name}", daemon=True).start()

    def _held(self, holder: Holder | None, detail: str = "") -> LockHeld:
        if holder is None:
            return LockHeld(f"another process {self.doing}{detail}")
        return LockHeld(f"another {holder.what} ({holder.words()}) {self.doing}{holder.since()}{detail}")

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
        beats = _beating(fd, 3 * HEARTBEAT_S)
        seen = f"ckrun cannot see {holder.host}'s processes, and its heartbeat in the lock " + (
            "beats" if beats else f"did not beat for {3 * HEARTBEAT_S:.0f} s")
        if beats:
            raise self._held(holder, f" ({seen})")
        log.warning("%s: left by %s %s (%s): it has ended; taking it over", self.path, holder.what, holder.words(),
                    seen)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass  # the directory went away: the holder's own writes will say so

    def holder(self) -> Holder | None:
        """The record in the lock file now (ours while we hold it)."""
        try:
            return Holder.parse(self.path.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            return None

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        _HELD.discard(self._fd)
        os.ftruncate(self._fd, 0)  # an empty record: ended cleanly, nothing to judge
        os.close(self._fd)  # closing drops the flock; the empty file stays
        self._fd = None

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
        raise InputError([Problem(place, key, f"{err}; {fix}")]) from None
    try:
        yield lock
    finally:
        lock.release()


def _flock(fd: int, held) -> bool:
    """True when flocked, False when the file system has no flock; `held(holder)` raised when another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise held(_read(fd)) from None
    except OSError as err:
        if err.errno not in _NO_FLOCK:
            raise
        log.debug("no flock on this file system (%s): the lock's record and heartbeat decide", err.strerror)
        return False
    return True


def _read(fd: int) -> Holder | None:
    return Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))


def _beating(fd: int, seconds: float) -> bool:
    """Whether someone touches the file within `seconds`: its holder's heartbeat."""
    before, deadline = os.fstat(fd).st_mtime_ns, time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.5, seconds))
        if os.fstat(fd).st_mtime_ns != before:
            return True
    return False


def _start_ticks(pid: int) -> int | None:
    """The pid's start time in clock ticks since boot (Linux /proc); None where there is no /proc."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
