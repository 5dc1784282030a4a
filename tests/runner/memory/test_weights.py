"""memory.weights: autocast's cast cache off computes the same bits and, under checkpointing, holds
fewer cast copies (counted, and estimated to the byte); bf16 weights hold half the bytes and are
refused outside bf16 autocast."""

from __future__ import annotations

import pytest
import torch

from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.memory.weights import KeptCopies, apply_weights, copies_kept
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.problems import InputError
from tests.runner.memory.tiny_lm import GPT2, LLAMA, WIDE, identical, needs_torchao, recipe, train

UNCACHED = "weights: {policy: fp32, cast_cache: false}"


@pytest.mark.parametrize("memory", ["{%s}", "{%s, checkpointing: {policy: full}}",
                                    "{%s, checkpointing: {policy: selective}}"], ids=["plain", "full", "selective"])
def test_without_the_cast_cache_the_run_is_the_same_bit_for_bit(memory):
    """Each op casts the same fp32 weight to the same bf16 values, cached or not."""
    cached = train(recipe(memory.replace("%s, ", "").replace("{%s}", "{}"), GPT2, "bf16"), steps=3)
    uncached = train(recipe(memory % UNCACHED, GPT2, "bf16"), steps=3)
    assert uncached[0] == cached[0]
    assert identical(uncached[1], cached[1])


def test_under_checkpointing_the_cast_cache_off_holds_fewer_cast_weights_as_estimated():
    """At the forward's end every checkpointed block's cast weights are still cached (2 B a block
    parameter); without the cache none is. With the update in the backward the gradients no longer set
    the peak, so the forward's end does, and the difference shows in the measured peak too."""
    base = "{checkpointing: {policy: full}, optimizer_step: {policy: in_backward}%s}"
    peaks, estimates = {}, {}
    for name, extra in (("cached", ""), ("uncached", ", " + UNCACHED)):
        plan_recipe = recipe(base % extra, WIDE, "bf16", seq_len=8, batch_size=1)
        trainer = train(plan_recipe, steps=1)[2]
        peaks[name] = trainer.train_step()["peak_mem_bytes"]
        estimates[name] = Estimator(plan_recipe, "cpu").estimate()
        assert estimates[name].peak_bytes == peaks[name]
    blocks = trainer.plan.blocks
    block_bytes = sum(p.numel() for block in blocks for p in block.module.parameters()) * 2
    assert estimates["cached"].breakdown["weight_casts"] >= block_bytes  # the peak: every block's cast weights
    assert estimates["uncached"].breakdown["weight_casts"] < block_bytes // 2  # the peak moved: one block's recompute
    assert peaks["uncached"] < peaks["cached"]
    assert "made by each op and freed with it" in " ".join(estimates["uncached"].notes)


@needs_torchao
def test_bf16_weights_hold_half_the_bytes_and_the_estimate_puts_the_model_back():
    memory = "{weights: {policy: bf16}, allow_lossy: true}"
    estimator = Estimator(recipe("{}", WIDE, "bf16"), "cpu")
    fp32, bf16 = estimator.estimate(MemoryPlan()), estimator.estimate(MemoryPlan.model_validate(
        {"weights": {"policy": "bf16"}, "allow_lossy": True}))
    parameters = sum(p.numel() for p in estimator.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in estimator.model.buffers())  # RoPE's stay float32
    assert (fp32.breakdown["parameters"], bf16.breakdown["parameters"]) == (4 * parameters + buffers,
                                                                           2 * parameters + buffers)
    assert bf16.breakdown["weight_casts"] == 0 and "no fp32 master copy" in " ".join(bf16.notes)
    assert {p.dtype for p in estimator.model.parameters()} == {torch.float32}
    assert estimator.estimate(MemoryPlan()) == fp32
    trainer = train(recipe(memory, WIDE, "bf16"), steps=1)[2]
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in trainer.model.buffers() if b.is_floating_point()} == {torch.float32}  # RoPE's stay


def test_the_estimators_copies_are_made_once_and_its_undo_gives_the_fp32_data_back():
    """The estimator applies a plan for every step it fakes: within `copies_kept` each parameter's bf16 copy is
    made the first time and given again, the same estimate each time, and the undo restores the very data the
    copy replaced (training's undo casts back, a new float32 tensor)."""
    bf16 = MemoryPlan.model_validate({"weights": {"policy": "bf16"}, "allow_lossy": True})
    estimator = Estimator(recipe("{}", WIDE, "bf16"), "cpu")
    first = estimator.estimate(bf16)
    copies = dict(estimator.kept_copies.copies)
    assert copies and {c.dtype for c in copies.values()} == {torch.bfloat16}
    assert estimator.estimate(bf16) == first and estimator.kept_copies.copies == copies  # none made again
    data = {p: p.data for p in estimator.model.parameters()}
    with copies_kept(KeptCopies()):
        undo = apply_weights(estimator.model, bf16.weights)
    undo()
    assert all(p.data.data_ptr() == data[p].data_ptr() for p in data)
    undo = apply_weights(estimator.model, bf16.weights)  # outside it: cast, and cast back
    undo()
    assert {p.dtype for p in estimator.model.parameters()} == {torch.float32}


def test_bf16_weights_are_refused_outside_bf16_autocast():
    with pytest.raises(InputError, match="memory.weights: bf16 weights run under bf16 autocast .* not precision fp32; "
                                         "set precision: bf16"):
        recipe("{weights: {policy: bf16}, allow_lossy: true}")


@needs_torchao
def test_bf16_weights_over_micro_batches_sum_their_gradients_in_float32():
    """The gradient the update reads is the micro-batches' bf16 gradients summed in float32 and rounded to
    bf16 once (what one pass over the whole batch gets), not a bf16 running sum, which rounds at every
    addition (that sum differs here: the test can tell the two apart)."""
    from ckrun.runner.train.step import label_count, micro_batch_loss
    from ckrun.runner.train.trainer import Trainer

    trainer = Trainer(recipe("{weights: {policy: bf16}, micro_batch: 1, allow_lossy: true}", LLAMA, "bf16", batch_size=4))
    batch = trainer.data.global_batch(0)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.planned.remove()
    parts = []
    for start in range(4):
        trainer.model.zero_grad(set_to_none=True)
        (micro_batch_loss(trainer.model, batch.slice(start, start + 1), trainer.precision) / label_count(batch.labels)).backward()
        parts.append([p.grad.clone() for p in params])
    trainer.model.zero_grad(set_to_none=True)
    trainer.planned.install()
    float32_sums = [sum(grads[1:], grads[0].float()).bfloat16() for grads in zip(*parts, strict=True)]
    bf16_sums = [sum(grads[1:], grads[0]) for grads in zip(*parts, strict=True)]
    handed = []
    trainer.optimizer.register_step_pre_hook(lambda *_: handed.extend(p.grad.clone() for p in params))
    trainer.train_step()
    assert all(g.dtype == torch.bfloat16 for g in handed)
    assert identical(handed, float32_sums) and not identical(handed, bf16_sums)
