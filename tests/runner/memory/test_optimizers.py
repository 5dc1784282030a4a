"""The optimizer a plan asks for: the update inside the backward computes what the step after it
computes, bit for bit, and resumes from either; torchao's low-bit and bf16 AdamW are what the plan
names, refused where they cannot run."""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest
import torch

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.memory.optimizers import InBackwardUpdate
from ckrun.runner.problems import InputError
from tests.runner.memory.tiny_lm import GPT2, LLAMA, WIDE, identical, needs_torchao, recipe, train

IN_BACKWARD = "{optimizer_step: {policy: in_backward}}"


@pytest.mark.parametrize(("model", "precision", "memory"), [
    (LLAMA, "fp32", "{}"),
    (GPT2, "fp32", "{}"),  # a tied projection, and dropout on
    (LLAMA, "bf16", "{checkpointing: {policy: full}}"),  # autocast, and recompute before the update
    (GPT2, "bf16", "{checkpointing: {policy: every, every: 2}, loss: {policy: chunked, chunks: 3}}"),
], ids=["llama", "gpt2-tied-dropout", "llama-bf16-checkpointed", "gpt2-bf16-every2-chunked"])
def test_the_update_in_the_backward_is_the_step_after_it_bit_for_bit(model, precision, memory):
    """Bit-identical, not within a tolerance: each parameter's update is the same single-tensor AdamW
    arithmetic on the same gradient, run earlier. The schedule (warm-up, cosine) moves the rate each step."""
    schedule = {"name": "cosine", "warmup_steps": 1}
    plain = train(recipe(memory, model, precision, scheduler=schedule), steps=3)
    fused = memory.replace("{", "{optimizer_step: {policy: in_backward}, ", 1) if memory != "{}" else IN_BACKWARD
    inside = train(recipe(fused, model, precision, scheduler=schedule), steps=3)
    assert inside[0] == plain[0]
    assert identical(inside[1], plain[1])
    assert isinstance(inside[2].planned.stepper, InBackwardUpdate)
    assert inside[2].scheduler.get_last_lr() == plain[2].scheduler.get_last_lr()


def test_in_backward_frees_each_gradient_as_it_updates_and_the_peak_falls_by_them():
    small = {"seq_len": 8, "batch_size": 1}  # activations far below the weights
    plain, inside = train(recipe("{}", WIDE, **small), steps=2), train(recipe(IN_BACKWARD, WIDE, **small), steps=2)
    assert all(p.grad is None for p in inside[2].model.parameters())
    parameters = sum(p.numel() * p.element_size() for p in plain[2].model.parameters())
    plain_peak = plain[2].train_step()["peak_mem_bytes"]
    inside_peak = inside[2].train_step()["peak_mem_bytes"]
    # the weights dominate this model: without the knob every gradient is alive at the backward's end
    assert plain_peak - inside_peak > parameters // 2


def test_a_run_resumes_across_the_knob_with_the_same_weights():
    """The optimizer state is the ordinary optimizer's: saved with the update in the backward, resumed
    without it (and the other way), the run continues exactly as one that never stopped."""
    straight = train(recipe(IN_BACKWARD), steps=4)
    first = train(recipe(IN_BACKWARD), steps=2)[2]
    checkpoint = io.BytesIO()
    torch.save(first.state(), checkpoint)  # as a checkpoint holds it: copies, not the live tensors
    for memory in ("{}", IN_BACKWARD):
        second = train(recipe(memory), steps=0)[2]
        checkpoint.seek(0)
        second.restore(torch.load(checkpoint, weights_only=True))
        losses = [second.train_step()["loss"] for _ in range(2)]
        assert losses == straight[0][2:]
        assert identical([p.detach() for p in second.model.parameters()], straight[1])


@pytest.mark.parametrize(("memory", "train_keys", "refusal"), [
    ("{micro_batch: 2, optimizer_step: {policy: in_backward}}", {},
     "memory.optimizer_step: in_backward updates each parameter as soon as its gradient is accumulated, but "
     "memory.micro_batch 2 makes 2 micro-batches"),
    (IN_BACKWARD, {"grad_clip": 1.0}, "global gradient clipping needs every gradient first; set train.grad_clip: null"),
])
def test_in_backward_is_refused_where_every_gradient_is_needed_first(memory, train_keys, refusal):
    with pytest.raises(InputError) as refused:
        recipe(memory, **train_keys)
    assert refusal in str(refused.value) and "\n" not in str(refused.value).strip()


def test_in_backward_is_refused_with_fp16_and_under_ddp():
    base = ("model: " + LLAMA + "\ndata: {source: synthetic, seq_len: 8}\ntrain: {batch_size: 4, steps: 1, "
            "grad_clip: null}\nmemory: " + IN_BACKWARD + "\n")
    with pytest.raises(InputError, match="fp16's loss scaler must see every gradient"):
        recipe_from_text(base + "precision: fp16\n")
    with pytest.raises(InputError, match="with this rank's own gradient: DDP averages it over the ranks afterwards"):
        recipe_from_text(base + "distributed: {strategy: ddp}\n")
    recipe_from_text(base + "distributed: {strategy: fsdp}\n")  # FSDP2 runs the update on the reduce-scattered shard


@needs_torchao
@pytest.mark.parametrize(("memory", "class_name"), [
    ("{optimizer_state: {policy: 8bit}, allow_lossy: true}", "AdamW8bit"),
    ("{optimizer_state: {policy: 4bit}, allow_lossy: true}", "AdamW4bit"),
    ("{optimizer_state: {policy: fp8}, allow_lossy: true}", "AdamWFp8"),
    ("{weights: {policy: bf16}, allow_lossy: true}", "_AdamW"),
])
def test_low_bit_and_bf16_plans_train_with_torchaos_adamw(memory, class_name):
    precision = "bf16" if "weights" in memory else "fp32"
    losses, weights, trainer = train(recipe(memory, precision=precision), steps=2)
    optimizer = trainer.optimizer
    assert type(optimizer).__module__.startswith("torchao.optim") and type(optimizer).__name__ == class_name
    assert all(loss == loss for loss in losses)
    if "weights" in memory:
        assert {w.dtype for w in weights} == {torch.bfloat16} and optimizer.bf16_stochastic_round
    embedding = trainer.model.get_input_embeddings().weight  # 8192 elements: kept full precision
    matrix = trainer.model.model.layers[0].mlp.up_proj.weight  # 2048 elements: under torchao's 4096, full precision
    other = trainer.model.lm_head.weight  # 8192 elements: quantized (a subclass), unless the weights are bf16
    assert [type(optimizer.state[p]["exp_avg"]).__name__ == "Tensor" for p in (embedding, matrix, other)] == \
        [True, True, class_name == "_AdamW"]


@needs_torchao
def test_torchaos_default_quantizes_the_embeddings_too():
    memory = "{optimizer_state: {policy: 8bit, full_precision_embeddings: false}, allow_lossy: true}"
    trainer = train(recipe(memory), steps=1)[2]
    assert type(trainer.optimizer.state[trainer.model.get_input_embeddings().weight]["exp_avg"]).__name__ == \
        "OptimState8bit"


def test_lossy_pool_knobs_are_refused_without_the_opt_in_and_torchao_knobs_without_torchao(monkeypatch):
    with pytest.raises(InputError, match=r"memory.optimizer_state: 8bit changes the training beyond float rounding.*"
                                         r"set memory.allow_lossy: true"):
        recipe("{optimizer_state: {policy: 8bit}}")
    with pytest.raises(InputError, match="torchao's AdamW, which stands in for train.optimizer.name: adamw only"):
        recipe("{optimizer_state: {policy: 8bit}, allow_lossy: true}", optimizer={"name": "sgd"})
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(InputError) as refused:
        recipe("{weights: {policy: bf16}, allow_lossy: true}", precision="bf16")
    assert ("memory.weights.policy: policy bf16 needs the torchao package, which is not installed: pip install "
            "'ckrun[lowbit]'") in str(refused.value)
