"""CUDA-only: allocator peaks in metrics, the memory cap enforced inside a run, and the
prediction compared with the allocator. Skipped without a GPU; run with `pytest -m cuda`."""

import json

import pytest
import torch

from conftest import BERT_TINY, read_metrics

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL_BERT = ["model.config.num_hidden_layers=4", "model.config.hidden_size=256", "model.config.num_attention_heads=4",
              "model.config.intermediate_size=1024", "train.batch_size=32", "train.device=cuda", "precision=bf16"]


def test_metrics_carry_the_allocator_peaks(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(BERT_TINY, *SMALL_BERT, "train.steps=3", f"output.dir={out}")[0] == 0
    for record in read_metrics(out):
        assert record["peak_mem_bytes"] >= record["peak_allocated_bytes"] > 0
        assert record["cuda_context_bytes"] > 0 and record["alloc_retries"] >= 0


def test_a_plan_over_the_cap_fails_inside_the_run_with_one_line(tmp_path, ckrun):
    out = tmp_path / "free"
    assert ckrun(BERT_TINY, *SMALL_BERT, "train.steps=2", f"output.dir={out}")[0] == 0
    peak = max(m["peak_mem_bytes"] for m in read_metrics(out))
    cap = int(peak * 0.6) + 600_000_000  # below what the step needs once the CUDA context is counted
    code, _, err = ckrun(BERT_TINY, *SMALL_BERT, "train.steps=2", f"memory.max_mem={cap}", f"output.dir={tmp_path / 'capped'}")
    assert code == 3 and "memory cap" in err.strip().splitlines()[-1]


def test_prediction_is_close_to_the_allocator_peak(tmp_path, ckrun):
    code, out, err = ckrun("estimate", BERT_TINY, *SMALL_BERT, "--device", "cuda", "--json")
    assert code == 0, err
    predicted = json.loads(out)["peak_bytes"]
    run = tmp_path / "run"
    assert ckrun(BERT_TINY, *SMALL_BERT, "train.steps=3", f"output.dir={run}")[0] == 0
    measured = max(m["peak_mem_bytes"] for m in read_metrics(run))
    assert predicted == pytest.approx(measured, rel=0.15)


def test_an_out_of_memory_step_gives_its_memory_back():
    import gc

    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.train.run.memory_cap import MemoryCapExceeded
    from ckrun.runner.train.trainer import Trainer

    # a batch whose activations cannot fit under a 2 GB cap: the allocator stops at the cap mid-step
    recipe = load_recipe(BERT_TINY, [*SMALL_BERT, "train.batch_size=1024", "memory.max_mem=2GB"])
    trainer = Trainer(recipe)
    kept = sum(p.nbytes for p in trainer.model.parameters())
    with pytest.raises(MemoryCapExceeded) as caught:
        trainer.train_step()
    assert caught.value.peak > 0 and caught.value.step == 1
    gc.collect()
    # what is left is the model (no optimizer state yet, the partial gradients dropped) and little else
    assert torch.cuda.memory_allocated() < kept + 64 * 2**20
    del trainer, caught
    gc.collect()
    torch.cuda.empty_cache()
