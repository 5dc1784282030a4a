"""A run owns its output.dir: a second run on it while the first trains, `--resume` and `--nproc`
included, is one line naming the first, exit 2, and writes nothing (issue 25, defect 1: both used
to exit 0, writing every step twice into metrics.jsonl)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import children
from conftest import BERT_TINY, ROOT, TINY_BERT, read_metrics


def _snapshot(directory):
    """Every file but the two the first run writes on: metrics.jsonl, and the lock its heartbeat touches."""
    files = {path.name: path.stat().st_mtime_ns for path in directory.iterdir() if path.name != "metrics.jsonl"}
    lock = directory / "run.lock"
    return {**files, "run.lock": lock.read_text() if lock.exists() else None}


def test_a_second_run_on_a_directory_in_use_is_one_line_and_writes_nothing(ckrun, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "ckrun", BERT_TINY, *TINY_BERT, "train.steps=100000",
                              "output.checkpoint_every=0", f"output.dir={out}"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        children.wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, first, "step 2")
        before, lines = _snapshot(out), len(metrics.read_text().splitlines())
        for extra in (["--resume"], ["distributed.strategy=ddp", "--nproc", "2"], []):
            code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"output.dir={out}", *extra)
            assert code == 2, err
            assert err.count("\n") == 1, err  # one line; `--nproc` started no rank
            assert f"output.dir: another `ckrun` run (pid {first.pid}) is training into {out} since" in err
        assert _snapshot(out) == before  # no file of the second run's, none rewritten
        steps = [r["step"] for r in read_metrics(out)]
        assert len(steps) >= lines and steps == list(range(1, len(steps) + 1))  # every step once, none cut
    finally:
        first.kill()
        first.wait()


def test_what_sits_at_run_lock_is_refused_in_one_line_and_left_alone(ckrun, tmp_path):
    # a directory named run.lock used to be "training without the lock"; a link to a file, that file emptied
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data\n")
    for name, make in [("dir", lambda lock: lock.mkdir()), ("link", lambda lock: lock.symlink_to(precious))]:
        out = tmp_path / name
        out.mkdir()
        make(out / "run.lock")
        code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"output.dir={out}")
        lines = [line for line in err.splitlines() if not re.match(r"[WI]\d{4} ", line)]  # torch's import-time log
        assert code == 2 and len(lines) == 1, err
        kind = "a directory" if name == "dir" else "a symbolic link"
        assert f"output.dir: {out / 'run.lock'} is {kind}, not a lock file ckrun made;" in err
        assert sorted(p.name for p in out.iterdir()) == ["run.lock"]
    assert precious.read_text() == "the user's data\n"
