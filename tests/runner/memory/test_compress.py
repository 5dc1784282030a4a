"""Activation compression: saved activations rounded to bf16 or fp8. The bytes it saves are counted
(by dtype, through saved-tensor hooks around the model), the forward is untouched, the gradient error
is small, measured and reported, it composes with checkpointing and offload, and it is refused
without the opt-in."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.flop_counter import FlopCounterMode

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.blocks import find_blocks, wrap_forward
from ckrun.runner.memory.compress import ActivationCompression, apply_compression, to_fp8
from ckrun.runner.memory.compress import FP8
from ckrun.runner.plan.policies import CastCompression
from ckrun.runner.memory.tracker import LiveBytesTracker
from ckrun.runner.memory.offload import ActivationOffload, CopyTransport, ModuleStorages
from ckrun.runner.plan.memory_plan import MemoryPlan

POLICIES = ["bf16"] + (["fp8"] if FP8 is not None else [])


def chain(blocks: int = 4, width: int = 64) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)) for _ in range(blocks)])


def plan(**memory) -> MemoryPlan:
    return MemoryPlan.model_validate(memory)


def lossy(policy: str, **memory) -> MemoryPlan:
    return plan(compression={"policy": policy, "min_bytes": 0}, allow_lossy=True, **memory)


def saved_by_dtype(model: nn.Module, x: torch.Tensor) -> tuple[Counter, torch.Tensor]:
    """Bytes autograd keeps for backward, per dtype, as hooks around the whole model see them (the
    block hooks chain to these), and the loss."""
    counts = Counter()

    def pack(tensor):
        counts[tensor.dtype] += tensor.numel() * tensor.element_size()
        return tensor
    with saved_tensors_hooks(pack, lambda t: t):
        torch.manual_seed(1)
        loss = model(x).square().mean()
    return counts, loss


def gradients(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    model(x).square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- bytes -----------------------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(blocks=st.integers(2, 5), width=st.sampled_from([8, 32, 48]), batch=st.integers(1, 6),
       policy=st.sampled_from(POLICIES))
def test_saved_bytes_shrink_as_counted(blocks, width, batch, policy):
    model, x = chain(blocks, width), torch.randn(batch, width)
    exact, exact_loss = saved_by_dtype(model, x)
    with apply_plan(model, lossy(policy), "cpu") as applied:
        compressed, loss = saved_by_dtype(model, x)
    counted = applied.compression
    assert torch.equal(loss, exact_loss)  # the forward computes with the originals: only the saved copies change
    assert counted.count > 0 and counted.original_bytes > 0
    ratio = 2 if policy == "bf16" else 4
    scales = 0 if policy == "bf16" else 4 * counted.count  # one fp32 scale per fp8 tensor
    assert counted.stored_bytes == counted.original_bytes // ratio + scales
    # what the hooks outside see: the rounded copies in place of the originals, byte for byte
    assert compressed[torch.float32] == exact[torch.float32] - counted.original_bytes
    assert compressed[counted.target] == counted.original_bytes // ratio
    assert sum(compressed.values()) < sum(exact.values())


def test_small_tensors_weights_and_integers_keep_their_dtype():
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 16))
    ids = torch.randint(0, 50, (4, 8))
    compression = ActivationCompression(CastCompression(policy="bf16", min_bytes=4 * 8 * 16 * 4 + 1))  # just over one activation
    with compression.hooks(model):
        model(ids).sum().backward()
    assert compression.count == 0  # the ids are integers, the weights are the model's own, activations too small


# --- fp8's scale ------------------------------------------------------------------------------

needs_fp8 = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
HALVES = [torch.float16, torch.bfloat16]


@needs_fp8
@pytest.mark.parametrize("dtype", [*HALVES, torch.float32])
def test_fp8_packing_holds_one_transient_of_the_tensors_own_size(dtype):
    """Scaled in the tensor's dtype: the quotient and the fp8 copy, not fp32 copies (4x a bf16 tensor)."""
    tensor = torch.randn(1 << 20).to(dtype)
    tracker = LiveBytesTracker("cpu")
    tracker.count_existing([tensor])
    with tracker:
        rounded, scale = to_fp8(tensor)
    extra = tracker.peak_bytes - tensor.nbytes
    tracker.close()
    assert rounded.dtype == FP8 and scale.dtype == dtype
    assert extra <= tensor.nbytes + rounded.nbytes + 1024, extra / tensor.nbytes


@needs_fp8
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("magnitude", [1e-5, 1.0, 1e4])
def test_fp8_round_trip_keeps_small_and_large_values(dtype, magnitude):
    """In fp16 the scale of a tensor of small values (amax / 448 < fp16's smallest number) used to
    underflow to zero on unpacking, and the tensor with it."""
    tensor = (torch.randn(4096) * magnitude).to(dtype)
    rounded, scale = to_fp8(tensor)
    back = rounded.to(dtype) * scale
    assert relative_error(back.float(), tensor.float()) < 0.1


@needs_fp8
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_an_overflowed_tensor_unpacks_as_nan_never_as_zeros(dtype, bad):
    """fp16's GradScaler must see the overflow in the gradients and skip the step."""
    tensor = torch.randn(64).to(dtype)
    tensor[7] = bad
    compression = ActivationCompression(CastCompression(policy="fp8", min_bytes=0))
    entry = compression._pack(ModuleStorages(nn.Linear(1, 1)), None, tensor)
    assert torch.isnan(compression._unpack(None, entry)).all()


# --- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, bound", [("bf16", 2e-2), ("fp8", 1e-1)])
def test_gradient_error_is_small_but_real(policy, bound):
    if policy not in POLICIES:
        pytest.skip("this torch has no float8_e4m3fn")
    model, x = chain(), torch.randn(16, 64)
    exact = gradients(model, x)
    with apply_plan(model, lossy(policy), "cpu"):
        error = relative_error(gradients(model, x), exact)
    assert 0 < error < bound


@pytest.mark.parametrize("checkpointing", [{"policy": "full"}, {"policy": "every", "every": 2},
                                           {"policy": "selective"}])
def test_composes_with_checkpointing(checkpointing):
    """The recompute still happens (backward FLOPs as without compression), what the checkpoint keeps
    is compressed, and the gradient stays close."""
    model, x = chain(), torch.randn(16, 64)
    exact = gradients(model, x)

    def backward_flops(memory: MemoryPlan) -> tuple[int, float]:
        with apply_plan(model, memory, "cpu") as applied:
            torch.manual_seed(1)
            loss = model(x).square().mean()
            with FlopCounterMode(display=False) as counter:
                loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
            assert applied.compression is None or applied.compression.count > 0
        return counter.get_total_flops(), relative_error(grads, exact)

    checkpointed, exact_error = backward_flops(plan(checkpointing=checkpointing))
    compressed, error = backward_flops(lossy("bf16", checkpointing=checkpointing))
    plain, _ = backward_flops(plan())
    assert exact_error == 0 and compressed == checkpointed
    # selective keeps the matmuls' outputs and recomputes pointwise ops, which count no FLOPs
    assert checkpointed > plain or checkpointing["policy"] == "selective"
    assert 0 < error < 2e-2


def test_selective_caching_says_whether_it_passes_through_the_hooks():
    """torch >= 2.14 asks whether SAC's cached outputs pass through saved-tensor hooks around the
    checkpoint, and warns when nobody said; ckrun nests SAC's mode in its own, so it says so itself:
    what selective caches is compressed (and offloaded) like every other saved tensor."""
    import warnings

    model, x = chain(), torch.randn(16, 64)
    counts = {}
    for name, memory in (("alone", lossy("bf16")), ("selective", lossy("bf16", checkpointing={"policy": "selective"}))):
        with warnings.catch_warnings(), apply_plan(model, memory, "cpu") as applied:
            warnings.simplefilter("error", FutureWarning)
            model(x).square().mean().backward()
            counts[name] = applied.compression.count
    assert counts["selective"] > 0


def test_composes_with_offload():
    """On a block that is offloaded too, the rounded copy is what goes to the host: half the bytes."""
    model, x = chain(), torch.randn(16, 64)
    exact = gradients(model, x)
    blocks = find_blocks(model)
    undo, compression = apply_compression(blocks, lossy("bf16").compression)
    offload = ActivationOffload("cpu", 0, CopyTransport("cpu", "cpu"))
    undos = [wrap_forward(block.module, offload.wrapper, block.module) for block in blocks]
    try:
        error = relative_error(gradients(model, x), exact)
    finally:
        for step in reversed(undos):
            step()
        undo()
    assert compression.count > 0 and offload.offloaded_bytes == compression.stored_bytes
    assert 0 < error < 2e-2


# --- the opt-in, and the report --------------------------------------------------------------


def test_refused_without_the_opt_in(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "memory.compression={policy: bf16}", f"output.dir={tmp_path / 'r'}")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "memory.compression: bf16 stores saved activations rounded" in lines[0]
    assert "memory.allow_lossy: true" in lines[0] and "--allow-lossy" in lines[0]


def test_refused_by_apply_plan_too():
    with pytest.raises(ValueError, match="^memory.compression: bf16 stores saved activations rounded"):
        apply_plan(chain(), plan(compression={"policy": "bf16"}), "cpu")
    with pytest.raises(ValueError, match="^memory.compression: cannot be combined with memory.compile"):
        apply_plan(chain(), lossy("bf16", compile=True), "cpu")


def test_training_reports_the_gradient_error(tmp_path, ckrun, caplog):
    caplog.set_level(logging.INFO)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", "memory.compression={policy: bf16}",
                         "memory.allow_lossy=true", f"output.dir={tmp_path / 'r'}")
    assert code == 0, err
    reports = [r.getMessage() for r in caplog.records if "relative gradient error" in r.getMessage()]
    assert len(reports) == 1 and reports[0].startswith("memory.compression bf16 is lossy"), reports
    error = float(reports[0].split("relative gradient error ")[1].split()[0])
    assert 0 < error < 5e-2


@pytest.mark.parametrize("policy", POLICIES)
def test_the_cpu_estimate_counts_it_as_training_measures(tmp_path, policy):
    """The estimator runs the same hooks on fake tensors: its CPU peak is the peak a real step measures."""
    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.predict.estimate import estimate_peak
    from ckrun.runner.train.trainer import Trainer

    recipe = load_recipe(BERT_TINY, [*TINY_BERT, f"memory.compression={{policy: {policy}}}", "memory.allow_lossy=true",
                                     f"output.dir={tmp_path}"])
    trainer = Trainer(recipe)
    trainer.train_step()  # the first step creates the optimizer state; the estimate is of later steps
    measured = trainer.train_step()["peak_mem_bytes"]
    exact = estimate_peak(recipe.model_copy(update={"memory": MemoryPlan()}), "cpu")
    estimate = estimate_peak(recipe, "cpu")
    assert estimate.peak_bytes == measured
    assert estimate.breakdown["activations"] < exact.breakdown["activations"]


def test_an_exact_pass_that_runs_out_of_memory_leaves_the_error_unmeasured(tmp_path, monkeypatch, caplog):
    """The exact plan keeps every activation: where that does not fit, training goes on, and says so."""
    import ckrun.runner.train.measure.lossy
    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.train.trainer import Trainer

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(ckrun.runner.train.measure.lossy, "gradient_error", out_of_memory)
    caplog.set_level(logging.INFO)
    trainer = Trainer(load_recipe(BERT_TINY, [*TINY_BERT, "memory.compression={policy: bf16}", "memory.allow_lossy=true",
                                              f"output.dir={tmp_path}"]))
    assert trainer.gradient_error is None and trainer.train_step()["step"] == 1
    assert any("the gradient error was not measured" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("pools", [["memory.optimizer_step={policy: in_backward}", "train.grad_clip=null"],
                                   ["memory.weights={policy: bf16}", "precision=bf16", "memory.micro_batch=2"]],
                         ids=["in-backward", "bf16-sums"])
def test_measuring_the_gradient_error_neither_updates_nor_leaves_gradients_behind(tmp_path, pools):
    """The error's two passes run before the optimizer puts its hooks on the parameters: with them, the
    update in the backward stepped AdamW twice before step 1 (its moments and step count moved), and
    bf16 weights' float32 sums carried the passes' gradients into step 1's."""
    pytest.importorskip("torchao")
    from ckrun.runner.builders.model import build_model
    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.train.trainer import Trainer

    recipe = load_recipe(BERT_TINY, [*TINY_BERT, *pools, "memory.compression={policy: bf16}", "memory.allow_lossy=true",
                                     f"output.dir={tmp_path}"])
    trainer = Trainer(recipe)
    torch.manual_seed(recipe.train.seed)
    fresh = build_model(recipe.model)
    assert trainer.gradient_error > 0 and not trainer.optimizer.state
    assert all(torch.equal(p, q.to(p.dtype)) for p, q in zip(trainer.model.parameters(), fresh.parameters(), strict=True))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert not getattr(trainer.planned.stepper, "_sums", {})
