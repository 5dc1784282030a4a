"""Bounds on the processes tests start, based on progress rather than on the clock.

A bound exists to catch a hang, not slowness: on a busy machine (load 20 on 2 cores) a run that
takes 20 s idle takes minutes, and a fixed 120 s or 300 s timeout failed the suite there. A child
counts as hung when its whole process tree (probes and ranks in sessions of their own included)
has used no CPU time for STALL_S seconds; a slow child still uses some, so it is waited for, up to
pytest's own per-test timeout (pyproject's `--timeout`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

STALL_S = float(os.environ.get("CKRUN_TEST_STALL_S", "180"))
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds of `root` and its descendants (children they reaped included); None without /proc."""
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
    if not stats:
        return None
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += sum(int(value) for value in stats[pid][11:15])  # utime stime cutime cstime
        todo += children.get(pid, [])
    return total / _TICKS


class Watch:
    """Says when a child's tree stopped using CPU for `stall_s` seconds."""

    def __init__(self, pid: int, stall_s: float = STALL_S):
        self.pid, self.stall_s = pid, stall_s
        self.last, self.since = tree_cpu_seconds(pid), time.monotonic()

    def stalled(self) -> bool:
        now = tree_cpu_seconds(self.pid)
        if now != self.last:
            self.last, self.since = now, time.monotonic()
        return time.monotonic() - self.since > self.stall_s


def wait(process: subprocess.Popen, stall_s: float = STALL_S) -> tuple[str | None, str | None]:
    """process.communicate(), killing the child's tree (its session, when it leads one) and failing
    the test when it hangs."""
    watch = Watch(process.pid, stall_s)
    while True:
        try:
            return process.communicate(timeout=1)
        except subprocess.TimeoutExpired:
            if watch.stalled():
                _kill(process)
                out, err = process.communicate()
                raise AssertionError(f"{process.args} used no CPU for {stall_s:.0f} s: hung; its stderr ends "
                                     f"{(err or '')[-2000:]}") from None


def run(args, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(args, capture_output=True, text=True, ...) bounded by progress, not by the clock."""
    kwargs.setdefault("text", True)
    check = kwargs.pop("check", False)
    if not kwargs.pop("capture_output", True):
        kwargs.setdefault("stdout", subprocess.DEVNULL)
    process = subprocess.Popen(args, stdout=kwargs.pop("stdout", subprocess.PIPE), stderr=subprocess.PIPE, **kwargs)
    out, err = wait(process)
    done = subprocess.CompletedProcess(args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def wait_until(condition, process: subprocess.Popen, what: str, stall_s: float = STALL_S) -> None:
    """Poll `condition` while `process` runs and makes progress; fail when it ended or hung first."""
    watch = Watch(process.pid, stall_s)
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the child ended before {what}: status {process.returncode}")
        if watch.stalled():
            raise AssertionError(f"the child used no CPU for {stall_s:.0f} s before {what}: hung")
        time.sleep(0.2)


def _kill(process: subprocess.Popen) -> None:
    try:
        if os.getpgid(process.pid) == process.pid:  # it leads a session or group of its own: take all of it
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except ProcessLookupError:
        pass
