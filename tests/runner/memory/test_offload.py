"""Activation offload: refused on the CPU, its hooks checked on the CPU (host and device are then
the same memory), and the real thing - pinned buffers, side stream, lower peak - on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.memory.apply import apply_plan
from runner.memory.blocks import find_blocks, wrap_forward
from runner.memory.offload import ActivationOffload
from runner.plan import MemoryPlan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def plan(**memory) -> MemoryPlan:
    return MemoryPlan.model_validate(memory)


def chain(blocks: int = 4, width: int = 64) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)) for _ in range(blocks)])


def offload_all(model: nn.Module, offload: ActivationOffload) -> None:
    for block in find_blocks(model):
        wrap_forward(block.module, offload.wrapper, block.module)


def grads_of(model: nn.Module, x: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# --- bad input -------------------------------------------------------------------------------


def test_refused_on_the_cpu():
    with pytest.raises(ValueError) as error:
        apply_plan(chain(), plan(offload={"policy": "all"}), torch.device("cpu"))
    assert str(error.value) == (
        "memory.offload: activation offload moves activations from GPU to host memory; this run is on the CPU, "
        "so there is nothing to save - set memory.offload.policy: none")


def test_layer_out_of_range():
    # the indices are checked before anything touches the GPU, so this runs anywhere
    with pytest.raises(ValueError, match=r"^memory.offload.layers: block 7 is out of range; the model has 4 blocks"):
        apply_plan(chain(), plan(offload={"policy": "layers", "layers": [0, 7]}), torch.device("cuda"))


def test_not_with_sqrt_segments():
    with pytest.raises(ValueError, match="^memory.offload: cannot be combined with memory.checkpointing.policy: sqrt"):
        apply_plan(chain(), plan(offload={"policy": "all"}, checkpointing={"policy": "sqrt"}), torch.device("cuda"))


# --- the hooks, on the CPU -------------------------------------------------------------------


def test_weights_stay_and_small_tensors_stay():
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64, requires_grad=True)  # 8 kB
    offload = ActivationOffload("cpu", min_bytes=1)
    with offload.hooks(block):
        block(x).sum().backward()
    # addmm saved x and weight.t() (a view of the parameter); tanh saved its output
    assert (offload.offloaded_count, offload.offloaded_bytes) == (2, 2 * 32 * 64 * 4)

    offload = ActivationOffload("cpu", min_bytes=32 * 64 * 4 + 1)
    with offload.hooks(block):
        block(x).sum().backward()
    assert offload.offloaded_count == 0


def test_gradients_unchanged_and_buffers_reused():
    torch.manual_seed(0)
    model, x = chain(), torch.randn(16, 64)
    expected = grads_of(model, x)
    offload = ActivationOffload("cpu", min_bytes=0)
    offload_all(model, offload)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads_of(model, x)))
    allocated = offload.pool.allocated_bytes
    assert all(torch.equal(a, b) for a, b in zip(expected, grads_of(model, x)))
    assert offload.pool.allocated_bytes == allocated > 0  # the second step took every buffer from the pool


def test_on_a_checkpointed_block_only_the_kept_input_moves():
    torch.manual_seed(0)
    model, x = chain(), torch.randn(16, 64, requires_grad=True)
    expected = grads_of(model, x)
    apply_plan(model, plan(checkpointing={"policy": "full"}), "cpu")
    offload = ActivationOffload("cpu", min_bytes=0)
    offload_all(model, offload)  # outside the checkpoint, as apply_plan does on CUDA
    assert all(torch.equal(a, b) for a, b in zip(expected, grads_of(model, x)))
    assert offload.offloaded_count == 4  # each block's input, nothing from inside


# --- CUDA ------------------------------------------------------------------------------------


def _cuda_grads(use_side_stream: bool | None, checkpointing: str = "none"):
    torch.manual_seed(0)
    model = chain(blocks=4, width=256).cuda()
    x = torch.randn(512, 256, device="cuda")
    memory = {"checkpointing": {"policy": checkpointing}}
    if use_side_stream is not None:
        memory["offload"] = {"policy": "all", "min_bytes": 1024}
    applied = apply_plan(model, plan(**memory), torch.device("cuda"), use_side_stream=bool(use_side_stream))
    grads = [grads_of(model, x, seed=step) for step in range(2)]
    return grads, applied


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_cuda_gradients_bit_identical_with_and_without_side_stream(checkpointing):
    side, applied = _cuda_grads(True, checkpointing)
    same_stream, _ = _cuda_grads(False, checkpointing)
    plain, _ = _cuda_grads(None, checkpointing)
    assert applied.offload.offloaded_count > 0
    for step in range(2):
        assert all(torch.equal(a, b) for a, b in zip(side[step], same_stream[step]))
        # offloaded copies are contiguous, so a kernel may take another path: equal to fp32 rounding
        for a, b in zip(side[step], plain[step]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@needs_cuda
def test_cuda_offloaded_tensors_wait_in_pinned_host_memory():
    _, applied = _cuda_grads(True)
    pool = applied.offload.pool
    buffers = [buffer for free in pool.free.values() for buffer, _ in free]
    assert buffers and all(buffer.device.type == "cpu" and buffer.is_pinned() for buffer in buffers)
    assert pool.allocated_bytes == sum(buffer.numel() for buffer in buffers)  # all back in the pool after backward


@pytest.mark.cuda
@needs_cuda
def test_cuda_peak_memory_falls():
    def peak(offload: bool) -> int:
        torch.manual_seed(0)
        model = chain(blocks=8, width=1024).cuda()
        x = torch.randn(4096, 1024, device="cuda")  # 16 MB per activation
        memory = {"offload": {"policy": "all", "min_bytes": 1 << 20}} if offload else {}
        applied = apply_plan(model, plan(**memory), torch.device("cuda"))
        grads_of(model, x)  # warm-up: allocates the pinned pool and the gradients
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads_of(model, x)
        torch.cuda.synchronize()
        applied.remove()
        return torch.cuda.max_memory_allocated()

    without, with_offload = peak(False), peak(True)
    # 8 blocks keep a Linear input, a tanh output and a dropout mask each (about 40 MB a block)
    assert with_offload < without - 4 * 16 * 2**20
