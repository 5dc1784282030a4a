"""Who holds a directory lock (lock.py): the record its holder writes into the lock file (host, pid,
the pid's start time, the host's boot id, what it runs and since when), read back strictly (a record
ckrun would not write is refused, never judged), and whether the process it names has ended, as far
as this host can tell."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

_MOST_PID = 1 << 30  # Linux allows 2**22 pids; a record naming more was not written by ckrun
RECORD_BYTES = 4096  # a record ckrun writes is a few hundred bytes


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
        return Holder(socket.gethostname(), os.getpid(), time.time(), what, start_ticks(os.getpid()), boot_id())

    @staticmethod
    def parse(text: str) -> Holder | None:
        """The record; None for an empty one, or a bare pid: the tune lock wrote only that and relied on
        the flock alone, so a free flock says its holder is gone. ValueError for anything ckrun would not
        have written (a pid of -1 or "abc", a file of the user's): it is neither judged nor emptied."""
        if not text.strip() or text.strip().isdigit():
            return None
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        holder = _holder(fields) if isinstance(fields, dict) else None
        if holder is None:
            raise ValueError(f"it holds {text.strip()[:40]!r}, not a record ckrun writes")
        return holder

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
        if self.boot and boot_id() and self.boot != boot_id():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # it runs, as another user
        now = start_ticks(self.pid)
        return None if now is None or self.ticks is None else now != self.ticks


def _holder(fields: dict) -> Holder | None:
    """A Holder from a record's fields when each has the type ckrun writes (unknown fields ignored: a
    newer ckrun's), else None."""
    def whole(value, low, high):
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    host, pid, started, what = (fields.get(key) for key in ("host", "pid", "started", "what"))
    ticks, boot = fields.get("ticks"), fields.get("boot")
    if not (isinstance(host, str) and host and whole(pid, 1, _MOST_PID) and isinstance(what, str)
            and isinstance(started, int | float) and not isinstance(started, bool) and math.isfinite(started)
            and (ticks is None or whole(ticks, -1, 1 << 62)) and (boot is None or isinstance(boot, str))):
        return None
    return Holder(host, pid, float(started), what, ticks, boot)


def start_ticks(pid: int) -> int | None:
    """The pid's start time in clock ticks since boot (Linux /proc); None where there is no /proc."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
