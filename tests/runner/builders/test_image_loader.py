"""ImageFolder batches decoded by DataLoader workers are the batches of the training process:
the same rows for every (seed, step), whatever the workers, the start step or a seek; a run
with workers trains to the same losses, resumed or not, and stops without leaving processes."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import children
from conftest import ROOT, read_metrics
from ckrun.runner.builders.data import Shape, epoch_rows
from ckrun.runner.builders.image_loader import ImageFolderSource, StepLoader, StepRows, choose_workers
from ckrun.runner.recipe.recipe import ImageFolderData
from test_data_faults import CNN_SMALL, image_recipe, image_root


def jpeg(seed: int, size: int) -> bytes:
    pixels = torch.randint(0, 256, (size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="JPEG")
    return out.getvalue()


def jpeg_root(tmp_path: Path, per_class: int = 5) -> Path:
    classes = {name: {f"{i}.jpg": jpeg(c * 100 + i, 12 + 3 * i) for i in range(per_class)}
               for c, name in enumerate(["ant", "bee", "cat"])}
    return image_root(tmp_path, classes)


def source(root: Path, workers: int, batch_size: int = 4, seed: int = 3) -> ImageFolderSource:
    data = ImageFolderData(source="image_folder", root=str(root), image_size=8, workers=workers)
    return ImageFolderSource(data, Shape("image_classification", False, num_classes=3, image_size=8), batch_size, seed)


def same(a, b) -> bool:
    return torch.equal(a.inputs["images"], b.inputs["images"]) and torch.equal(a.labels, b.labels)


def test_workers_give_the_batches_of_the_training_process(tmp_path):
    root = jpeg_root(tmp_path)
    in_process = source(root, workers=0)
    expected = [in_process.global_batch(step) for step in range(7)]  # 28 rows of 15: into the second epoch
    assert in_process.rows == 15  # what train.epochs counts
    with_workers, resumed = source(root, workers=2), source(root, workers=2)
    try:
        assert all(same(with_workers.global_batch(step), expected[step]) for step in range(7))
        assert all(same(resumed.global_batch(step), expected[step]) for step in range(4, 7))  # a resume at step 4
        assert same(with_workers.global_batch(1), expected[1])  # a seek back: the loader starts again there
        assert same(with_workers.global_batch(2), expected[2])
    finally:
        with_workers.close()
        resumed.close()
    assert with_workers.loader._batches is None


class Rows:
    """A dataset whose image is its row number: a batch shows exactly which rows it holds."""

    def __init__(self, count: int):
        self.count, self.samples = count, [(f"row-{i}", 0) for i in range(count)]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, row: int):
        return torch.tensor([float(row)]), row % 3


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), start=st.integers(0, 10**6), batch_size=st.integers(1, 9),
       count=st.integers(1, 23))
def test_a_loader_started_at_any_step_gives_that_steps_rows(seed, start, batch_size, count):
    sampler = iter(StepRows(count, batch_size, seed, start))
    loader = StepLoader(Rows(count), batch_size, seed, workers=0, prefetch=2, pin_memory=False)
    for step in range(start, start + 3):
        rows = epoch_rows(count, step, batch_size, seed)
        assert next(sampler) == rows
        images, labels = loader.batch(step)
        assert images.flatten().long().tolist() == rows and labels.tolist() == [r % 3 for r in rows]


def test_the_automatic_worker_count_is_logged_with_its_reason(caplog, monkeypatch):
    import ckrun.runner.builders.image_loader as image_loader

    caplog.set_level("INFO")
    for cores, expected in [(1, 0), (2, 0), (3, 2), (6, 5), (64, 8)]:
        monkeypatch.setattr(image_loader, "usable_cores", lambda cores=cores: cores)
        assert choose_workers(None) == expected
        assert f"{cores} CPU core" in caplog.records[-1].getMessage()
    assert choose_workers(3) == 3 and "data.workers says" in caplog.records[-1].getMessage()


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def evaluations(out: Path) -> list[tuple]:
    return [(r["step"], r["eval"]["loss"], r["eval"]["accuracy"]) for r in read_metrics(out) if "eval" in r]


def test_a_run_with_workers_trains_and_evaluates_as_one_without_and_resumes_exactly(tmp_path, ckrun):
    root = jpeg_root(tmp_path)
    recipe = image_recipe(tmp_path, root)

    def run(name: str, workers: int, steps: int, *more: str) -> None:
        held_out = f"{{source: image_folder, root: {root}, image_size: 32, workers: {workers}}}"
        code, _, err = ckrun(recipe, *CNN_SMALL[:-2], f"data.workers={workers}", f"train.steps={steps}",
                             f"eval={{every: 2, batches: 2, data: {held_out}}}", f"output.dir={tmp_path / name}", *more)
        assert code == 0, err

    run("in-process", 0, 5)
    run("workers", 2, 5)  # evaluation goes back to its first batch each time: its loader starts again there
    run("resumed", 2, 3)
    run("resumed", 2, 5, "--resume")
    assert losses(tmp_path / "workers") == losses(tmp_path / "in-process") == losses(tmp_path / "resumed")
    assert evaluations(tmp_path / "workers") == evaluations(tmp_path / "in-process")
    # the first attempt ended at step 3, and a run's last step is always evaluated
    assert evaluations(tmp_path / "workers") == [e for e in evaluations(tmp_path / "resumed") if e[0] != 3]
    assert len(losses(tmp_path / "workers")) == 5 and [e[0] for e in evaluations(tmp_path / "workers")] == [2, 4, 5]


def session_processes(session: int) -> list[int]:
    """The processes still alive (not zombies) in `session`, read from /proc."""
    alive = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[3]) == session and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize("stop", ["ctrl-c", "kill -9"])
def test_a_stopped_run_leaves_no_worker_behind(tmp_path, stop):
    """Ctrl-C is SIGINT to the whole process group, as a terminal sends it: workers ignore it, the run
    ends after a whole step (status 130, no traceback) and shuts them down. kill -9 leaves them no
    one to shut them down: they notice their parent is gone and exit."""
    recipe, out = image_recipe(tmp_path, jpeg_root(tmp_path)), tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-m", "ckrun", str(recipe), *CNN_SMALL[:-2], "data.workers=2",
                              "train.steps=100000", f"output.dir={out}"], stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        children.wait_until(lambda: metrics.is_file() and metrics.read_text().strip(), child, "step 1")
        assert len(session_processes(child.pid)) >= 3  # the run and its two workers
        if stop == "ctrl-c":
            os.killpg(child.pid, signal.SIGINT)
        else:
            child.kill()
        _, err = children.wait(child)
    finally:
        child.kill()
    if stop == "ctrl-c":
        assert child.returncode == 130, err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("ckrun: stopped by SIGINT after step ")
    deadline = time.monotonic() + 30  # torch's workers look for their parent every 5 s
    while session_processes(child.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert session_processes(child.pid) == []
