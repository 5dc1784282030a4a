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

from runner.predict.cuda_model import CudaOnCpu
from runner.predict.roofline import OpClock


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
