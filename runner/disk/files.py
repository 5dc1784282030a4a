"""Writing files that another process may read at the same moment."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of it (`ckrun report` reads while we tune;
    a run killed mid-write must leave metrics.jsonl and recipe.yaml whole for --resume)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: two writers never share one
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def save_torch(obj, path: Path) -> None:
    """`torch.save(obj, path)`, but a write the system refuses (a full disk, a file-size limit) raises
    its OSError: torch's native writer turns it into a RuntimeError without the errno ("unexpected
    pos"), which would be reported as an internal error instead of as output that could not be written."""
    import torch

    with open(path, "wb") as file:
        writer = _ErrorKeepingWriter(file)
        try:
            torch.save(obj, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


class _ErrorKeepingWriter:
    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


@contextlib.contextmanager
def os_errors_kept():
    """Native writers (safetensors) report an OS error as their own exception, "... (os error 27)":
    raise it as the OSError it is, so a full disk or a file-size limit is output that could not be written."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from err
