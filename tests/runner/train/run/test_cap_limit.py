"""The allocator limit under a cap on a card larger than the cap: set from the CUDA context with a
step's kernels loaded, so lazy loading in step 1 does not push a plan that fits over the cap; and
the in-run check says what it compared. The arithmetic on the CPU with the CUDA calls stood in for;
the real context growth on a GPU."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from conftest import BERT_TINY
from ckrun.runner.memory import measure
from ckrun.runner.train.trainer import Trainer
from ckrun.runner.train.run import memory_cap

GB = 10**9
MB = 10**6


def test_the_limit_leaves_room_for_the_context_with_a_steps_kernels(monkeypatch):
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80 * GB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    monkeypatch.setattr(measure, "cuda_context_bytes", lambda device: 650 * MB)  # at init, before any kernel
    monkeypatch.setattr(memory_cap, "context_after_kernels", lambda device: 800 * MB)  # once matmul, attention, AdamW ran
    assert memory_cap.limit_cuda_memory(torch.device("cuda", 0), 40 * GB) == 800 * MB
    assert fractions == [pytest.approx((40 * GB - 800 * MB) / (80 * GB))]


def test_over_the_cap_on_cuda_names_the_reserve_and_the_context():
    trainer = types.SimpleNamespace(recipe=types.SimpleNamespace(memory=types.SimpleNamespace(max_mem=40 * GB)),
                                    device=torch.device("cuda", 0), step=3, limited_at_context=800 * MB)
    record = {"peak_mem_bytes": 39_500 * MB, "cuda_context_bytes": 900 * MB}
    with pytest.raises(memory_cap.MemoryCapExceeded) as caught:
        Trainer._check_cap(trainer, record)
    assert str(caught.value) == ("memory cap 40.0 GB exceeded: step 3 peaked at 40.4 GB (allocator reserve "
                                 "39.5 GB + CUDA context 900.0 MB)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_first_steps_kernels_are_already_in_the_limits_context(tmp_path, caplog):
    from ckrun.runner.recipe.load import load_recipe

    caplog.set_level(logging.INFO)
    total = torch.cuda.get_device_properties(0).total_memory
    recipe = load_recipe(BERT_TINY, ["train.device=cuda", "precision=bf16", f"memory.max_mem={total // 2}",
                                     f"output.dir={tmp_path}"])
    trainer = Trainer(recipe)
    limited = trainer.limited_at_context
    records = [trainer.train_step() for _ in range(2)]
    # the model's own kernels (embedding, GELU, the loss) still load in step 1: tens of MB, not ~150
    assert all(r["cuda_context_bytes"] - limited < 64 << 20 for r in records), (limited, records)
