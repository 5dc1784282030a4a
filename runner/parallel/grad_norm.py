"""Gradient clipping over parameters that live on different device meshes (tensor parallelism).

torch's `clip_grad_norm_` stacks every gradient's norm into one tensor: it refuses a mix of plain
tensors and DTensors (`got mixed torch.Tensor and DTensor`, tp with one data-parallel group) and of
DTensors on different meshes (`All operands in aten.stack must have the same mesh`, tp beside FSDP2:
split layers on dp x tp, the rest on dp alone; pytorch/pytorch#180346). So the norm is taken per
mesh: within one, torch's own `get_total_norm`, whose result for DTensors is a partial norm that
`full_tensor()` reduces over the ranks that hold different pieces (a sharded gradient's norm is the
norm of its pieces' norms; a replicated one is the same on every rank and is not summed twice).
A plain tensor is whole on every rank that holds it. The total is the norm of the per-mesh norms,
the same on every rank; each gradient is then scaled on its own mesh, by a plain scalar.
"""

from __future__ import annotations

import torch


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients so their total 2-norm is at most `max_norm`; returns the norm before clipping."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    groups = _by_mesh(grads)
    if len(groups) <= 1:  # one mesh or none: torch's own, as every strategy but tp always had
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    norms = [_norm(group) for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups.values():
        torch._foreach_mul_([_local(grad) for grad in group], coefficient)
    return total


def _by_mesh(grads: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(getattr(grad, "device_mesh", None), []).append(grad)  # None: a plain tensor
    return groups


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The rank's own piece (a view: scaling it scales the DTensor), or the plain tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad
