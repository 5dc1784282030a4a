"""torchao's AdamW as ranks step it (runner/memory/optimizers.py): bf16 weights round stochastically
from a generator seeded by (train.seed, step, parameter), so copies that must stay identical (DDP's
replicas, whose default generators are seeded apart for dropout) round identically, on the CPU and on
CUDA (compiled); and quantized moments of bf16 weights on FSDP2's shards (DTensors) update, where
torchao's own bf16-appearing moments stop the step."""

from __future__ import annotations

import pytest
import torch

from ckrun.runner.memory.optimizers import torchao_adamw
from tests.runner.memory.tiny_lm import needs_torchao, recipe

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
BF16 = "{weights: {policy: bf16}, allow_lossy: true}"
BF16_8BIT = "{weights: {policy: bf16}, optimizer_state: {policy: 8bit}, allow_lossy: true}"


def _replica(device: str, memory: str = BF16):
    """A bf16 parameter (quantized moments: 8192 elements) and its optimizer, the same on every call."""
    spec = recipe(memory, precision="bf16")
    generator = torch.Generator().manual_seed(7)
    param = torch.nn.Parameter(torch.randn(256, 32, generator=generator).to(device, torch.bfloat16))
    return param, torchao_adamw([param], spec.train, spec.memory, torch.device(device))


def _step(param, optimizer, step: int) -> None:
    param.grad = (torch.randn(256, 32, generator=torch.Generator().manual_seed(step)) * 1e-3).to(param)
    optimizer.step()


@needs_torchao
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory", [BF16, BF16_8BIT], ids=["bf16", "bf16-8bit"])
def test_replicas_round_the_same_whatever_their_own_generators_hold(device, memory):
    held = []
    for rank in (0, 1):
        param, optimizer = _replica(device, memory)
        torch.manual_seed(1000 + rank)  # each rank's dropout stream: seeded apart (runner/train/trainer.py)
        for step in range(3):
            before = torch.get_rng_state()
            _step(param, optimizer, step)
            assert torch.equal(torch.get_rng_state(), before)  # the dropout stream is put back as it was
        held.append(param.detach().clone())
    assert torch.equal(held[0], held[1])


@needs_torchao
def test_without_the_seed_the_replicas_drift():
    """What the seed is for: torchao draws from the default generator, which ranks seed apart."""
    import torchao.optim

    held = []
    for rank in (0, 1):
        param, _ = _replica("cpu")
        optimizer = torchao.optim._AdamW([param], lr=1e-3, bf16_stochastic_round=True)
        torch.manual_seed(1000 + rank)
        with torch.compiler.set_stance("force_eager"):
            for step in range(3):
                _step(param, optimizer, step)
        held.append(param.detach().clone())
    assert not torch.equal(held[0], held[1])


@needs_torchao
@pytest.mark.skipif(torch.cuda.is_available(), reason="the estimate's emulated CUDA: a machine without a GPU")
def test_a_cuda_target_without_a_gpu_seeds_the_host_generator_only():
    """`ckrun estimate --device cuda` builds the optimizer for a CUDA device on a machine with none: the
    seeding must not ask a driver for CUDA's generator (it said 'Found no NVIDIA driver')."""
    spec = recipe(BF16, precision="bf16")
    param = torch.nn.Parameter(torch.ones(256, 32, dtype=torch.bfloat16))
    optimizer = torchao_adamw([param], spec.train, spec.memory, torch.device("cuda"))
    with torch.compiler.set_stance("force_eager"):  # torchao's update, as the estimate runs it on the CPU
        _step(param, optimizer, 0)
    assert not torch.equal(param, torch.ones_like(param))


@needs_torchao
def test_a_resumed_optimizer_rounds_as_an_uninterrupted_one():
    param, optimizer = _replica("cpu", BF16_8BIT)
    for step in range(3):
        _step(param, optimizer, step)
    resumed, fresh = _replica("cpu", BF16_8BIT)
    for step in range(2):
        _step(resumed, fresh, step)
    saved = fresh.state_dict()
    resumed_param, second = _replica("cpu", BF16_8BIT)
    with torch.no_grad():
        resumed_param.copy_(resumed)
    second.load_state_dict(saved)
    _step(resumed_param, second, 2)
    assert torch.equal(resumed_param, param)


@needs_torchao
def test_quantized_moments_of_bf16_shards_update_and_survive_a_load(two_rank_mesh):  # tests/conftest.py
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    spec = recipe(BF16_8BIT, precision="bf16")
    whole = torch.randn(256, 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    param = torch.nn.Parameter(distribute_tensor(whole, two_rank_mesh, [Shard(0)]))  # a shard of 4096: quantized
    optimizer = torchao_adamw([param], spec.train, spec.memory, torch.device("cpu"))
    for step in range(2):
        param.grad = distribute_tensor(torch.full((256, 32), 1e-3 * (step + 1), dtype=torch.bfloat16),
                                       two_rank_mesh, [Shard(0)])
        optimizer.step()
        if step == 0:
            optimizer.load_state_dict(optimizer.state_dict())  # casts the moments to the parameter's dtype: put back
    moment = optimizer.state[param]["exp_avg"]
    assert isinstance(moment, DTensor) and type(moment.to_local()).__name__ == "OptimState8bit"
    assert moment.dtype == torch.float32 and moment.to_local().codes.dtype == torch.uint8
    assert not torch.equal(param.to_local(), whole[:128])  # the shard moved
