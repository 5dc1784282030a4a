"""The estimate predicts what training measures: the same bytes on CPU, CUDA's behaviour
reproduced on fake CPU tensors, and the caching allocator's rounding on top."""

from __future__ import annotations

import time
import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict.cuda_model import CachingAllocatorModel, CudaOnCpu, attention_as_on_cuda
from ckrun.runner.predict.estimate import EstimateUnavailable, Estimator, estimate_peak
from ckrun.runner.predict.shapes import weight_init_skipped
from ckrun.runner.memory.tracker import LiveBytesTracker
from ckrun.runner.plan.memory_plan import MemoryPlan

MiB = 1 << 20

TINY_BERT = """
model:
  source: transformers
  name: BertForMaskedLM
  config: {vocab_size: 512, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 2,
           intermediate_size: 128, max_position_embeddings: 64}
data: {source: synthetic, seq_len: 32}
train: {batch_size: 8, steps: 2, device: cpu}
"""


def _recipe(extra: str = ""):
    return recipe_from_text(TINY_BERT + extra)


@pytest.fixture(scope="module")
def cpu_estimator():
    return Estimator(_recipe(), "cpu")


# --- CPU: the estimate is the number training reports ---------------------------------------


@pytest.mark.parametrize("memory", [
    "{}", "{micro_batch: 2}", "{checkpointing: {policy: full}}", "{checkpointing: {policy: selective}}",
    "{micro_batch: 4, checkpointing: {policy: full}}",
])
def test_cpu_estimate_equals_the_peak_training_measures(memory):
    from ckrun.runner.train.trainer import Trainer

    recipe = _recipe(f"memory: {memory}\n")
    trainer = Trainer(recipe)
    trainer.train_step()  # the first step creates the optimizer state; the estimate is of later steps
    measured = trainer.train_step()["peak_mem_bytes"]
    estimate = estimate_peak(recipe, "cpu")
    assert estimate.peak_bytes == measured
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes


def test_an_estimator_serves_many_plans_and_leaves_the_model_as_it_was(cpu_estimator):
    plain = cpu_estimator.estimate(MemoryPlan())
    full = cpu_estimator.estimate(MemoryPlan(checkpointing={"policy": "full"}))
    assert full.breakdown["activations"] < plain.breakdown["activations"]
    assert cpu_estimator.estimate(MemoryPlan()) == plain
    assert all("forward" not in module.__dict__ for module in cpu_estimator.model.modules())


def test_bad_plans_are_value_errors_naming_the_key(cpu_estimator):
    with pytest.raises(ValueError, match="memory.micro_batch"):
        cpu_estimator.estimate(MemoryPlan(micro_batch=3))
    with pytest.raises(ValueError, match="memory.offload"):
        cpu_estimator.estimate(MemoryPlan(offload={"policy": "all"}))


def test_models_that_read_tensor_values_have_no_estimate():
    recipe = recipe_from_text("""
model: {source: python, name: "estimate_models:branch_on_values"}
data: {source: synthetic, task: image_classification, image_size: 8, num_classes: 4}
train: {batch_size: 4, steps: 1}
""")
    with pytest.raises(EstimateUnavailable, match="reads tensor values") as caught:
        estimate_peak(recipe)
    assert "\n" not in str(caught.value)


# --- CUDA on a CPU: the emulation matches fake CUDA tensors where those can run -----------------


def _forward_bytes(device: str, build, inputs) -> tuple[int, int]:
    """Peak and saved bytes of a bf16-autocast forward. On fake CUDA tensors the real CUDA autocast
    runs (only the attention kernel choice needs the routing: the GPU is not there to ask)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device(device), weight_init_skipped():
            model = build().train()
        batch = inputs(device)
        tracker = LiveBytesTracker(device).track(model, extra_tensors=batch.values())
        routed = (unittest.mock.patch.object(F, "scaled_dot_product_attention", attention_as_on_cuda)
                  if device == "cuda" else CudaOnCpu())
        with tracker, routed:
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, torch.bfloat16)
            try:
                model(**batch)
            finally:
                torch.set_autocast_enabled(device, False)
                torch.clear_autocast_cache()
        return tracker.peak_bytes, tracker.current_bytes


def _tokens(device: str) -> dict:
    return {"input_ids": torch.randint(0, 500, (2, 64), device=device)}


@pytest.mark.parametrize("build", [
    lambda: __import__("transformers").BertForMaskedLM(__import__("transformers").BertConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)),
    lambda: __import__("transformers").LlamaForCausalLM(__import__("transformers").LlamaConfig(
        vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128)),
], ids=["bert", "llama-gqa"])
def test_cuda_emulation_saves_what_cuda_autocast_saves(build):
    assert _forward_bytes("cpu", build, _tokens) == _forward_bytes("cuda", build, _tokens)


def test_cuda_estimate_of_a_transformer_plan():
    recipe = _recipe("precision: bf16\n")
    estimator = Estimator(recipe, "cuda")
    plain = estimator.estimate(MemoryPlan())
    # offload keeps two blocks in flight: it saves device memory only from the third block on
    six_blocks = Estimator(recipe_from_text(TINY_BERT.replace("num_hidden_layers: 2", "num_hidden_layers: 6")
                                            + "precision: bf16\n"), "cuda")
    offloaded = six_blocks.estimate(MemoryPlan(offload={"policy": "all", "min_bytes": 1024}))
    assert offloaded.live_peak_bytes < six_blocks.estimate(MemoryPlan()).live_peak_bytes
    full = estimator.estimate(MemoryPlan(checkpointing={"policy": "full"}))
    assert plain.device == "cuda" and plain.peak_bytes >= plain.live_peak_bytes
    assert sum(plain.breakdown.values()) == plain.peak_bytes
    assert any("pinned host memory" in note for note in offloaded.notes)
    assert full.live_peak_bytes < plain.live_peak_bytes
    cpu = Estimator(recipe, "cpu").estimate(MemoryPlan())
    assert plain.live_peak_bytes < cpu.live_peak_bytes  # flash attention and bool dropout masks


# --- the caching allocator model --------------------------------------------------------------


def test_small_requests_share_2mib_segments_rounded_to_512_bytes():
    allocator = CachingAllocatorModel()
    for key in range(4):
        allocator.alloc(key, 1)
    assert (allocator.reserved, allocator.allocated) == (2 * MiB, 4 * 512)
    allocator.alloc(9, MiB)  # still a small request: the same segment's rest has room
    assert allocator.reserved == 2 * MiB


def test_large_requests_get_20mib_segments_below_10mib_and_2mib_rounding_above():
    allocator = CachingAllocatorModel()
    allocator.alloc(1, 3 * MiB)
    assert allocator.reserved == 20 * MiB
    allocator.alloc(2, 15 * MiB + 1)  # the 17 MiB left in the first segment fits it
    assert allocator.reserved == 20 * MiB
    allocator.alloc(3, 11 * MiB)
    assert allocator.reserved == 20 * MiB + 12 * MiB


def test_freed_blocks_merge_and_are_reused_best_fit():
    allocator = CachingAllocatorModel()
    for key in range(4):
        allocator.alloc(key, 5 * MiB)  # 4 x 5 MiB fill one 20 MiB segment
    allocator.free(1)
    allocator.free(2)  # merges with block 1: 10 MiB free in the middle
    allocator.alloc(5, 9 * MiB)
    assert allocator.reserved == 20 * MiB  # reused, nothing new reserved
    allocator.alloc(6, 2 * MiB)  # the 1 MiB rest was not split off (large pool splits only > 1 MiB)
    assert allocator.reserved == 40 * MiB
    assert allocator.peak_allocated == 20 * MiB + 2 * MiB


@pytest.mark.slow
def test_bert_large_estimates_within_a_minute():
    from ckrun.runner.recipe.load import load_recipe
    from pathlib import Path

    started = time.perf_counter()
    estimate = estimate_peak(load_recipe(Path(__file__).parents[3] / "recipes" / "bert_large.yaml"), "cuda")
    assert time.perf_counter() - started < 60
    assert 5e9 < estimate.peak_bytes < 40e9  # its plan (micro-batches of 16, full checkpointing) fits 40 GB


TINY_T5 = """
model:
  source: transformers
  name: T5ForConditionalGeneration
  config: {vocab_size: 128, d_model: 32, d_ff: 64, d_kv: 8, num_heads: 4, num_layers: 1}
data: {source: synthetic, seq_len: 16, target_len: %d}
train: {batch_size: 4, steps: 2, device: cpu}
"""


def test_seq2seq_targets_are_target_len_long_in_training_and_in_the_estimate():
    """The decoder's length is the target's, not the input's: both the batch and the estimate follow it."""
    from ckrun.runner.train.trainer import Trainer

    peaks = {}
    for target_len in (4, 24):
        recipe = recipe_from_text(TINY_T5 % target_len)
        trainer = Trainer(recipe)
        assert trainer.data.global_batch(0).labels.shape == (4, target_len)
        trainer.train_step()
        peaks[target_len] = trainer.train_step()["peak_mem_bytes"]
        assert estimate_peak(recipe, "cpu").peak_bytes == peaks[target_len]
    assert peaks[24] > peaks[4]


def test_a_card_too_small_for_the_step_is_predicted_with_its_unlimited_reserve(monkeypatch):
    """A cap (or card) the allocator outgrows: a step whose live tensors cannot fit even after releasing the
    cache keeps its unlimited reserve, which a cap check rejects, and says it runs out of memory; a card with
    room changes nothing. (What fits after a release: tests/runner/predict/test_cuda_extras.py.)"""
    from ckrun.runner.predict import reserved

    monkeypatch.setattr(reserved, "CUDA_CONTEXT_BYTES", 0)  # the tiny step is far below a real context
    estimator = Estimator(recipe_from_text(TINY_BERT), "cuda")
    free = estimator.estimate(MemoryPlan())
    roomy = estimator.estimate(MemoryPlan(max_mem=10 * free.peak_bytes))
    assert roomy.peak_bytes == free.peak_bytes and roomy.notes == free.notes
    too_small = estimator.estimate(MemoryPlan(max_mem=free.live_peak_bytes // 2))
    assert too_small.peak_bytes == free.peak_bytes
    assert any("runs out of memory" in note for note in too_small.notes)
