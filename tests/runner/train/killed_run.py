"""`python -m killed_run ARGS`: `ckrun ARGS` that kills itself with SIGKILL as soon as its first
checkpoint is complete on disk (the save returned: renamed into place, marker written, synced).

What a machine that loses power or a kernel's OOM killer does to a run: no handler runs, nothing is
flushed or closed. tests/runner/train/test_every_plan.py forks it from a warm server (one import of
torch and transformers for every drawn plan); --resume then continues from that checkpoint."""

from __future__ import annotations

import os
import signal
import sys

import torch

from ckrun.runner.cli import main as ckrun
from ckrun.runner.train import loop


def killed_after_first_save(args: list[str]) -> int:
    torch.set_num_threads(1)  # as the test process (tests/conftest.py): the same kernels, the same losses
    save = loop.save_checkpoint

    def save_then_die(*positional, **named):
        saved = save(*positional, **named)
        os.kill(os.getpid(), signal.SIGKILL)
        return saved

    loop.save_checkpoint = save_then_die
    return ckrun(args)


if __name__ == "__main__":
    sys.exit(killed_after_first_save(sys.argv[1:]))
