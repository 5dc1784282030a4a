"""Clipping over gradients on several device meshes, which torch's clip_grad_norm_ refuses to stack: the
total norm is the norm of all of them and every gradient is scaled by the same factor, whatever mesh it
lives on. A gloo group of one rank in this process: a mesh of one rank holds whole tensors, so the
values are checkable (torch 2.11's fake process group leaves what its collectives write unwritten,
distribute_tensor's scatter included). The reduction over real ranks is what the tp runs of
test_mesh_ranks.py clip with."""

from __future__ import annotations

import pytest
import torch

from ckrun.runner.parallel.grad_norm import clip_gradients


@pytest.fixture
def meshes():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        yield mesh, mesh["dp"]
    finally:
        dist.destroy_process_group()


def _parameter(grad: torch.Tensor) -> torch.nn.Parameter:
    parameter = torch.nn.Parameter(torch.zeros_like(grad))
    parameter.grad = grad
    return parameter


def test_gradients_on_two_meshes_and_plain_ones_clip_by_one_total_norm(meshes):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    both, data = meshes
    whole = [torch.full((4, 2), 3.0), torch.full((2,), 4.0), torch.full((3,), -2.0)]
    # on a mesh of one rank a DTensor may hold the very tensor it was made from: each gets a copy
    grads = [distribute_tensor(whole[0].clone(), both, [Shard(0), Shard(0)]),
             distribute_tensor(whole[1].clone(), data, [Shard(0)]), whole[2].clone()]
    with pytest.raises(RuntimeError):  # what this module is for
        torch.nn.utils.clip_grad_norm_([_parameter(g) for g in grads], 1.0)
    parameters = [_parameter(g) for g in [grads[0], distribute_tensor(whole[1].clone(), data, [Replicate()]),
                                          whole[2].clone()]]
    want = torch.linalg.vector_norm(torch.cat([w.flatten() for w in whole]))
    total = clip_gradients(parameters, 1.0)
    assert torch.allclose(total, want)
    scaled = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in parameters]
    for got, before in zip(scaled, whole, strict=True):
        assert torch.allclose(got, before / (want + 1e-6))


def test_gradients_on_one_mesh_clip_as_torch_clips_them():
    grads = [torch.randn(5, 3), torch.randn(7)]
    mine, theirs = [_parameter(g.clone()) for g in grads], [_parameter(g.clone()) for g in grads]
    assert torch.equal(clip_gradients(iter(mine), 0.5), torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=True))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(mine, theirs, strict=True))
