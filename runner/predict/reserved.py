"""What a CUDA card reserves for one estimated step: the step's allocations, as the tracker recorded
them on fake tensors, replayed through the caching allocator model (cuda_model.py) within what the
card or the plan's cap leaves beside the CUDA context, with cuBLAS's kept workspaces (cuda_extras.py);
and the notes that say what the number holds and leaves out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..plan.memory_plan import MemoryPlan
from ..units import format_bytes
from .cuda_extras import (BLAS_HANDLES_PER_STEP, CUDA_CONTEXT_BYTES, allocator_settings, cublas_workspace_bytes,
                          target_capability)
from .cuda_model import replay_within
from .device_facts import DeviceFacts

CPU = torch.device("cpu")  # where the estimate's fake tensors live, and so its recorded events


@dataclass(frozen=True)
class CudaReserve:
    reserved_bytes: int
    """The allocator model's peak reserve: what a cap on the card limits (the CUDA context apart)."""
    workspace_bytes: int
    """cuBLAS's workspaces, one per handle a step uses, kept by the allocator (part of reserved_bytes)."""
    notes: list[str]


def cuda_reserve(events: list, baseline: int, live: int, plan: MemoryPlan, facts: DeviceFacts | None) -> CudaReserve:
    """The reserve for the step whose allocations after event `baseline` are `events` and whose live
    tensors peaked at `live`, on the card `facts` names (else this machine's GPU, else a Hopper)."""
    capability, measured = target_capability()
    if facts is not None and facts.capability and not measured:
        capability, measured = facts.capability, True
    workspace = cublas_workspace_bytes(capability)
    expandable, ignored = allocator_settings(plan.allocator)
    allocator, limited = replay_within(events, CPU, baseline, allocator_capacity(plan, facts),
                                       kept=(workspace,) * BLAS_HANDLES_PER_STEP, expandable=expandable)
    reserved = allocator.peak_reserved
    gpu = f"sm{capability[0]}{capability[1]}" + ("" if measured else " (assumed: no GPU here)")
    if facts is not None and facts.capability == capability:
        gpu = f"sm{capability[0]}{capability[1]}, {facts.name}"
    notes = [f"CUDA caching allocator model{' with expandable segments' if expandable else ''}: "
             f"{format_bytes(reserved)} reserved for {format_bytes(live)} of live tensors and "
             f"{BLAS_HANDLES_PER_STEP} cuBLAS workspaces of {format_bytes(workspace)} ({gpu}); the CUDA "
             f"context (~0.8 GB on an H100 once a step's kernels are loaded) is not included"]
    if limited:
        notes.append(f"the step {limited}")
    if ignored:
        notes.append(f"PYTORCH_CUDA_ALLOC_CONF settings not modelled: {', '.join(ignored)}")
    return CudaReserve(reserved, workspace * BLAS_HANDLES_PER_STEP, notes)


def allocator_capacity(plan: MemoryPlan, facts: DeviceFacts | None) -> int | None:
    """What the allocator may hold: the named card's memory or the plan's cap, whichever is less, less
    the CUDA context (as runner/train/run/memory_cap.py limits it); None when neither is known."""
    limits = [int(plan.max_mem)] if plan.max_mem is not None else []
    if facts is not None and facts.memory_bytes:
        limits.append(facts.memory_bytes)
    return min(limits) - CUDA_CONTEXT_BYTES if limits else None
