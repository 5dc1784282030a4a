"""A run killed by a real signal from outside: SIGTERM ends it after a whole step with status 143,
and kill -9 at any moment of a checkpoint save leaves a directory that --resume continues to
exactly the losses of a run never killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import children
from conftest import BERT_TINY, ROOT, TINY_BERT, read_metrics
from ckrun.runner.disk import checkpoint_files
from ckrun.runner.cli import main
from ckrun.runner.train import loop
from ckrun.runner.train.checkpoint import store

RUN = [BERT_TINY, *TINY_BERT, "train.steps=6", "output.checkpoint_every=2"]


def test_sigterm_from_outside_ends_the_run_after_a_whole_step(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-m", "ckrun", *RUN[:-2], "train.steps=100000", "output.checkpoint_every=1",
                              f"output.dir={out}"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = out / "metrics.jsonl"
        children.wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, child, "step 2")
        child.send_signal(signal.SIGTERM)
        _, err = children.wait(child)
    finally:
        child.kill()
    assert child.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ckrun: stopped by SIGTERM after step ") and "`--resume` continues from step-" in last
    assert "Traceback" not in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and f"after step {steps[-1]} of 100000" in last
    # the stopped run ends as a finished one does: its last whole step saved and its model exported
    assert f"step-{steps[-1]:08d}" in last and store.complete_checkpoints(out / "checkpoints")[-1].name == f"step-{steps[-1]:08d}"
    assert (out / "model" / "config.json").is_file()


def traced_saves(count: list[int], moment: int | None):
    """loop.save_checkpoint, counting every line executed inside a save (ckrun's checkpoint code, the
    marker's digest, and torch.save's) into count[0], and SIGKILLing the process at line `moment`."""
    real_save = loop.save_checkpoint
    watched = {store.__file__, checkpoint_files.__file__, torch.serialization.__file__}

    def line(frame, event, _arg):
        if event == "line":
            count[0] += 1
            if count[0] == moment:
                os.kill(os.getpid(), signal.SIGKILL)
        return line

    def traced_save(*args, **kwargs):
        sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename in watched else None)
        try:
            return real_save(*args, **kwargs)
        finally:
            sys.settrace(None)

    return traced_save


def run_traced(moment: int | None, args: list[str], count_file: str) -> int:
    """In a fresh child process: ckrun with its saves traced (and SIGKILLed at line `moment`); the
    lines the saves executed go to count_file when the run ends."""
    count = [0]
    loop.save_checkpoint = traced_saves(count, moment)
    code = main(args)
    Path(count_file).write_text(str(count[0]))
    return code


def traced_child(moment: int | None, args: list[str], count_file: Path) -> subprocess.CompletedProcess:
    """`run_traced` in a new interpreter: a fork of the test process would inherit whatever the tests
    before it left behind (threads, patched modules), and the line counts of straight and killed runs
    must come from processes started alike."""
    paths = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).parent)]
    code = (f"import sys; sys.path[:0] = {paths!r}; import torch; torch.set_num_threads(1); import test_kill; "
            f"sys.exit(test_kill.run_traced({moment!r}, {[str(a) for a in args]!r}, {str(count_file)!r}))")
    return children.run([sys.executable, "-c", code])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of RUN never killed, and how many lines its three saves execute."""
    out = tmp_path_factory.mktemp("straight")
    child = traced_child(None, [*RUN, f"output.dir={out}"], out / "count")
    assert child.returncode == 0, child.stderr[-2000:]
    return [m["loss"] for m in read_metrics(out)], int((out / "count").read_text())


def check_kill_then_resume(tmp_path, capsys, straight, fraction: float) -> None:
    losses, lines = straight
    out, moment = tmp_path / "run", max(1, round(fraction * lines))
    child = traced_child(moment, [*RUN, f"output.dir={out}"], tmp_path / "count")
    assert child.returncode == -signal.SIGKILL, (child.returncode, child.stderr[-2000:])
    assert main([*RUN, f"output.dir={out}", "--resume"]) == 0, capsys.readouterr().err
    assert [m["loss"] for m in read_metrics(out)] == losses
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]  # a later save swept them


# three moments spread over the three saves by default (early, middle, the last lines); every 52nd of the
# lines, the first included, with -m slow (test_kill_9_at_52_moments_of_the_saves)
@pytest.mark.parametrize("fraction", [0.1, 0.45, 0.99])
def test_kill_9_during_a_checkpoint_save_then_resume_gives_the_same_losses(tmp_path, capsys, straight, fraction):
    check_kill_then_resume(tmp_path, capsys, straight, fraction)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [i / 52 for i in range(52)])
def test_kill_9_at_52_moments_of_the_saves(tmp_path, capsys, straight, fraction):
    check_kill_then_resume(tmp_path, capsys, straight, fraction)
