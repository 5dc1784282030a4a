"""What one op does, counted: causal attention's share of the score matrix, CPU's flash kernel, and a
distributed tensor counted by its shard. Counting only: shapes in, FLOPs and bytes out."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from ckrun.runner.predict.cuda_model import CudaOnCpu
from ckrun.runner.predict.op_work import measure
from ckrun.runner.predict.roofline import OpClock


def _attention_flops(device: str, rows: int, columns: int, causal: bool, heads: int = 2, dim: int = 16) -> float:
    """FLOPs of attention classed as such, forward and backward, as a CUDA (flash) or CPU step runs it."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with FakeTensorMode():
        q = torch.empty(2, heads, rows, dim, dtype=dtype, requires_grad=True)
        k, v = (torch.empty(2, heads, columns, dim, dtype=dtype, requires_grad=True) for _ in range(2))
        with OpClock() as clock, (CudaOnCpu() if device == "cuda" else contextlib.nullcontext()):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
    ops = [op for op in clock.work.ops if op.op_class == "attention"]
    assert len(ops) == 2, [op.op_class for op in clock.work.ops]  # the kernel and its backward
    return sum(op.flops for op in ops)


@settings(max_examples=12, deadline=None)
@given(device=st.sampled_from(["cuda", "cpu"]), rows=st.integers(1, 96), extra=st.integers(0, 32))
def test_causal_attention_counts_the_share_of_the_scores_it_computes(device, rows, extra):
    """torch's FLOP formulas ignore is_causal; the kernels skip what the mask hides: row i of the queries
    sees i + 1 keys (top-left alignment), so a square causal call computes s(s+1)/2 of s^2 scores."""
    columns = rows + extra
    full = _attention_flops(device, rows, columns, causal=False)
    causal = _attention_flops(device, rows, columns, causal=True)
    assert full > 0
    assert causal == pytest.approx(full * (rows * (rows + 1) / 2) / (rows * columns))


def test_a_distributed_tensor_is_counted_by_its_shard():
    """Tensor parallelism's layers and FSDP's sharded parameters reach the clock as DTensors with the
    global shape: a rank computes and moves only its shard (1/4 of the columns here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        weight = distribute_tensor(torch.zeros(64, 256), mesh, [Shard(1)])
        x = distribute_tensor(torch.zeros(8, 64), mesh, [Replicate()])
        with OpClock() as clock:
            x @ weight
            weight.add_(1.0)
    finally:
        dist.destroy_process_group()
    product, update = clock.work.ops
    assert product.flops == 2 * 8 * 64 * 256 / 4 and product.outputs == (1, 8, 64)
    assert update.nbytes == 2 * 4 * 64 * 256 / 4  # read and written: the shard


def test_batch_norm_in_training_reads_its_input_twice():
    """Its statistics span the batch: one pass to reduce, one to normalise (forward), the gradient and the
    input twice in backward. In evaluation the running statistics need no reducing pass."""
    aten = torch.ops.aten
    with FakeTensorMode():
        x, grad = torch.empty(8, 16, 32, 32), torch.empty(8, 16, 32, 32)
        weight, mean, var = torch.ones(16), torch.zeros(16), torch.ones(16)
        cases, outs = {}, {}
        for training in (True, False):
            args = (x, weight, None, mean, var, training, 0.1, 1e-5)
            outs[training] = aten.native_batch_norm.default(*args)
            cases[training] = measure(aten.native_batch_norm.default, args, {}, outs[training])[2]
        saved = outs[True][1], outs[True][2]
        args = (grad, x, weight, mean, var, *saved, True, 1e-5, [True, True, True])
        backward = measure(aten.native_batch_norm_backward.default, args, {},
                           aten.native_batch_norm_backward.default(*args))[2]
    activation = 4 * x.numel()
    assert activation <= cases[True] - cases[False] < activation + 1024  # the input once more (and the statistics)
    assert cases[False] < 2.1 * activation
    assert 5 * activation <= backward < 5.1 * activation  # gradient and input twice, the input's gradient written


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_channels_first_convolution_pays_cudnns_transposes_on_tensor_cores(channels_last):
    """cuDNN's tensor-core convolutions run channels-last: a channels-first (NCHW) call reads and writes
    each of its tensors once more to transpose them, a channels-last one does not; in plain fp32 (no
    tensor cores) nothing is transposed."""
    from ckrun.runner.predict.hardware import DeviceFacts
    from ckrun.runner.predict.roofline import price

    facts = DeviceFacts(name="gpu", matmul_tflops={"fp32": 1e6, "tf32": 1e6, "bf16": 1e6, "fp16": 1e6},
                        memory_gbs=1.0, capability=(8, 0), memory_efficiency=1.0, launch_us=0.0)
    with FakeTensorMode():
        x, weight = torch.empty(8, 16, 32, 32), torch.empty(32, 16, 3, 3)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with OpClock(tf32=False) as plain:
            out = F.conv2d(x, weight, padding=1)
        with OpClock(tf32=True) as tensor_cores:
            F.conv2d(x, weight, padding=1)
    moved = 2 * 4 * (x.numel() + weight.numel() + out.numel())
    assert plain.work.ops[0].layout_bytes == (0 if channels_last else moved)
    seconds = [price(clock.work, facts).seconds[("first", "forward")] for clock in (plain, tensor_cores)]
    assert seconds[0] == pytest.approx(plain.work.ops[0].nbytes / 1e9)
    assert seconds[1] == pytest.approx(seconds[0] + (0 if channels_last else moved / 1e9))
