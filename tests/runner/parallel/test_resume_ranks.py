"""A single process's checkpoint resumes at 2 FSDP ranks (issue 25, defect 5: refused, once per rank,
after every rank had started), to the losses one process trains; and the model FSDP exports holds
tied weights once, as one process's export does (defect 4: BERT 10.2 MB against 5.95 MB).

BERT tiny without dropout, SGD with momentum: the optimizer has state to carry over, and the only
difference to one process is the order of fp32 sums (test_ranks.py says why not AdamW)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import children
from conftest import BERT_TINY, ROOT, TINY_BERT, read_metrics

RUN = [BERT_TINY, *TINY_BERT, "model.config.hidden_dropout_prob=0.0", "model.config.attention_probs_dropout_prob=0.0",
       "train.optimizer={name: sgd, lr: 0.5, momentum: 0.9}", "train.scheduler={name: constant}"]


def _ckrun(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return children.run([sys.executable, "-m", "ckrun", *RUN, *map(str, args)], env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`resumed`: 2 steps in one process, then 2 more on 2 FSDP ranks; `single`: 4 steps in one process."""
    base = tmp_path_factory.mktemp("resume_ranks")
    assert _ckrun("train.steps=2", f"output.dir={base / 'resumed'}").returncode == 0
    done = _ckrun("train.steps=4", f"output.dir={base / 'resumed'}", "distributed.strategy=fsdp", "--nproc", 2,
                  "--resume")
    assert _ckrun("train.steps=4", f"output.dir={base / 'single'}").returncode == 0
    return base, done


@pytest.mark.slow  # 25 s: a run, then two FSDP ranks
def test_a_single_process_checkpoint_resumes_on_two_fsdp_ranks(runs):
    base, done = runs
    assert done.returncode == 0, done.stderr
    resumed, single = read_metrics(base / "resumed"), read_metrics(base / "single")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed[-1]["world_size"] == 2
    for got, want in zip(resumed, single, strict=True):  # step 3 would differ without the momentum restored
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (resumed, single)


@pytest.mark.slow  # the fixture's 25 s; by default test_pool_knobs_ranks.py's fsdp run checks its export the same way
def test_the_fsdp_export_stores_tied_weights_once(runs):
    from safetensors.torch import load_file

    base, done = runs
    assert done.returncode == 0, done.stderr
    exported, single = (base / "resumed" / "model" / "model.safetensors"), (base / "single" / "model" / "model.safetensors")
    assert sorted(load_file(exported)) == sorted(load_file(single))  # no cls.predictions.decoder.weight
    assert exported.stat().st_size == single.stat().st_size
