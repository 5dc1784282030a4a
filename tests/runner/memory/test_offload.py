"""Activation offload: refused on the CPU; its rule and schedule checked on the CPU through a
synchronous transport (host and device are then the same memory); the real thing - pinned buffers,
a side stream, a lower allocator reserve - on CUDA."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.blocks import find_blocks, wrap_forward
from ckrun.runner.memory.offload import (ActivationOffload, CopyTransport, HostPool, derived_from_parameter, device_like,
                                   host_view, size_class)
from ckrun.runner.plan.memory_plan import MemoryPlan

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


def test_not_with_compile():
    # dynamo would trace the hooks' streams and buffer pool: refused with the keys to change
    with pytest.raises(ValueError, match="^memory.offload: cannot be combined with memory.compile: true"):
        apply_plan(chain(), plan(offload={"policy": "all"}, compile=True), torch.device("cuda"))


# --- the rule and the schedule, on the CPU -----------------------------------------------------


def cpu_offload(min_bytes: int = 0) -> ActivationOffload:
    return ActivationOffload("cpu", min_bytes, CopyTransport("cpu", "cpu"))


def test_weights_stay_and_small_tensors_stay():
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64, requires_grad=True)  # 8 kB
    offload = cpu_offload(min_bytes=1)
    with offload.hooks(block):
        block(x).sum().backward()
    # addmm saved x and weight.t() (a view of the parameter: it stays); tanh saved its output
    assert (offload.offloaded_count, offload.offloaded_bytes) == (2, 2 * 32 * 64 * 4)

    offload = cpu_offload(min_bytes=32 * 64 * 4 + 1)
    with offload.hooks(block):
        block(x).sum().backward()
    assert offload.offloaded_count == 0


def test_autocast_weight_casts_stay():
    # autocast saves the bf16 copy of the weight for backward: it is made again every forward, so
    # moving it to the host would cost bandwidth and save nothing
    block = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    x = torch.randn(32, 64, requires_grad=True)
    offload = cpu_offload(min_bytes=1)
    with offload.hooks(block), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x).float().sum().backward()
    weight_bytes = 64 * 64 * 2
    assert offload.offloaded_count > 0 and weight_bytes not in _sizes_offloaded(block, x)


def _sizes_offloaded(block: nn.Module, x: torch.Tensor) -> list[int]:
    sizes = []
    offload = cpu_offload(min_bytes=1)
    original = offload.transport.to_host
    offload.transport.to_host = lambda tensor, owner: (sizes.append(tensor.nbytes), original(tensor, owner))[1]
    with offload.hooks(block), torch.autocast("cpu", dtype=torch.bfloat16):
        block(x).float().sum().backward()
    return sizes


def test_parameters_and_their_views_and_casts_count_as_weights():
    linear = nn.Linear(8, 8)
    activation = torch.randn(4, 8, requires_grad=True).tanh()
    assert derived_from_parameter(linear.weight) and derived_from_parameter(linear.weight.t())
    assert derived_from_parameter(linear.weight.to(torch.bfloat16).t())
    assert not derived_from_parameter(activation) and not derived_from_parameter(activation.to(torch.bfloat16))
    assert not derived_from_parameter(linear.weight * 2)  # computed from a weight: a real activation


def test_on_a_checkpointed_block_only_the_kept_input_moves():
    torch.manual_seed(0)
    model, x = chain(), torch.randn(16, 64, requires_grad=True)
    expected = grads_of(model, x)
    apply_plan(model, plan(checkpointing={"policy": "full"}), "cpu")
    offload = cpu_offload()
    offload_all(model, offload)  # outside the checkpoint, as apply_plan does on CUDA
    assert all(torch.equal(a, b) for a, b in zip(expected, grads_of(model, x), strict=True))
    assert offload.offloaded_count == 4  # each block's input, nothing from inside


def test_at_most_two_blocks_are_in_flight_in_forward():
    model = chain(blocks=6)
    offload = cpu_offload()
    offload_all(model, offload)
    in_flight = []
    for block in model:  # each block's forward starts by releasing the copies of the block two back
        block.register_forward_hook(lambda *_: in_flight.append(_stashed_groups(offload)))
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert in_flight == [1, 2, 2, 2, 2, 2]
    assert offload._last is None  # backward took over every stash


def test_an_offloaded_tensor_goes_when_its_own_node_is_done_not_with_its_blocks_last():
    """A block's backward lets each offloaded tensor (its host copy, and the device copy fetched back) go as the
    node that saved it is done. The pack hook's note of what it had copied (a tensor saved twice is copied once)
    held every copy of the block until the block's last saved tensor went: on the Llama 8B's offloaded plans up to
    4 GB more at the peak, and since when that went followed the order autograd let go of its hooks, a peak that
    differed between runs of the same plan. The note is cleared as the block's forward returns."""
    seen_at_the_linear, entries = [], []
    model = nn.Sequential(_Probed(seen_at_the_linear, entries), _Probed(seen_at_the_linear, entries))
    offload = cpu_offload()
    offload_all(model, offload)
    pack = offload._pack
    offload._pack = lambda *args: _kept(entries, pack(*args))
    model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    # block 1's backward, as its linear's begins: its input's copy is still to be used, tanh's output went
    assert seen_at_the_linear[0] == [True, False]
    assert all(ref() is None for ref in entries)


def test_a_tensor_saved_again_after_its_first_saver_is_gone_is_still_copied_once():
    """Within one forward the note of what was copied holds the copies: a node that saved a tensor and was dropped
    (here sin's, whose output is thrown away; the 8B's selective blocks do the like) leaves the next save of that
    tensor the same copy. Held weakly, each such tensor was copied twice (the 8B: 32 GB more to the host a step)."""
    class SavesTwice(nn.Module):
        def forward(self, x):
            x.sin()  # its node saves x, and goes with its unused output
            return x.cos()

    model = nn.Sequential(SavesTwice(), SavesTwice())
    offload = cpu_offload()
    offload_all(model, offload)
    x = torch.randn(8, 64, requires_grad=True)
    model(x).sum().backward()
    assert offload.offloaded_count == 2  # each block's input once
    assert torch.allclose(x.grad, torch.sin(torch.cos(x)) * torch.sin(x))  # the copy serves both blocks' backward


class _Probed(nn.Module):
    """Linear then tanh (which saves its output); at the linear's backward, which of the last two tensors this
    block offloaded (its input, tanh's output) are still alive."""

    def __init__(self, seen: list, entries: list):
        super().__init__()
        self.linear, self.seen, self.entries = nn.Linear(64, 64), seen, entries

    def forward(self, x):
        hidden = self.linear(x)
        hidden.register_hook(lambda _: self.seen.append([ref() is not None for ref in self.entries[-2:]]))
        return torch.tanh(hidden)


def _kept(entries: list, entry):
    if not isinstance(entry, torch.Tensor):
        entries.append(weakref.ref(entry))
    return entry


def _stashed_groups(offload: ActivationOffload) -> int:
    count, group = 0, offload._last
    while group is not None:
        count += bool(group.stash)
        group = group.previous
    return count


@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(2, 5), offloaded=st.sets(st.integers(0, 4)), checkpointed=st.sets(st.integers(0, 4)),
       min_bytes=st.sampled_from([0, 1, 4096, 1 << 20]), micro_batches=st.integers(1, 3), seed=st.integers(0, 99))
def test_any_offload_and_checkpointing_mix_keeps_gradients_bit_identical(blocks, offloaded, checkpointed, min_bytes,
                                                                         micro_batches, seed):
    torch.manual_seed(seed)
    model, x = chain(blocks=blocks, width=32), torch.randn(6 * micro_batches, 32)

    def grads():
        torch.manual_seed(seed)
        for part in x.chunk(micro_batches):
            model(part).square().mean().backward()
        found = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return found

    expected = grads()
    layers = sorted(i for i in checkpointed if i < blocks)
    applied = apply_plan(model, plan(checkpointing={"policy": "layers", "layers": layers} if layers else {"policy": "none"}), "cpu")
    offload = cpu_offload(min_bytes)
    for i in sorted(i for i in offloaded if i < blocks):
        wrap_forward(model[i], offload.wrapper, model[i])
    for _ in range(2):  # twice: the second step reuses what the first left behind
        assert all(torch.equal(a, b) for a, b in zip(expected, grads(), strict=True))
        assert _stashed_groups(offload) == 0  # no device tensor outlives its backward
    applied.remove()


# --- a forward that never reaches backward ----------------------------------------------------


class _FailsOnce(nn.Module):
    """A block that runs out of memory in its `fail_on`-th forward."""

    def __init__(self, inner: nn.Module, fail_on: int = 1):
        super().__init__()
        self.inner, self.calls, self.fail_on = inner, 0, fail_on

    def forward(self, x):
        out = self.inner(x)
        self.calls += 1
        if self.calls == self.fail_on:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return out


def _in_flight_per_block(model: nn.Module, offload: ActivationOffload, x: torch.Tensor) -> list[int]:
    in_flight = []
    hooks = [block.register_forward_hook(lambda *_: in_flight.append(_stashed_groups(offload))) for block in model]
    model(x).sum().backward()
    for hook in hooks:
        hook.remove()
    return in_flight


def test_an_out_of_memory_inside_an_offloaded_block_leaves_no_state():
    model = chain(blocks=4)
    model[2] = _FailsOnce(model[2])
    offload = cpu_offload()
    for block in model:
        wrap_forward(block, offload.wrapper, block)
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.randn(8, 64, requires_grad=True))
    assert offload._last is None  # the stashes of blocks 0-1 are let go, not kept for a backward
    # the next step starts its own chain: after block k the copies of at most two blocks are in flight
    assert _in_flight_per_block(model, offload, torch.randn(8, 64, requires_grad=True)) == [1, 2, 2, 2]


def test_a_forward_that_failed_after_the_blocks_is_forgotten_by_the_next():
    model = chain(blocks=4)
    offload = cpu_offload()
    offload_all(model, offload)
    out = model(torch.randn(8, 64, requires_grad=True))
    del out  # the loss ran out of memory: the step's graph is dropped without a backward
    assert _in_flight_per_block(model, offload, torch.randn(8, 64, requires_grad=True)) == [1, 2, 2, 2]
    assert offload._last is None


# --- pinned buffers: size classes, a bound, strides kept --------------------------------------


def test_pool_reuses_buffers_across_shapes_and_keeps_at_most_twice_a_steps_need():
    """Text of varying length: every step offloads tensors of a new length. Keyed by exact size the
    pool kept every step's buffers; by size class with a bound it holds at most twice one step's."""
    pool, lengths = HostPool(allocate=lambda n: torch.empty(n, dtype=torch.uint8)), torch.Generator().manual_seed(0)
    for _ in range(200):
        length = int(torch.randint(16, 512, (1,), generator=lengths))
        buffers = [pool.take(length * 4096) for _ in range(6)]  # six saved activations of [length, 1024] fp32
        assert all(b.numel() >= length * 4096 for b in buffers)
        for buffer in buffers:
            pool.give(buffer)
        assert pool.allocated_bytes <= 2 * pool.most_in_use_bytes and pool.in_use_bytes == 0
    assert pool.allocated_bytes == sum(b.numel() for free in pool.free.values() for b in free)
    reused = pool.take(300 * 4096)
    pool.give(reused)
    assert pool.take(300 * 4096 + 100) is reused  # the same size class


@pytest.mark.parametrize("layout", ["channels_last", "strided view", "contiguous"])
def test_host_copies_keep_the_saved_tensors_strides(layout):
    tensor = torch.randn(2, 8, 5, 6)
    tensor = {"channels_last": tensor.to(memory_format=torch.channels_last), "strided view": tensor[:, ::2],
              "contiguous": tensor}[layout]
    host = host_view(torch.empty(size_class(tensor.nbytes), dtype=torch.uint8), tensor)
    host.copy_(tensor)
    back = device_like(host, torch.device("cpu")).copy_(host)
    assert torch.equal(back, tensor)
    if layout != "strided view":  # dense: its own strides; a view with gaps comes back dense, in its order
        assert host.stride() == back.stride() == tensor.stride()
    else:
        assert back.is_contiguous()


# --- CUDA ------------------------------------------------------------------------------------


def _cuda_grads(offload: bool, checkpointing: str = "none"):
    torch.manual_seed(0)
    model = chain(blocks=4, width=256).cuda()
    x = torch.randn(512, 256, device="cuda")
    memory = {"checkpointing": {"policy": checkpointing}}
    if offload:
        memory["offload"] = {"policy": "all", "min_bytes": 1024}
    applied = apply_plan(model, plan(**memory), torch.device("cuda"))
    grads = [grads_of(model, x, seed=step) for step in range(2)]
    return grads, applied


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_cuda_gradients_match_without_offload(checkpointing):
    offloaded, applied = _cuda_grads(True, checkpointing)
    plain, _ = _cuda_grads(False, checkpointing)
    assert applied.offload.offloaded_count > 0
    for step in range(2):
        # offloaded copies are contiguous, so a kernel may take another path: equal to fp32 rounding
        for a, b in zip(offloaded[step], plain[step], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.cuda
@needs_cuda
def test_cuda_offloaded_tensors_wait_in_pinned_host_memory():
    _, applied = _cuda_grads(True)
    pool = applied.offload.transport.pool
    buffers = [buffer for free in pool.free.values() for buffer in free]
    assert buffers and all(buffer.device.type == "cpu" and buffer.is_pinned() for buffer in buffers)
    assert pool.allocated_bytes == sum(buffer.numel() for buffer in buffers)  # all back in the pool after backward


@pytest.mark.cuda
@needs_cuda
def test_cuda_a_channels_last_activation_comes_back_channels_last():
    from ckrun.runner.memory.offload import CudaTransport

    transport = CudaTransport(torch.device("cuda", 0))
    tensor = torch.randn(8, 32, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    owner = type("Owner", (), {})()
    host, copied = transport.to_host(tensor, owner)
    transport.wait(copied)
    back, fetched = transport.to_device(host)
    transport.wait(fetched)
    assert back.stride() == tensor.stride() and torch.equal(back, tensor)


@pytest.mark.cuda
@needs_cuda
def test_cuda_an_out_of_memory_in_forward_gives_the_stashed_memory_back():
    torch.manual_seed(0)
    model = chain(blocks=6, width=1024).cuda()
    model[4][0] = _FailsOnce(model[4][0], fail_on=2)  # inside block 4, which stays a block of its kind
    applied = apply_plan(model, plan(offload={"policy": "all", "min_bytes": 1 << 20}), torch.device("cuda"))
    x = torch.randn(4096, 1024, device="cuda")
    model(x).square().mean().backward()  # a whole step first: cuBLAS workspaces and gradients exist before
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError):
        model(x)
    gc.collect()  # the traceback's frames, with the activations they hold
    torch.cuda.synchronize()
    assert applied.offload._last is None and torch.cuda.memory_allocated() == before
    applied.remove()


@pytest.mark.cuda
@needs_cuda
def test_cuda_reserved_memory_falls():
    def peaks(offload: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        model = chain(blocks=8, width=1024).cuda()
        x = torch.randn(4096, 1024, device="cuda")  # 16 MiB per activation
        memory = {"offload": {"policy": "all", "min_bytes": 1 << 20}} if offload else {}
        applied = apply_plan(model, plan(**memory), torch.device("cuda"))
        grads_of(model, x)  # warm-up: allocates the pinned pool and the gradients
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        grads_of(model, x)
        torch.cuda.synchronize()
        applied.remove()
        return torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()

    (reserved, allocated), (reserved_offload, allocated_offload) = peaks(False), peaks(True)
    # 8 blocks keep a Linear input, a tanh output and a dropout mask each (about 36 MiB a block);
    # at most two blocks are in flight, so at least 5 blocks' worth must leave the reserve
    assert reserved_offload < reserved - 5 * 36 * 2**20
    assert allocated_offload < allocated - 5 * 36 * 2**20
