"""Every knob of the weights, the optimizer and the loss is predicted to the byte: the estimate of a
plan equals the peak a CPU run of it measures (the optimizer's steady state: the second step), and
its breakdown names the pools (weight casts and the loss apart from the activations)."""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics
from ckrun.runner.predict.estimate import estimate_peak
from ckrun.runner.train.trainer import Trainer
from tests.runner.memory.tiny_lm import GPT2, HAS_TORCHAO, LLAMA, recipe

KNOBS = [
    ("uncached", "bf16", "{weights: {policy: fp32, cast_cache: false}, checkpointing: {policy: full}}", False),
    ("in-backward", "fp32", "{optimizer_step: {policy: in_backward}}", False),
    ("chunked", "bf16", "{loss: {policy: chunked, chunks: 3}}", False),
    ("bf16-weights", "bf16", "{weights: {policy: bf16}, allow_lossy: true}", True),
    ("bf16-weights-micro-batches", "bf16", "{weights: {policy: bf16}, micro_batch: 2, allow_lossy: true}", True),
    ("8bit", "fp32", "{optimizer_state: {policy: 8bit}, allow_lossy: true}", True),
    ("4bit", "fp32", "{optimizer_state: {policy: 4bit}, allow_lossy: true}", True),
    ("fp8", "fp32", "{optimizer_state: {policy: fp8}, allow_lossy: true}", True),
    ("all-together", "bf16", "{weights: {policy: bf16}, optimizer_state: {policy: 8bit}, optimizer_step: {policy: "
     "in_backward}, loss: {policy: chunked, chunks: 2}, checkpointing: {policy: full}, allow_lossy: true}", True),
]


@pytest.mark.parametrize(("precision", "memory", "torchao"), [k[1:] for k in KNOBS], ids=[k[0] for k in KNOBS])
def test_the_estimate_is_the_measured_cpu_peak(precision, memory, torchao):
    if torchao and not HAS_TORCHAO:
        pytest.skip("torchao (the lowbit extra) is not installed")
    plan_recipe = recipe(memory, GPT2 if "chunked" in memory else LLAMA, precision)
    trainer = Trainer(plan_recipe)
    trainer.train_step()  # the first step creates the optimizer state; the estimate is of later steps
    measured = trainer.train_step()["peak_mem_bytes"]
    estimate = estimate_peak(plan_recipe, "cpu")
    assert estimate.peak_bytes == measured
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes


def test_ckrun_estimate_shows_each_pool_and_what_the_weights_hold(ckrun, tmp_path):
    path = tmp_path / "lm.yaml"
    path.write_text(f"model: {LLAMA}\ndata: {{source: synthetic, seq_len: 16}}\ntrain: {{batch_size: 2, steps: 1}}\n"
                    "precision: bf16\n")
    code, out, err = ckrun("estimate", path, "--device", "cpu", "memory.loss={policy: chunked, chunks: 2}")
    assert code == 0, err
    for pool in ("parameters", "gradients", "optimizer_state", "activations", "weight_casts", "loss"):
        assert f"\n  {pool} " in out
    assert "note: weights: fp32 masters (4 B a parameter)" in out and "memory.loss chunked:2: one piece's logits" in out
    code, out, err = ckrun("estimate", path, "--device", "cpu", "--json", "memory.loss={policy: chunked, chunks: 2}")
    assert json.loads(out)["breakdown"]["loss"] == 0  # the logits never live whole
    assert ckrun(path, "train.device=cpu", f"output.dir={tmp_path / 'run'}", "memory.loss={policy: chunked}")[0] == 0
    assert read_metrics(tmp_path / "run")[0]["loss"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("memory", [
    "{optimizer_offload: {policy: cpu}}",
    "{optimizer_step: {policy: in_backward}, loss: {policy: chunked}, weights: {policy: fp32, cast_cache: false}, "
    "checkpointing: {policy: full}}",
    "{weights: {policy: bf16}, optimizer_state: {policy: 8bit}, allow_lossy: true}",
])
def test_on_a_gpu_the_estimate_is_near_the_measured_reserve(memory):
    """The CUDA estimate (allocator model, torchao's compiled update counted as in place) against the
    allocator's own peak reserve, on a model whose weights and optimizer dominate."""
    from tests.runner.memory.tiny_lm import WIDE

    if "torchao" in memory or "8bit" in memory:
        pytest.importorskip("torchao")
    plan_recipe = recipe(memory, WIDE, "bf16", seq_len=64, batch_size=2, device="cuda")
    trainer = Trainer(plan_recipe)
    trainer.train_step()
    measured = trainer.train_step()["peak_mem_bytes"]
    predicted = estimate_peak(plan_recipe, "cuda").peak_bytes
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)


def test_each_pools_own_most_is_beside_its_bytes_at_the_peak_and_gradients_0_b_is_explained(ckrun, tmp_path):
    """A full fine-tune peaks before backward makes its first gradient: the breakdown's `gradients 0 B` is the
    peak's moment, said in a note; the column beside gives each pool's own most, the gradients' being one fp32
    copy of every parameter (what `torch.optim` needs), however the plan splits the batch."""
    from ckrun.runner.builders.model import build_model

    weights = sum(p.numel() * 4 for p in build_model(recipe().model, "meta").parameters())  # buffers aside
    for memory, at_peak_zero in [("{}", True), ("{micro_batch: 2}", False)]:
        estimate = estimate_peak(recipe(memory), "cpu")
        assert estimate.pool_peaks["gradients"] == weights  # fp32 gradients of fp32 weights, all of them
        assert all(estimate.pool_peaks[pool] >= held for pool, held in estimate.breakdown.items())
        assert sum(estimate.breakdown.values()) == estimate.peak_bytes
        noted = [note for note in estimate.notes if note.startswith("the breakdown is the moment of the peak")]
        assert (estimate.breakdown["gradients"] == 0) == at_peak_zero == bool(noted), (estimate.breakdown, noted)
    recipe_file = tmp_path / "lm.yaml"
    recipe_file.write_text(f"model: {LLAMA}\ndata: {{source: synthetic, seq_len: 16}}\n"
                           "train: {batch_size: 4, steps: 1, device: cpu}\n")
    code, out, err = ckrun("estimate", str(recipe_file), "--device", "cpu")
    assert code == 0, err
    header, gradients = out.splitlines()[1], next(line for line in out.splitlines() if line.strip().startswith("gradients"))
    assert header.split() == ["at", "the", "peak", "own", "most"]
    assert gradients.split()[1:3] == ["0", "B"] and gradients.split()[3:] != ["0", "B"]
    code, out, _ = ckrun("estimate", str(recipe_file), "--device", "cpu", "--json")
    assert json.loads(out)["pool_peaks"]["gradients"] > 0
