"""output.dir that cannot be used, and a disk that fills up mid-run: one line, nothing lost.

Write failures are injected where the run meets the OS (os.open, os.write, torch.save) with the
errno a real full disk or read-only directory gives, so the code under test is the real path."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.output.directory import read_metrics_lines
from ckrun.runner.train.checkpoint.resume import truncate_metrics

GOOD = Path(BERT_TINY).read_text()
RUN = [BERT_TINY, *TINY_BERT, "train.steps=6", "output.checkpoint_every=2"]


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def unusable_dirs(tmp: Path) -> dict[str, tuple[Path, str]]:
    (tmp / "notes.txt").write_text("mine")
    return {
        "is a file": (tmp / "notes.txt", "is a file, not a directory"),
        "parent is a file": (tmp / "notes.txt" / "run", "Not a directory"),
        "name too long": (tmp / ("r" * 300), "File name too long"),
    }


@pytest.mark.parametrize("case", ["is a file", "parent is a file", "name too long"])
def test_an_unusable_output_dir_is_one_line_at_its_key(tmp_path, ckrun, case):
    out, expected = unusable_dirs(tmp_path)[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(GOOD.replace("  dir: runs/bert_tiny", f"  dir: {out}"))
    code, _, err = ckrun(recipe, *TINY_BERT, "train.steps=1")
    line = one_line(err)
    assert code == 2 and line.startswith(f"{recipe}:41:3: output.dir: ") and expected in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_read_only_output_dir_is_found_before_training(tmp_path, ckrun, monkeypatch):
    out = tmp_path / "locked"
    out.mkdir()
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):  # what a chmod 555 directory does (root ignores chmod)
        if str(path).startswith(str(out)) and flags & (os.O_WRONLY | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    code, _, err = ckrun(*RUN, f"output.dir={out}")
    line = one_line(err)
    assert code == 2 and line.startswith(f"override 'output.dir={out}': output.dir: cannot write {out}: Permission denied")
    assert list(out.iterdir()) == []


def full_disk_after(monkeypatch, name: str, writes: int, cut: int) -> None:
    """os.write to the file `name` succeeds `writes - 1` times, then writes `cut` bytes and fails as a full disk does."""
    real_write, count = os.write, [0]

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(name):
            count[0] += 1
            if count[0] == writes:
                real_write(fd, bytes(data)[: min(cut, len(data) - 1)])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory):
    from ckrun.runner.cli import main

    out = tmp_path_factory.mktemp("straight")
    assert main([*RUN, f"output.dir={out}"]) == 0
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds the metrics file's descriptor through /proc")
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=st.integers(1, 6), cut=st.integers(0, 200))
def test_a_full_disk_mid_run_loses_nothing_and_resume_goes_on(tmp_path_factory, ckrun, monkeypatch, straight_losses,
                                                               writes, cut):
    out = tmp_path_factory.mktemp("full") / "run"
    with monkeypatch.context() as patch:
        full_disk_after(patch, "metrics.jsonl", writes, cut)
        code, _, err = ckrun(*RUN, f"output.dir={out}")
    line = one_line(err)
    assert code == 5 and line.startswith(f"ckrun: cannot write {out}/metrics.jsonl: No space left on device;")
    assert "--resume" in line
    code, _, err = ckrun(*RUN, f"output.dir={out}", "--resume")
    assert code == 0, err
    assert [m["loss"] for m in read_metrics(out)] == straight_losses  # the partial line dropped, the rest re-run


def test_a_full_disk_during_a_checkpoint_keeps_the_one_before(tmp_path, ckrun, monkeypatch, straight_losses):
    out, real_save = tmp_path / "run", torch.save

    def save_fills_the_disk(obj, path, *args, **kwargs):
        if obj["step"] == 4:
            half = b"PK\x03\x04 half a checkpoint"
            path.write(half) if hasattr(path, "write") else Path(path).write_bytes(half)  # a file object or a path
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", save_fills_the_disk)
        code, _, err = ckrun(*RUN, f"output.dir={out}")
    assert code == 5 and one_line(err).startswith(f"ckrun: cannot write {out}/checkpoints/step-00000004: No space left")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002"]  # no temporary left behind
    assert ckrun(*RUN, f"output.dir={out}", "--resume")[0] == 0
    assert [m["loss"] for m in read_metrics(out)] == straight_losses


def test_a_run_stopped_at_the_cap_before_any_checkpoint_leaves_the_directory_usable(tmp_path, ckrun):
    out = tmp_path / "run"
    code, _, err = ckrun(*RUN, "memory.max_mem=1MB", f"output.dir={out}")
    assert code == 3, err
    code, _, err = ckrun(*RUN, f"output.dir={out}")  # no --resume needed: there was nothing to resume
    assert code == 0, err
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


records = st.lists(st.fixed_dictionaries({"loss": st.floats(0, 10), "lr": st.floats(0, 1)}), min_size=1, max_size=8)


@given(records=records, checkpoint=st.integers(0, 8), cut=st.floats(0, 1, exclude_max=True))
def test_resume_drops_a_partial_last_metrics_line(tmp_path_factory, records, checkpoint, cut):
    path = tmp_path_factory.mktemp("m") / "metrics.jsonl"
    lines = [json.dumps({"step": i, **r}) + "\n" for i, r in enumerate(records, 1)]
    whole = "".join(lines[:-1])
    last = lines[-1][: int(cut * len(lines[-1]))]  # cut anywhere inside the last line
    path.write_text(whole + last)
    truncate_metrics(path, checkpoint, "<recipe>")
    kept, unread = read_metrics_lines(path)
    readable = len(records) if last == lines[-1][:-1] else len(records) - 1  # only its newline lost: whole
    assert unread == 0
    assert [r["step"] for r in kept] == list(range(1, min(checkpoint, readable) + 1))
    assert all(json.loads(line, parse_constant=pytest.fail) for line in path.read_text().splitlines())


def test_every_attempt_that_ended_before_a_checkpoint_keeps_its_metrics(tmp_path, ckrun):
    out = tmp_path / "run"
    for _attempt in range(3):  # each stops at a NaN loss before its first checkpoint: the directory stays usable
        # a constant rate: the first step's update is already huge (a warm-up starts from 0, as transformers' does)
        assert ckrun(*RUN, "train.optimizer.lr=1e30", "train.grad_clip=null", "train.scheduler={name: constant}",
                     f"output.dir={out}")[0] == 4
    kept = sorted(p.name for p in out.glob("metrics.previous*.jsonl"))
    assert kept == ["metrics.previous-2.jsonl", "metrics.previous-3.jsonl", "metrics.previous.jsonl"]
    assert not (out / "metrics.jsonl").exists()


OUT_KINDS = {"absent": True, "empty folder": True, "link to a folder": True, "link to itself": False,
             "link to nothing": False, "loop of two links": False, "file": False, "fifo": False}
BEST_KINDS = {"absent": True, "empty folder": True, "ckrun's own": True, "user's file inside": False,
              "user's step-00000001": False, "file": False, "fifo": False, "link to a folder": False}


def _place_out(kind: str, tmp: Path) -> Path:
    out = tmp / "out"
    if kind in ("empty folder",):
        out.mkdir()
    elif kind == "link to a folder":
        (tmp / "real").mkdir()
        out.symlink_to(tmp / "real")
    elif kind == "link to itself":
        out.symlink_to(out)
    elif kind == "link to nothing":
        out.symlink_to(tmp / "gone")
    elif kind == "loop of two links":
        out.symlink_to(tmp / "other")
        (tmp / "other").symlink_to(out)
    elif kind == "file":
        out.write_text("mine")
    elif kind == "fifo":
        os.mkfifo(out)
    return out


def _place_best(kind: str, best: Path) -> None:
    from ckrun.runner.train.output.directory import EXPORT_HEADER

    if kind == "absent":
        return
    if kind in ("file", "fifo"):
        best.write_text("mine") if kind == "file" else os.mkfifo(best)
        return
    if kind == "link to a folder":
        (best.parent / "mine").mkdir()
        best.symlink_to(best.parent / "mine")
        return
    best.mkdir()
    if kind == "ckrun's own":  # what eval.best left: its ranking and an export
        (best / "step-00000001").mkdir()
        (best / "step-00000001" / "recipe.yaml").write_text(f"{EXPORT_HEADER} 1: the recipe\n")
        (best / "best.json").write_text('{"metric": "loss", "larger_is_better": false, "kept": []}\n')
    elif kind == "user's file inside":
        (best / "notes.txt").write_text("mine")
    elif kind == "user's step-00000001":
        (best / "step-00000001").mkdir()
        (best / "step-00000001" / "weights.bin").write_text("mine")


def _contents(tmp: Path) -> dict[str, str]:
    """Every file of the user's under `tmp`, with its text: what the run must leave as it was."""
    return {str(p.relative_to(tmp)): p.read_text() for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()
            and p.name in ("notes.txt", "weights.bin")}


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(out_kind=st.sampled_from(sorted(OUT_KINDS)), best_kind=st.sampled_from(sorted(BEST_KINDS)))
def test_what_sits_where_the_run_writes_is_refused_at_the_start_or_trained_past(out_kind, best_kind, ckrun,
                                                                                 tmp_path_factory):
    """output.dir and eval.best's OUTPUT_DIR/best: anything of the user's there is one line before step 1 (as a
    user's OUTPUT_DIR/model is), never found after training as an internal error, never deleted."""
    tmp = tmp_path_factory.mktemp("places")
    out = _place_out(out_kind, tmp)
    placed = OUT_KINDS[out_kind] and out.is_dir()  # absent: nothing to place the best folder in
    if placed:
        _place_best(best_kind, out / "best")
    usable = OUT_KINDS[out_kind] and (BEST_KINDS[best_kind] or not placed)
    before = _contents(tmp)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", f"output.dir={out}", "eval={every: 1, batches: 1, "
                         "best: {keep: 1}}")
    assert _contents(tmp) == before
    if usable:
        assert code == 0, (out_kind, best_kind, err)
        assert json.loads((out / "best" / "best.json").read_text())["kept"]
        return
    line = one_line(err)
    assert code == 2 and ("eval.best: " if OUT_KINDS[out_kind] else "output.dir: ") in line, (out_kind, best_kind, line)
    assert not placed or not (out / "metrics.jsonl").exists()
