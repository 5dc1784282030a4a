"""What NVML says about a card, read without creating a CUDA context.

torch.cuda itself reads NVML through `pynvml` (nvidia-ml-py) for `device_memory_used`; ckrun uses
the same binding, and torch's own mapping from a CUDA index to NVML's (`_get_nvml_device_index`,
which honours CUDA_VISIBLE_DEVICES, UUIDs included). Neither creates a context, so the card can be
read before this process puts anything on it. Every function answers None where NVML is missing or
refuses (no driver, a container that hides it): callers fall back, and say so.

Some drivers and containers give the card's totals but no per-process list, or list processes
under host pids that are not this process's: `processes` is then None or does not name us.
"""

from __future__ import annotations

import os

import torch


def _handle(index: int):
    try:
        import pynvml

        pynvml.nvmlInit()
        to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)  # private: feature-detected
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(to_nvml(index) if to_nvml else index)
    except Exception:  # no pynvml, no driver, an index NVML does not know: the caller falls back
        return None, None


def card_used_bytes(index: int) -> int | None:
    """The card's used memory, every process's and the driver's own."""
    info = _memory_info(index)
    return None if info is None else int(info.used)


def card_free_bytes(index: int) -> int | None:
    """The card's free memory: its total less what every process and the driver use."""
    info = _memory_info(index)
    return None if info is None else int(info.free)


def _memory_info(index: int):
    nvml, handle = _handle(index)
    if handle is None:
        return None
    try:
        return nvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception:
        return None


def processes(index: int) -> dict[int, int | None] | None:
    """{pid: bytes or None (NVML would not say)} of the compute processes on the card, or None when
    NVML lists none at all (a hidden list is not the same as an idle card)."""
    nvml, handle = _handle(index)
    if handle is None:
        return None
    try:
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    found: dict[int, int | None] = {}
    for process in listed:
        used = process.usedGpuMemory
        found[int(process.pid)] = (found.get(int(process.pid)) or 0) + used if isinstance(used, int) else None
    return found or None


def own_bytes(index: int) -> int | None:
    """This process's bytes on the card as NVML lists them, or None when the list does not name us."""
    listed = processes(index)
    return None if listed is None else listed.get(os.getpid())


def others(index: int) -> int | None:
    """How many other processes NVML lists on the card (None: it lists none, or not us either)."""
    listed = processes(index)
    if listed is None or os.getpid() not in listed:
        return None
    return len(listed) - 1

