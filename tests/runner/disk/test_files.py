"""Writes the system refuses (a full disk, a file-size limit) keep their errno through native writers,
so a run reports them as output it could not write (status 5), not as an internal error (1)."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.disk.files import os_errors_kept, save_torch

ROOT = Path(__file__).resolve().parents[3]


def test_save_torch_raises_the_os_error_behind_torchs_runtime_error(tmp_path, monkeypatch):
    real_open = open

    class Full:
        def __init__(self, file):
            self.file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr("builtins.open", lambda *args, **kwargs: Full(real_open(*args, **kwargs)))
    with pytest.raises(OSError) as raised:
        save_torch({"w": torch.zeros(1000)}, tmp_path / "state.pt")
    assert raised.value.errno == errno.ENOSPC  # torch.save alone: RuntimeError "unexpected pos"


def test_a_native_writers_os_error_becomes_an_os_error():
    with pytest.raises(OSError) as raised, os_errors_kept():
        raise RuntimeError("Error while serializing: I/O error: File too large (os error 27)")  # safetensors' words
    assert raised.value.errno == errno.EFBIG


def test_a_file_size_limit_while_saving_is_status_5(tmp_path):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # the checkpoint is larger

    done = subprocess.run([sys.executable, "-m", "ckrun", BERT_TINY, *TINY_BERT, "train.steps=1",
                           f"output.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                          preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 5, done.stderr
    assert "File too large; everything before it is kept: raise the file-size limit" in done.stderr.splitlines()[-1]
