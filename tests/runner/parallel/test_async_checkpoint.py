"""Checkpoints of a group are written behind training (DCP's async_save): the step pays only for
staging, training goes on while the shards are written, and a kill during that write leaves the
previous complete checkpoint, since COMPLETE is written only once every rank's write has finished."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import children
from conftest import ROOT, read_metrics
from ckrun.runner.disk.checkpoint_files import MARKER
from ckrun.runner.cli import main
from ckrun.runner.train.checkpoint.store import complete_checkpoints

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "model.config.dropout=0.0", "data.seq_len=16", "data.vocab_size=64",
        "train.batch_size=8", "train.device=cpu", "output.checkpoint_every=4", "distributed.strategy=fsdp"]
SLOW_WRITER = Path(__file__).parent / "slow_writer"


def _wait_for_step(metrics: Path, step: int, process: subprocess.Popen) -> None:
    """Until metrics.jsonl has `step`; failing when no step comes for STALL_S: the launcher's agent polls
    all the time, so a training blocked on its save would never look hung to children.wait_until."""
    steps, since = 0, time.monotonic()
    while steps < step:
        assert process.poll() is None, f"the run ended at step {steps}: status {process.returncode}"
        now = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        steps, since = now, since if now == steps else time.monotonic()
        assert time.monotonic() - since < children.STALL_S, f"training stopped at step {steps}"
        time.sleep(0.2)


def test_training_goes_on_while_a_checkpoint_is_written_and_a_kill_then_leaves_the_previous_one(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SLOW_WRITER)]), "OMP_NUM_THREADS": "1",
           "CKRUN_SLOW_WRITE": "8:600"}  # the checkpoint of step 8 takes ten minutes to write
    launcher = subprocess.Popen([sys.executable, "-m", "ckrun", STACK, *TINY, "train.steps=100000",
                                 f"output.dir={out}", "--nproc", "2"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_step(out / "metrics.jsonl", 11, launcher)
        in_flight = out / "checkpoints" / ".tmp-step-00000008-dcp"
        assert in_flight.is_dir() and not (in_flight / MARKER).exists()  # steps 9-11 ran while it was written
        launcher.kill()  # its ranks die with it (runner/parallel/supervise.py)
        launcher.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert [c.name for c in complete_checkpoints(out / "checkpoints")] == ["step-00000004"]
    code = main([STACK, *TINY, "train.steps=6", f"output.dir={out}", "--resume"])  # one process takes it up
    assert code == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
