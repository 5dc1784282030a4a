"""Ranks die with what started them (issue 25, defect 3: after kill -9 of `ckrun --nproc` the ranks
were re-parented to PID 1 and trained, checkpointed and exported on): within seconds, and nothing
is written after. The parent-death signal and the watchdog that stands in where there is no prctl."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import children
from conftest import ROOT
from ckrun.runner.disk.lock import DirLock

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=8", "train.device=cpu",
        "train.steps=100000", "output.checkpoint_every=3", "distributed.strategy=ddp"]

# a parent that starts a child asking to die with it, prints the child's pid, then waits
PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
child.wait()
"""
CHILD = """
import time
import ckrun.runner.parallel.supervise as supervise
if {watchdog}:
    supervise._pdeathsig = lambda signum: False  # as where there is no prctl
print(supervise.die_with_parent(), flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper that may never come in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float = 60) -> bool:
    """Waited for, not timed: a process that outlives its parent never goes, and a busy machine may take
    seconds to end one that does (a 5 s bound was within its reach)."""
    deadline = time.monotonic() + seconds
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_running(pid) for pid in pids)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("watchdog", [False, True], ids=["prctl", "watchdog"])
def test_a_supervised_process_dies_with_its_parent(watchdog):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKRUN_LAUNCHER_PID", None)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD.format(watchdog=watchdog)], env=env,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    how = parent.stdout.readline()  # the child's own line (it shares the parent's stdout): it has asked
    assert ("watchdog" in how) == watchdog, how
    parent.kill()
    parent.wait()
    assert _gone_within([child]), "the child outlived its parent"


def test_kill_9_of_the_launcher_takes_its_ranks_and_nothing_more_is_written(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "ckrun", STACK, *TINY, f"output.dir={out}", "--nproc", "2"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        children.wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 4, launcher,
                            "step 4")
        ranks = _children(launcher.pid)
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait()
        assert _gone_within(ranks), "ranks outlived their launcher"
        written = _files(out)
        time.sleep(2)
        assert _files(out) == written
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # whatever is left of its session: nothing when the test passes
    # the lock still names the dead launcher: the next run reports it and takes it over
    assert DirLock(out / "run.lock", "", "").holder().pid == launcher.pid
    with DirLock(out / "run.lock", "`ckrun` run", "trains"):
        pass
