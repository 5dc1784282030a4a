"""A LoRA recipe's estimate is the bytes training measures on the CPU: the frozen base's weights, and
no gradients or optimizer state for it, under every plan, rank, target, base dtype and precision."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict.estimate import estimate_peak
from ckrun.runner.train.trainer import Trainer
from tests.runner.builders.hub_cache import tiny_llama_recipe

PLANS = ["{}", "{checkpointing: {policy: full}}", "{checkpointing: {policy: every, every: 2}}",
         "{checkpointing: {policy: selective}}", "{micro_batch: 2}", "{micro_batch: 2, checkpointing: {policy: full}}"]
TARGETS = ["null", "[q_proj, v_proj]", "all-linear", "[gate_proj, up_proj, down_proj]"]
# (base_dtype, precision): a bf16 base runs under bf16 autocast only
DTYPES = [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")]


def _lora_recipe(plan: str, rank: int, targets: str, dtypes: tuple[str, str], tied: bool, extra: str = ""):
    base_dtype, precision = dtypes
    text = tiny_llama_recipe(f"lora: {{rank: {rank}, target_modules: {targets}, base_dtype: {base_dtype}{extra}}}",
                             f"precision: {precision}\nmemory: {plan}\n")
    return recipe_from_text(text.replace("tie_word_embeddings: false", f"tie_word_embeddings: {str(tied).lower()}"))


def _measured(recipe) -> tuple[int, Trainer]:
    trainer = Trainer(recipe)
    trainer.train_step()  # the first step creates the optimizer state; the estimate is of the steps after it
    return trainer.train_step()["peak_mem_bytes"], trainer


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.sampled_from(PLANS), rank=st.sampled_from([1, 4, 8]), targets=st.sampled_from(TARGETS),
       dtypes=st.sampled_from(DTYPES), tied=st.booleans())
def test_a_lora_estimate_is_the_peak_training_measures(plan, rank, targets, dtypes, tied):
    recipe = _lora_recipe(plan, rank, targets, dtypes, tied)
    measured, trainer = _measured(recipe)
    estimate = estimate_peak(recipe, "cpu")
    assert estimate.peak_bytes == measured, (plan, rank, targets, dtypes, tied)
    trainable = {id(p): p for p in trainer.model.parameters() if p.requires_grad}.values()
    # the optimizer's state is the adapter's: AdamW's two moments and a step per trained tensor
    assert len(trainer.optimizer.state) == len(trainable)
    assert estimate.breakdown["optimizer_state"] <= sum(2 * 4 * p.numel() + 4 for p in trainable)


def test_the_frozen_base_has_no_gradients_or_optimizer_state_where_full_training_has():
    full = estimate_peak(recipe_from_text(tiny_llama_recipe()))
    lora = estimate_peak(_lora_recipe("{}", 8, "null", ("fp32", "fp32"), False))
    assert lora.breakdown["optimizer_state"] * 10 < full.breakdown["optimizer_state"]
    assert lora.breakdown["parameters"] > full.breakdown["parameters"]  # the adapters come on top of the base
    assert any(note.startswith("model.lora: 1,792 of 28,576 parameters train (rank 8 on q_proj, v_proj)")
               for note in lora.notes), lora.notes


def test_ckrun_estimate_shows_the_lora_note_beside_its_breakdown(ckrun):
    code, out, err = ckrun("estimate", str(ROOT / "recipes" / "llama_1b_lora.yaml"), "model.config.num_hidden_layers=2",
                           "model.config.hidden_size=64", "model.config.intermediate_size=128", "data.seq_len=32",
                           "train.batch_size=4", "memory.micro_batch=2", "--device", "cpu", "--json")
    assert code == 0, err
    found = json.loads(out)
    assert set(found["breakdown"]) >= {"parameters", "gradients", "optimizer_state", "activations"}
    assert any(note.startswith("model.lora:") and "has no gradients or optimizer state" in note for note in found["notes"])
