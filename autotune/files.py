"""The lock that keeps a second `ckrun tune` off a study that one is already running."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from runner.problems import InputError, Place, Problem


class StudyLock:
    """DIR/tune.lock, flock-ed while a tuner runs; it holds that tuner's pid for the refusal message.

    flock rather than "the file exists": the kernel drops the lock when the holder dies, so a
    tuner killed with SIGKILL never leaves a stale lock behind that would block `--resume`.
    """

    def __init__(self, directory: Path):
        self.path = directory / "tune.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InputError([Problem(Place(str(self.path.parent)), "", f"another `ckrun tune` (pid {holder}) is "
                                      "running this study; wait for it to finish, or give this one --output "
                                      "ANOTHER_DIR")]) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays, empty locks are harmless
            self._fd = None

    def __enter__(self) -> StudyLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
