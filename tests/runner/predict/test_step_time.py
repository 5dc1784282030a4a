"""The step-time model, checked by counting: FLOPs and bytes priced on made-up device figures, so
every expected number follows from the figures and the shapes, never from a machine or a torch
version's kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict import estimate as estimate_module
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.efficiency import Efficiency
from ckrun.runner.predict.hardware import DeviceFacts
from ckrun.runner.predict.roofline import OpClock, StepWork, price
from ckrun.runner.predict.step_time import StepShape, step_time

# round numbers: 1 TFLOP/s for every dtype, 100 GB/s, no efficiency loss, a 10 us floor per op
FACTS = DeviceFacts(name="test gpu", matmul_tflops={"fp32": 1.0, "tf32": 1.0, "bf16": 4.0, "fp16": 4.0},
                    memory_gbs=100.0, host_gbs=10.0, peer_gbs=50.0, capability=(9, 0), matmul_efficiency=1.0,
                    memory_efficiency=1.0, launch_us=10.0, python_mode_us=0.0)

TINY_BERT = """
model:
  source: transformers
  name: BertForMaskedLM
  config: {vocab_size: 512, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 2,
           intermediate_size: 128, max_position_embeddings: 64, hidden_dropout_prob: 0.0,
           attention_probs_dropout_prob: 0.0}
data: {source: synthetic, seq_len: 32}
train: {batch_size: 8, steps: 2, device: cpu}
"""


def _plan(policy: str = "none", micro_batch: int = 8, **more) -> MemoryPlan:
    checkpointing = {"policy": policy, **({"every": 2} if policy == "every" else {})}
    return MemoryPlan.model_validate({"micro_batch": micro_batch, "checkpointing": checkpointing, **more})


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def estimator(request):
    return Estimator(recipe_from_text(TINY_BERT), request.param, FACTS)


def test_an_op_costs_the_slowest_of_its_flops_bytes_and_the_floor():
    with FakeTensorMode():
        a, b = torch.empty(256, 512), torch.empty(512, 1024)
        small = torch.empty(4)
        with OpClock() as clock:
            a @ b
            big = torch.empty(1 << 24)
            big + big
            small + small
    flops = 2 * 256 * 512 * 1024
    matmul_s = max(flops / 1e12, 4 * (256 * 512 + 512 * 1024 + 256 * 1024) / 100e9)
    add_s = 3 * 4 * (1 << 24) / 100e9  # two reads and a write
    ledger = price(clock.work, FACTS)
    assert ledger.flops[("first", "forward")] == flops
    assert ledger.seconds[("first", "forward")] == pytest.approx(matmul_s + add_s + 10e-6)
    assert len(clock.work.ops) == 3  # empty() allocates and launches nothing


def test_the_compute_rate_follows_the_dtype():
    with FakeTensorMode():
        a = torch.empty(1024, 1024, dtype=torch.bfloat16)
        with OpClock() as clock:
            a @ a
    assert price(clock.work, FACTS).seconds[("first", "forward")] == pytest.approx(2 * 1024**3 / 4e12)


def test_recompute_is_counted_as_hardware_flops_not_model_flops(estimator):
    none = estimator.estimate(_plan("none")).time
    full = estimator.estimate(_plan("full")).time
    every = estimator.estimate(_plan("every")).time
    assert none.recompute_s == 0 and none.flops == none.model_flops
    assert full.model_flops == none.model_flops == every.model_flops
    assert 0 < every.flops - none.flops < full.flops - none.flops  # half the blocks recompute half the work
    assert full.recompute_s > every.recompute_s > 0
    assert full.mfu < full.hfu and none.mfu == pytest.approx(none.hfu)
    assert full.seconds == pytest.approx(none.seconds + full.recompute_s)


def test_selective_recomputes_less_than_full(estimator):
    """It keeps the products' outputs, so its recompute is mostly pointwise traffic (on CUDA the
    attention kernel, which it does not keep, is run again too)."""
    full = estimator.estimate(_plan("full")).time
    selective = estimator.estimate(_plan("selective")).time
    assert 0 <= selective.flops - selective.model_flops < full.flops - full.model_flops
    assert 0 < selective.recompute_s < full.recompute_s


@pytest.mark.parametrize("micro_batch", [1, 2, 4])
def test_splitting_the_batch_keeps_the_model_flops_and_adds_floors(estimator, micro_batch):
    """The step runs two micro-batches and extrapolates: the FLOPs of the whole batch must come out
    the same whatever the split, and smaller micro-batches can only cost more (more op floors,
    weights read more often)."""
    whole = estimator.estimate(_plan("none", 8)).time
    split = estimator.estimate(_plan("none", micro_batch)).time
    assert split.model_flops == pytest.approx(whole.model_flops, rel=1e-12)
    assert split.seconds > whole.seconds
    assert split.samples_per_s == pytest.approx(8 / split.seconds)
    # the optimizer runs once a step: each extra micro-batch adds only its loss's running sum, one small op
    extra = 8 // micro_batch - 1
    assert whole.update_s <= split.update_s <= whole.update_s + extra * 2 * FACTS.launch_us * 1e-6


GPT2 = """
model:
  source: transformers
  name: GPT2LMHeadModel
  config: {vocab_size: 300, n_embd: 32, n_layer: 3, n_head: 2, n_positions: 32}
data: {source: synthetic, seq_len: 16}
train: {batch_size: 12, steps: 2, device: cpu}
"""
VISION = """
model: {source: torchvision, name: resnet18, config: {num_classes: 10}}
data: {source: synthetic, image_size: 32}
train: {batch_size: 8, steps: 2, device: cpu}
"""
_ESTIMATORS: dict = {}


def _cached(text: str, device: str) -> Estimator:
    if (text, device) not in _ESTIMATORS:
        _ESTIMATORS[(text, device)] = Estimator(recipe_from_text(text), device, FACTS)
    return _ESTIMATORS[(text, device)]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # 3 s each
@given(model=st.sampled_from([TINY_BERT, GPT2, VISION]), device=st.sampled_from(["cpu", "cuda"]),
       policy=st.sampled_from(["none", "full", "every", "selective", "sqrt"]),
       precision=st.sampled_from(["fp32", "bf16"]), split=st.sampled_from([3, 4, 6]))
def test_the_two_micro_batches_run_give_the_peak_and_time_of_all(monkeypatch, model, device, policy, precision,
                                                                  split):
    """Every later micro-batch repeats the second: running them all gives the same peak (CPU: live
    bytes; CUDA: the allocator model's reserved bytes), and the time the clock extrapolated."""
    estimator = _cached(model, device)
    batch = estimator.recipe.train.batch_size
    assume(batch % split == 0)
    plan = _plan(policy, batch // split)
    short = estimator.estimate(plan, precision)
    monkeypatch.setattr(estimate_module, "MICRO_BATCHES_RUN", split)
    whole = estimator.estimate(plan, precision)
    monkeypatch.setattr(estimate_module, "MICRO_BATCHES_RUN", 2)
    assert short.peak_bytes == whole.peak_bytes
    assert short.time.flops == pytest.approx(whole.time.flops, rel=1e-12)
    assert short.time.seconds == pytest.approx(whole.time.seconds, rel=1e-9)


def test_offload_copies_hide_behind_compute_until_the_link_is_too_slow():
    recipe = recipe_from_text(TINY_BERT)
    plan = _plan("none", 8, offload={"policy": "all", "min_bytes": 0})  # the tiny model saves small tensors
    exposed = []
    for host_gbs in (1e6, 10.0, 0.01):
        facts = FACTS.model_copy(update={"host_gbs": host_gbs})
        step = Estimator(recipe, "cuda", facts).estimate(plan).time
        exposed.append(step.offload_s)
    assert exposed[0] == 0.0 and 0 <= exposed[1] < exposed[2]
    moved = Estimator(recipe, "cuda", FACTS).estimate(_plan("none", 8)).time.offload_s
    assert moved == 0.0


def test_python_mode_cost_lands_on_selective_blocks_only():
    recipe = recipe_from_text(TINY_BERT)
    slow = FACTS.model_copy(update={"python_mode_us": 1000.0})
    for policy in ("none", "full"):
        assert Estimator(recipe, "cuda", slow).estimate(_plan(policy)).time.seconds == pytest.approx(
            Estimator(recipe, "cuda", FACTS).estimate(_plan(policy)).time.seconds)
    fast = Estimator(recipe, "cuda", FACTS).estimate(_plan("selective")).time
    moded = Estimator(recipe, "cuda", slow).estimate(_plan("selective")).time
    assert moded.forward_s > fast.forward_s and moded.recompute_s > fast.recompute_s


def test_tokens_per_second_for_language_models(estimator):
    step = estimator.estimate(_plan("none")).time
    assert step.tokens_per_s == pytest.approx(step.samples_per_s * 32)


def test_one_step_priced_on_another_device_is_that_devices_estimate():
    recipe = recipe_from_text(TINY_BERT)
    other = FACTS.model_copy(update={"name": "other", "memory_gbs": 7.0, "launch_us": 3.0})
    here = Estimator(recipe, "cuda", FACTS).estimate(_plan("full", 4))
    there = Estimator(recipe, "cuda", other).estimate(_plan("full", 4))
    assert here.time_on(other) == there.time
    assert here.time_on(other).seconds != here.time.seconds


def test_no_facts_no_time():
    assert Estimator(recipe_from_text(TINY_BERT), "cpu").estimate().time is None


def test_selectives_learning_forward_is_priced_once_outside_the_step(estimator):
    """Selective checkpointing runs each block's forward once more, in the first step only, to learn
    which ops it may cache (runner/memory/selective.py). That is no part of every step: the step's
    FLOPs and MFU are those of no plan plus its recompute, and the learning forward (here: the blocks'
    forward of one micro-batch, fp32 with no mode cost) is the first step's extra."""
    for micro_batch in (8, 2):
        none = estimator.estimate(_plan("none", micro_batch)).time
        selective = estimator.estimate(_plan("selective", micro_batch)).time
        assert selective.model_flops == none.model_flops
        assert selective.mfu <= none.mfu
        one_micro_batch = sum(block.forward_s for block in none.blocks) / (8 // micro_batch)
        assert selective.first_step_extra_s == pytest.approx(one_micro_batch)
        assert none.first_step_extra_s == 0.0


EFFICIENT = FACTS.model_copy(update={"sms": 4, "efficiency": Efficiency(
    matmul={"fp32": 0.5, "tf32": 0.5, "bf16": 0.5, "fp16": 0.5}, conv={"fp32": 0.25, "tf32": 0.25, "bf16": 0.25},
    attention={"flash": 0.125, "efficient": 0.0625, "cudnn": 0.125}, memory=0.5, optimizer=0.25, tile=128)})


def test_each_class_of_kernel_is_priced_at_its_own_share():
    """Products at the matmul share slowed by wave quantisation (4 SMs: 6 tiles of 128 x 128 take two
    waves of 4, 3/4 busy), convolutions at theirs, attention at its family's, elementwise bytes at the
    memory share and the optimizer's at its own."""
    with FakeTensorMode():
        a, b = torch.empty(384, 512, dtype=torch.bfloat16), torch.empty(512, 256, dtype=torch.bfloat16)
        full = torch.empty(256, 512, dtype=torch.bfloat16)
        image, weight = torch.empty(1, 8, 16, 16), torch.empty(8, 8, 3, 3)
        q = torch.empty(1, 2, 64, 32, dtype=torch.bfloat16)
        big = torch.empty(1 << 20)
        with OpClock() as clock:
            a @ b
            full @ b
            torch.nn.functional.conv2d(image, weight, padding=1)
            torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, False, False)
            big + big
    ledger = price(clock.work, EFFICIENT)
    product, whole_waves, conv, attention, add = clock.work.ops
    slowest = lambda op, compute_s, share=0.5: max(compute_s, op.nbytes / (100e9 * share), 10e-6)  # noqa: E731
    expected = (slowest(product, 2 * 384 * 512 * 256 / (4e12 * 0.5 * 0.75))
                + slowest(whole_waves, 2 * 256 * 512 * 256 / (4e12 * 0.5))
                + slowest(conv, 2 * 8 * 8 * 9 * 16 * 16 / (1e12 * 0.25))
                + slowest(attention, attention.flops / (4e12 * 0.125)) + slowest(add, 0.0))
    assert [op.op_class for op in clock.work.ops] == ["matmul", "matmul", "conv", "attention", "memory"]
    assert attention.family == "flash" and attention.flops == 4 * 2 * 64 * 64 * 32
    assert add.nbytes == 3 * 4 * (1 << 20) and product.outputs == (1, 384, 256)
    assert ledger.seconds[("first", "forward")] == pytest.approx(expected)


def test_attention_is_priced_by_direction_mask_and_dtype_and_norms_at_their_own_share():
    """A family's backward and causal forward at their own figures (FlashAttention-3's H100 tables give them
    apart); fp32 attention as SDPA runs it (the memory-efficient kernel, 3xTF32 products on sm80+) at its
    half-precision rate over its measured slowdown; layer norm at the norm shares, forward and backward; each
    product paying its fill time."""
    facts = EFFICIENT.model_copy(update={"efficiency": EFFICIENT.efficiency.model_copy(update={
        "attention_causal": {"flash": 0.1}, "attention_backward": {"flash": 0.05}, "efficient_fp32_slowdown": 4.0,
        "norm": {"forward": 0.25, "backward": 0.2}, "matmul_fill_us": {"bf16": 3.0}})})
    with FakeTensorMode():
        q = torch.empty(1, 2, 64, 32, dtype=torch.bfloat16, requires_grad=True)
        q32 = torch.empty(1, 2, 64, 32, requires_grad=True)
        x = torch.empty(256, 1024, requires_grad=True)
        a = torch.empty(256, 256, dtype=torch.bfloat16)
        with OpClock() as clock:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, False)[0]
            out.sum().backward()
            torch.ops.aten._scaled_dot_product_efficient_attention(q32, q32, q32, None, False)
            torch.nn.functional.layer_norm(x, (1024,)).sum().backward()
            a @ a
    at = {(op.op_class, op.family, op.backward_kernel, op.dtype): op for op in clock.work.ops
          if op.op_class in ("attention", "norm", "matmul")}
    forward, backward = at[("attention", "flash", False, "bf16")], at[("attention", "flash", True, "bf16")]
    fp32, product = at[("attention", "efficient", False, "fp32")], at[("matmul", "", False, "bf16")]
    norm_f, norm_b = at[("norm", "", False, "fp32")], at[("norm", "", True, "fp32")]
    assert forward.causal and backward.causal and not fp32.causal
    alone = lambda op: price(StepWork(ops=[op]), facts).seconds[("first", op.phase)]  # noqa: E731
    causal_ratio = 0.1 / 0.125  # causal backward scales as causal forward does
    assert alone(forward) == pytest.approx(max(forward.flops / (4e12 * 0.1), 10e-6))
    assert alone(backward) == pytest.approx(max(backward.flops / (4e12 * 0.05 * causal_ratio), 10e-6))
    assert alone(fp32) == pytest.approx(max(fp32.flops / (4e12 * 0.0625 / 4.0), 10e-6))
    assert alone(norm_f) == pytest.approx(max(norm_f.nbytes / (100e9 * 0.25), 10e-6))
    assert alone(norm_b) == pytest.approx(max(norm_b.nbytes / (100e9 * 0.2), 10e-6))
    assert alone(product) == pytest.approx(max(2 * 256**3 / (4e12 * 0.5 * facts.wave_share(product.outputs,
                                                                                           product.flops)) + 3e-6,
                                               product.nbytes / 50e9, 10e-6))


def test_the_optimizer_step_is_priced_at_its_own_share(estimator):
    step_work = estimator.estimate(_plan("none")).work
    update = [op for op in step_work.ops if op.phase == "update" and op.op_class == "optimizer"]
    assert update, "the optimizer's kernels are classed as such"
    slow = EFFICIENT.model_copy(update={"efficiency": EFFICIENT.efficiency.model_copy(update={"optimizer": 0.01})})
    update_s = lambda facts: sum(s for (_, phase), s in price(step_work, facts).seconds.items()  # noqa: E731
                                 if phase == "update")
    assert update_s(slow) > update_s(EFFICIENT) > 0


@pytest.mark.parametrize("tf32, products, convolutions", [(None, "fp32", "tf32"), (True, "tf32", "tf32"),
                                                           (False, "fp32", "fp32")])
def test_fp32_products_and_convolutions_run_at_the_rate_the_tf32_key_gives(tf32, products, convolutions):
    """The recipe's `tf32`: unset keeps torch's defaults (products in full fp32, cuDNN convolutions in
    TF32), true puts both on TF32 tensor cores, false neither."""
    rates = FACTS.model_copy(update={"matmul_tflops": {"fp32": 1.0, "tf32": 8.0, "bf16": 16.0, "fp16": 16.0}})
    with FakeTensorMode():
        a = torch.empty(1024, 1024)
        image, weight = torch.empty(4, 64, 32, 32), torch.empty(64, 64, 3, 3)
        with OpClock(tf32=tf32) as clock:
            a @ a
            torch.nn.functional.conv2d(image, weight, padding=1)
    product, convolution = (price(StepWork(ops=[op], matmul_tf32=clock.work.matmul_tf32,
                                           conv_tf32=clock.work.conv_tf32), rates).seconds[("first", "forward")]
                            for op in clock.work.ops)
    rate = {"fp32": 1e12, "tf32": 8e12}
    assert product == pytest.approx(2 * 1024**3 / rate[products])
    conv = clock.work.ops[1]
    moved = conv.nbytes + (conv.layout_bytes if convolutions == "tf32" else 0)  # cuDNN's NCHW transposes on tensor cores
    assert conv.layout_bytes > 0
    assert convolution == pytest.approx(max(2 * 4 * 64 * 64 * 9 * 32 * 32 / rate[convolutions], moved / 100e9))


@pytest.mark.parametrize("tf32", [False, True])
def test_mfu_is_stated_against_the_peak_each_op_was_priced_at(tf32):
    """ResNet-50 without a tf32 key reported 141.8 % MFU: its convolutions ran at TF32's rate, its MFU was
    stated against fp32's peak. Each op's FLOPs now count against the peak of the rate it was priced at:
    products at fp32's or TF32's, the memory-efficient kernel's fp32 attention at its 3xTF32 peak."""
    rates = FACTS.model_copy(update={"matmul_tflops": {"fp32": 1.0, "tf32": 8.0, "bf16": 16.0, "fp16": 16.0},
                                     "memory_gbs": 1e6, "launch_us": 0.0})  # the tiny model's FLOPs decide
    estimate = Estimator(recipe_from_text(TINY_BERT + ("tf32: true\n" if tf32 else "")), "cuda",
                         rates).estimate(_plan("none"))
    step = estimate.time
    peaks = {"matmul": 8e12 if tf32 else 1e12, "attention": 8e12 / 3}
    counted = [op for op in estimate.work.ops if op.flops and op.phase in ("forward", "backward", "update")]
    assert {op.op_class for op in counted} <= set(peaks)
    assert step.mfu == pytest.approx(sum(op.flops / peaks[op.op_class] for op in counted) / step.seconds)
    assert 0 < step.mfu <= 1 and step.hfu <= 1


def test_a_convolution_net_without_a_tf32_key_stays_under_full_utilisation():
    """cuDNN runs fp32 convolutions in TF32 unless told not to; MFU follows it."""
    rates = FACTS.model_copy(update={"matmul_tflops": {"fp32": 1.0, "tf32": 8.0, "bf16": 16.0, "fp16": 16.0},
                                     "memory_gbs": 1e6, "launch_us": 0.0})
    with FakeTensorMode():
        image, weight = torch.empty(4, 64, 32, 32), torch.empty(64, 64, 3, 3)
        with OpClock() as clock:  # the recipe leaves tf32 unset: convolutions in TF32, products in fp32
            torch.nn.functional.conv2d(image, weight, padding=1)
    step = step_time(clock.work, StepShape(micro_batches=1, samples=4, tokens_per_sample=None, precision="fp32"),
                     rates)
    assert step.mfu == pytest.approx(1.0) and step.mfu <= 1 + 1e-9
