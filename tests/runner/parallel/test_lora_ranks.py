"""A LoRA run on 2 FSDP ranks: its sharded checkpoints hold the adapter alone (DCP without the frozen base,
which model.pretrained rebuilds), resume to the losses one process trains, and the adapter it exports is
the one one process exports (the same tensors, gathered)."""

from __future__ import annotations

import os
import sys

import pytest

import children
from conftest import ROOT, read_metrics
from tests.runner.builders.hub_cache import tiny_llama_recipe


def _ckrun(recipe, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return children.run([sys.executable, "-m", "ckrun", str(recipe), *map(str, args)], env=env, cwd=ROOT)


@pytest.mark.slow  # three runs, two of them launching 2 ranks: 2.5 minutes on 2 cores
def test_lora_on_fsdp_ranks_saves_and_resumes_the_adapter(tmp_path):
    from safetensors.torch import load_file

    recipe = tmp_path / "lora.yaml"  # SGD: one process and the ranks differ only in the order of fp32 sums
    recipe.write_text(tiny_llama_recipe("lora: {rank: 4, target_modules: all-linear}",
                                        "output: {checkpoint_every: 1}\n").replace("adamw, lr: 0.01", "sgd, lr: 0.5"))
    sharded = ["distributed.strategy=fsdp", "--nproc", 2]
    done = _ckrun(recipe, "train.steps=2", f"output.dir={tmp_path / 'ranks'}", *sharded)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _ckrun(recipe, "train.steps=3", f"output.dir={tmp_path / 'ranks'}", *sharded, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _ckrun(recipe, "train.steps=3", f"output.dir={tmp_path / 'one'}").returncode == 0
    ranks, one = read_metrics(tmp_path / "ranks"), read_metrics(tmp_path / "one")
    assert [r["step"] for r in ranks] == [1, 2, 3]
    for got, want in zip(ranks, one, strict=True):  # step 3 would differ without the adapter restored
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (ranks, one)
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ranks" / "checkpoints" / "step-00000003")).read_metadata()
    model = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert len(model) == 28 and all(".lora_A." in key or ".lora_B." in key for key in model)  # no frozen weight
    exported, alone = (load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors")) for run in ("ranks", "one"))
    assert exported.keys() == alone.keys()
