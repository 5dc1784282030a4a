"""Two ranks on the CPU (gloo) through the real CLI, `ckrun RECIPE --nproc 2`: DDP and FSDP2 train the
same losses as one process at the same global batch, a checkpoint is complete only once every rank's
shards are on disk (a kill -9 of either rank mid-save leaves the previous one to resume from), and a
checkpoint of 2 ranks resumes on 1.

Tolerance: every loss within 1e-5 relative of the single-process run. Dropout is off, so the only
difference is the order of fp32 sums (a rank's half batch, then the all-reduce). SGD, because Adam
divides each gradient by its own running size and so blows a last-bit difference in a near-zero
gradient up to a whole step (AdamW measured 3e-5 relative by step 3 with micro-batch 2). Measured
with SGD on torch 2.14.1 CPU: at most 1.1e-7 relative over 4 steps, DDP and FSDP alike.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import children
from conftest import ROOT, read_metrics
from ckrun.runner.cli import main
from ckrun.runner.train.checkpoint.store import complete_checkpoints

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
# 2 blocks of width 16: a step is milliseconds, so a run is mostly the ranks' start-up
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "model.config.dropout=0.0", "data.seq_len=16", "data.vocab_size=64",
        "train.batch_size=8", "train.device=cpu", "train.steps=4", "output.checkpoint_every=2",
        "output.keep_checkpoints=3", "train.optimizer={name: sgd, lr: 0.5}", "precision=fp32"]
TOLERANCE = 1e-5
KILL_HOOK = Path(__file__).parent / "kill_hook"


def ckrun_process(*args, kill: str | None = None) -> subprocess.Popen:
    """`ckrun ARGS` in its own process: the launcher installs torchrun's signal handlers, not for pytest."""
    paths = [str(ROOT), *([str(KILL_HOOK)] if kill else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "OMP_NUM_THREADS": "1"}
    env.pop("CKRUN_KILL", None)
    if kill:
        env["CKRUN_KILL"] = kill
    return subprocess.Popen([sys.executable, "-m", "ckrun", *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    _, err = children.wait(process)
    return process.returncode, err


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), (got, want)
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= TOLERANCE * abs(b), (got, want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process for 6 steps; DDP (micro-batch 2 of a rank's 4) and FSDP on 2 ranks for 4, at once."""
    base = tmp_path_factory.mktemp("ranks")
    started = {
        "ddp": ckrun_process(STACK, *TINY, "distributed.strategy=ddp", "memory.micro_batch=2", f"output.dir={base / 'ddp'}",
                             "--nproc", 2),
        "fsdp": ckrun_process(STACK, *TINY, "distributed.strategy=fsdp", f"output.dir={base / 'fsdp'}", "--nproc", 2),
    }
    assert main([STACK, *TINY, "train.steps=6", f"output.dir={base / 'single'}"]) == 0
    for process in started.values():
        code, err = finish(process)
        assert code == 0, err
    return base


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_train_the_losses_of_one_process(runs, strategy):
    records = read_metrics(runs / strategy)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # rank 0 alone writes, once per step
    assert all(r["world_size"] == 2 and r["peak_mem_bytes"] > 0 for r in records)
    assert_close(losses(runs / strategy), losses(runs / "single")[:4])
    assert [c.name for c in complete_checkpoints(runs / strategy / "checkpoints")] == ["step-00000002", "step-00000004"]
    assert (runs / strategy / "model" / "model.safetensors").is_file()  # FSDP: gathered whole on rank 0


@pytest.mark.slow
def test_exported_model_of_two_fsdp_ranks_is_the_whole_model(runs):
    from safetensors.torch import load_file

    sharded, single = load_file(runs / "fsdp" / "model" / "model.safetensors"), None
    code = main([STACK, *TINY, f"output.dir={runs / 'single4'}"])
    assert code == 0
    single = load_file(runs / "single4" / "model" / "model.safetensors")
    assert sharded.keys() == single.keys()
    for name, tensor in single.items():
        assert sharded[name].shape == tensor.shape
        assert (sharded[name] - tensor).abs().max() <= 1e-4, name


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_one_process(runs, tmp_path):
    out = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", out)
    code = main([STACK, *TINY, "train.steps=6", f"output.dir={out}", "--resume"])  # no --nproc: one process
    assert code == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert_close(losses(out), losses(runs / "single"))


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["1:4:shards", "0:4:marker"], ids=["rank1-after-its-shards", "rank0-before-marker"])
def test_kill_9_of_a_rank_mid_save_resumes_from_the_previous_checkpoint(runs, tmp_path, kill):
    out = tmp_path / "run"
    args = [STACK, *TINY, "distributed.strategy=fsdp", f"output.dir={out}", "--nproc", 2]
    code, err = finish(ckrun_process(*args, kill=kill))
    assert code == 137, err  # 128 + SIGKILL, from the rank that was killed
    assert f"rank {kill[0]} was killed by SIGKILL" in err.strip().splitlines()[-1]
    assert "internal error" not in err  # the survivor's gloo error ("Connection closed by peer") is not said
    assert [c.name for c in complete_checkpoints(out / "checkpoints")] == ["step-00000002"]
    code, err = finish(ckrun_process(*args, "--resume"))
    assert code == 0, err
    assert "resuming from" in err and "step-00000002" in err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert losses(out) == losses(runs / "fsdp")  # the same world size resumes exactly: bit for bit
    assert json.loads((out / "checkpoints" / "step-00000004" / "trainer.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_sigterm_to_ckrun_stops_every_rank_after_the_same_whole_step(tmp_path):
    import signal

    out = tmp_path / "run"
    process = ckrun_process(STACK, *TINY, "distributed.strategy=ddp", "train.steps=100000", "output.checkpoint_every=0",
                            f"output.dir={out}", "--nproc", 2)
    metrics = out / "metrics.jsonl"
    children.wait_until(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, process, "step 3")
    process.send_signal(signal.SIGTERM)
    code, err = finish(process)
    assert code == 143, err
    assert "Traceback" not in err
    stopped = [line for line in err.splitlines() if line.startswith("ckrun: stopped by SIGTERM")]
    assert len(stopped) == 1, err  # rank 0 says it, once
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == list(range(1, len(steps) + 1)) and f"after step {steps[-1]} of 100000" in stopped[0]
    # both ranks stopped after that step and saved it together: a complete checkpoint and the model
    assert complete_checkpoints(out / "checkpoints")[-1].name == f"step-{steps[-1]:08d}"
    assert (out / "model" / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_estimate_per_rank_is_within_5_percent_of_the_measured_per_rank_peak(runs, ckrun, strategy):
    """The fixture's runs: DDP at micro-batch 2, FSDP at its share of 4; both checkpoint every 2nd block."""
    measured = max(r["peak_mem_bytes"] for r in read_metrics(runs / strategy))  # the highest rank's
    extra = ["memory.micro_batch=2"] if strategy == "ddp" else []
    code, out, err = ckrun("estimate", STACK, *TINY, f"distributed.strategy={strategy}", *extra, "--device", "cpu",
                           "--json", "--nproc", "2")
    assert code == 0, err
    predicted = json.loads(out)["peak_bytes"]
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


@pytest.mark.slow
def test_a_failure_every_rank_shares_is_one_line_with_its_own_exit_status(tmp_path):
    code, err = finish(ckrun_process(STACK, *TINY, "distributed.strategy=fsdp", "memory.max_mem=1000",
                                     f"output.dir={tmp_path / 'run'}", "--nproc", 2))
    assert code == 3, err  # over the cap, as one process says it; not torchrun's 1
    problems = [line for line in err.splitlines() if line.startswith("ckrun:")]
    assert len(problems) == 1 and "memory cap 1.0 kB exceeded: step 1 peaked at" in problems[0], err
    assert "Traceback" not in err
