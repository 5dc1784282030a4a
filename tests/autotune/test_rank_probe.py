"""A probe of `ckrun tune --nproc 2` is a real torchrun group on the CPU (gloo): it measures with both
ranks and reports once; a rank that crashes costs the probe with that rank named; a rank that hangs
is killed with its whole group on the timeout, although torchrun starts each rank in its own session.
And (slow) `ckrun tune --nproc 2` ends with a tuned.yaml that trains as 2 ranks."""

from __future__ import annotations

import os
import sys

import pytest

from ckrun.autotune.probes.probe import ProbeRunner, ProbeSettings
import children
from conftest import BERT_TINY, ROOT, TINY_BERT, read_metrics
from ckrun.runner.recipe.load import load_recipe
from tune_helpers import launches, survivors


def _recipe(strategy: str):
    return load_recipe(BERT_TINY, [*TINY_BERT, f"distributed.strategy={strategy}", "memory.max_mem=1GB"])


def _settings(timeout_s: float, warmup_steps: int = 1) -> ProbeSettings:
    return ProbeSettings(timeout_s=timeout_s, warmup_steps=warmup_steps, timed_steps=1, nproc=2)


def test_a_probe_group_measures_with_every_rank_and_reports_once(tmp_path):
    result = ProbeRunner(tmp_path, _settings(children.STALL_S * 5, warmup_steps=2)).probe(_recipe("fsdp"), 0)
    assert result.status == "ok", result
    assert result.world_size == 2 and result.measured_peak_bytes > 0 and result.samples_per_s > 0
    assert sorted(p.name for p in (tmp_path / "probes").glob("trial-0.result*.json")) == [
        "trial-0.result.json", "trial-0.result.rank-0.json", "trial-0.result.rank-1.json"]
    assert [launch["what"] for launch in launches(tmp_path)].count("rank") == 2


@pytest.mark.slow  # 30 s: two ranks wait out a hang
def test_a_rank_that_crashes_or_hangs_costs_its_probe_and_leaves_no_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CKRUN_PROBE_FAULT", "crash:0@1,hang:1@1")  # only rank 1 of each group
    # the crash must come before its probe's timeout however busy the machine; the hang waits for it
    crashed = ProbeRunner(tmp_path, _settings(children.STALL_S * 5)).probe(_recipe("ddp"), 0)
    assert crashed.status == "died" and crashed.reason.startswith("rank 1 of 2 was killed by SIGSEGV"), crashed
    hung = ProbeRunner(tmp_path, _settings(25)).probe(_recipe("ddp"), 1)
    assert hung.status == "timeout", hung
    started = launches(tmp_path)
    assert any(launch["what"] == "rank" and launch["trial"] == 1 for launch in started)
    assert not survivors([launch["pid"] for launch in started])  # the ranks' sessions and the hang's grandchild


@pytest.mark.slow
def test_tune_with_two_ranks_writes_a_tuned_yaml_that_trains_as_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "ckrun", "tune", BERT_TINY, *TINY_BERT, "train.steps=3",
               f"output.dir={tmp_path / 'run'}", "--output", str(tmp_path / "tune"), "--max-mem", "1500kB",
               "--trials", "3", "--finalists", "0", "--nproc", "2"]
    done = children.run(command, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    tuned = (tmp_path / "tune" / "tuned.yaml").read_text()
    assert "train it:   ckrun" in tuned and "--nproc 2" in tuned and "strategy:" in tuned
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(records) == 3 and all(r["world_size"] == 2 for r in records)
    assert max(r["peak_mem_bytes"] for r in records) <= 1_500_000
