"""Optimizer offload to host memory: the same update computed on the host (bit for bit where the
host's kernels are the device's: a CPU run with the CPU as host), the device bytes it removes
counted by the estimate on fake CUDA tensors with the meta device as host, and the real thing on a GPU."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckrun.runner.builders.optim import build_scheduler
from ckrun.runner.memory.host_optimizer import HostOffloadOptimizer, offloaded_share
from ckrun.runner.memory.measure import PeakMeter
from ckrun.runner.memory.optimizers import build_planned_optimizer
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.problems import InputError
from tests.runner.memory.tiny_lm import WIDE, identical, recipe, train
from ckrun.runner.train.trainer import Trainer

CPU = torch.device("cpu")


def offloaded(recipe_, fraction: float, gradients_final: bool) -> Trainer:
    """A CPU trainer whose optimizer is the host offload's with the CPU as its host (a CPU run refuses
    the knob: there is no device memory to save, but the arithmetic and bookkeeping are the same)."""
    trainer = Trainer(recipe_)
    plan = MemoryPlan(optimizer_offload={"policy": "cpu", "fraction": fraction})
    trainer.planned = build_planned_optimizer(trainer.model, recipe_.train, plan, CPU, gradients_final, host=CPU)
    trainer.optimizer = trainer.planned.optimizer
    trainer.scheduler = build_scheduler(trainer.optimizer, recipe_.train, trainer.total_steps)
    trainer.meter = PeakMeter(CPU, trainer.model, trainer.optimizer)
    return trainer


@pytest.mark.parametrize(("fraction", "memory", "train_keys"), [
    (1.0, "{}", {}),  # one micro-batch, no clipping: each gradient goes to the host in the backward
    (0.5, "{micro_batch: 2}", {"grad_clip": 1.0, "scheduler": {"name": "cosine", "warmup_steps": 1}}),
    (0.01, "{}", {"grad_clip": 0.5}),  # one tensor on the host, the rest on the device
], ids=["all-in-backward", "half-accumulated-clipped", "one-tensor"])
def test_the_host_update_is_the_device_update_bit_for_bit(fraction, memory, train_keys):
    plain = train(recipe(memory, **train_keys), steps=3)
    trainer = offloaded(recipe(memory, **train_keys), fraction, gradients_final=not train_keys and memory == "{}")
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert losses == plain[0]
    assert identical([p.detach() for p in trainer.model.parameters()], plain[1])
    moved = trainer.optimizer.copies
    assert 0 < len(moved) <= len(plain[1]) and (fraction < 1) == (trainer.optimizer.device_optimizer is not None)
    assert all(copy.device == CPU and copy is not param for param, copy in moved.items())


def test_an_offloaded_run_resumes_from_its_checkpoint_as_if_it_never_stopped():
    straight = offloaded(recipe(), 0.5, True)
    losses = [straight.train_step()["loss"] for _ in range(4)]
    first = offloaded(recipe(), 0.5, True)
    for _ in range(2):
        first.train_step()
    checkpoint = io.BytesIO()
    torch.save(first.state(), checkpoint)
    checkpoint.seek(0)
    second = offloaded(recipe(), 0.5, True)
    second.restore(torch.load(checkpoint, weights_only=True))  # the host copies follow the loaded weights
    assert [second.train_step()["loss"] for _ in range(2)] == losses[2:]
    assert identical([p.detach() for p in second.model.parameters()], [p.detach() for p in straight.model.parameters()])


def test_the_estimate_counts_what_the_offload_takes_off_the_device():
    """On fake CUDA tensors, with the meta device as host: the moved parameters' AdamW moments (8 B a
    float32 parameter) leave the device, and with one micro-batch their gradients go as they are made."""
    estimator = Estimator(recipe("{}", WIDE, seq_len=8, batch_size=1), "cuda")
    none = estimator.estimate(MemoryPlan())
    params = [p for p in estimator.model.parameters()]
    for fraction in (0.5, 1.0):
        plan = MemoryPlan(optimizer_offload={"policy": "cpu", "fraction": fraction})
        moved = offloaded_share(params, fraction)
        moved_bytes = sum(p.numel() * p.element_size() for p in moved)
        estimate = estimator.estimate(plan)
        assert none.breakdown["optimizer_state"] - estimate.breakdown["optimizer_state"] == 2 * moved_bytes
        scalars = 4 * len(moved)  # AdamW's step counters: CPU tensors, the host's in a real run
        assert estimate.breakdown["gradients"] <= sum(p.numel() * p.element_size() for p in params) - moved_bytes
        assert f"memory.optimizer_offload {plan.optimizer_offload.label()}: " in " ".join(estimate.notes)
        optimizer = estimator._optimizing(plan).optimizer
        assert isinstance(optimizer, HostOffloadOptimizer) and optimizer.host_bytes() == 4 * moved_bytes + scalars
        assert all(copy.device.type == "meta" for copy in optimizer.copies.values())
    assert estimator.estimate(MemoryPlan()) == none  # the other plans' optimizers leave no hooks behind


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=12), fraction=st.floats(0.001, 1.0))
def test_the_offloaded_share_is_the_shortest_prefix_reaching_the_fraction(sizes, fraction):
    params = [torch.nn.Parameter(torch.empty(size, device="meta")) for size in sizes]
    chosen = offloaded_share(params, fraction)
    total, taken = 4 * sum(sizes), 4 * sum(sizes[: len(chosen)])
    assert chosen == params[: len(chosen)] and len(chosen) >= 1
    assert taken >= fraction * total - 1e-6 * total and 4 * sum(sizes[: len(chosen) - 1]) < fraction * total


@pytest.mark.parametrize(("memory", "precision", "refusal"), [
    ("{optimizer_offload: {policy: cpu}, optimizer_step: {policy: in_backward}}", "fp32",
     "memory.optimizer_offload: cannot be combined with memory.optimizer_step: in_backward"),
    ("{optimizer_offload: {policy: cpu}, weights: {policy: bf16}, allow_lossy: true}", "bf16",
     "memory.optimizer_offload: cannot be combined with memory.weights: bf16"),
    ("{optimizer_offload: {policy: cpu}}", "fp16", "memory.optimizer_offload: fp16's loss scaler unscales gradients"),
    ("{optimizer_offload: {policy: cpu, fraction: 0}}", "fp32", "memory.optimizer_offload.fraction: input should be "
     "greater than 0 (got 0)"),
])
def test_what_the_offload_cannot_combine_with_is_one_line(memory, precision, refusal):
    with pytest.raises(InputError) as refused:
        recipe(memory, precision=precision)
    assert refusal in str(refused.value)


def test_a_cpu_run_refuses_the_offload_in_one_line():
    with pytest.raises(InputError, match="memory.optimizer_offload: moves optimizer state from the GPU to host memory; "
                                         "this run is on the CPU"):
        Trainer(recipe("{optimizer_offload: {policy: cpu}}"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("plain", "offload"), [
    ("{}", "{optimizer_offload: {policy: cpu}}"),
    ("{micro_batch: 2}", "{optimizer_offload: {policy: cpu, fraction: 0.5}, micro_batch: 2}"),
])
def test_on_a_gpu_the_offload_trains_as_the_device_does_with_less_device_memory(plain, offload):
    """The host's fused CPU AdamW rounds as the CPU does: the same run within float rounding, and the
    device's peak lower by about the moved moments."""
    def run(memory: str):
        trainer = Trainer(recipe(memory, WIDE, precision="bf16", device="cuda"))
        records = [trainer.train_step() for _ in range(3)]
        return [r["loss"] for r in records], max(r["peak_allocated_bytes"] for r in records[1:]), trainer
    device, host = run(plain), run(offload)
    assert host[0] == pytest.approx(device[0], rel=1e-4)
    assert isinstance(host[2].optimizer, HostOffloadOptimizer)
    moments = sum(p.numel() * 8 for p in host[2].optimizer.copies)
    assert device[1] - host[1] >= 0.8 * moments
