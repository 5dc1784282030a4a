"""A rank never outlives what started it: no orphan that goes on training, checkpointing, exporting.

When `ckrun --nproc` (or torchrun, or the agent of a tune probe) is killed with SIGKILL it cannot
stop its ranks, and the kernel re-parents them to PID 1, where they would train on unsupervised
and race a `--resume` started meanwhile. So each rank asks the kernel to SIGKILL it when its
parent dies (Linux's PR_SET_PDEATHSIG, through prctl in libc). SIGKILL, not SIGTERM: a rank that
stopped gracefully would save and export, which is writing. A checkpoint cut short is invisible
(its COMPLETE marker comes last), so the newest complete one stays the one `--resume` takes.
Where prctl is missing (not Linux), a watchdog thread polls the parent's pid twice a second.

PR_SET_PDEATHSIG fires when the parent *thread* that forked the rank ends; torch's elastic agent
starts its workers from the thread that runs it (ckrun's main thread), which lives as long as the
launcher does. The launcher's pid is in CKRUN_LAUNCHER_PID: a launcher that died before the rank
asked is noticed at once (its pid is no longer the parent).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import re
import signal
import threading
import time

log = logging.getLogger(__name__)

LAUNCHER_ENV = "CKRUN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1
POLL_S = 0.5


_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|EPIPE|NCCL communicator was aborted|"
                        r"remote process exited|has been terminated|Connection refused", re.IGNORECASE)


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is this rank finding another rank gone (gloo's "Connection closed by peer"): the
    consequence of that rank's end, not a failure of this one. Only under a joined process group."""
    if "WORLD_SIZE" not in os.environ or not isinstance(err, RuntimeError):
        return False
    return bool(_PEER_LOST.search(str(err))) and ("gloo" in str(err).lower() or "nccl" in str(err).lower()
                                                   or type(err).__name__ == "DistBackendError")


def peer_lost_lines() -> list[str]:
    """A rank that lost a peer says nothing under ckrun's launcher, which names the rank that ended and why
    (it said "internal error: RuntimeError: ... gloo ... Connection closed by peer" first); under a
    torchrun of the user's, one line that points at the other rank."""
    if os.environ.get(LAUNCHER_ENV):
        return []
    return [f"ckrun: rank {os.environ.get('RANK', '?')} lost its connection to another rank, which ended first; "
            "that rank's own line (or torchrun's summary) says why"]


def die_with_parent() -> str:
    """Make this process die (SIGKILL) when its parent does; returns how, for the log."""
    parent = os.getppid()
    launcher = os.environ.get(LAUNCHER_ENV)
    how = "parent-death signal" if _pdeathsig(signal.SIGKILL) else _watch(parent)
    if launcher and launcher.isdigit() and int(launcher) != os.getppid():
        log.debug("the launcher (pid %s) is gone already", launcher)  # it died before we asked
        os.kill(os.getpid(), signal.SIGKILL)
    return how


def _pdeathsig(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum); False where libc or prctl is not there."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError, TypeError):
        return False


def _watch(parent: int) -> str:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()
    return f"a watchdog polling pid {parent}"
