"""Settings the training process applies before CUDA starts: the caching allocator's configuration
(memory.allocator) and compile's activation memory budget (memory.activation_memory_budget).

PYTORCH_CUDA_ALLOC_CONF is read once, when CUDA initialises its allocator, so it must be in the
environment before the first CUDA call: the trainer applies it before it picks the device, and the
tuner also puts it in each probe child's environment. On the CPU there is no caching allocator and
the setting does nothing (logged). The budget is read by torch.compile's partitioner when it
compiles, so setting it before the first compiled step is enough.
"""

from __future__ import annotations

import logging
import os

import torch

from ..plan import MemoryPlan
from .torch_features import functorch_config

log = logging.getLogger(__name__)

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def apply_allocator(setting: str | None, device_kind: str) -> bool:
    """Put `setting` into PYTORCH_CUDA_ALLOC_CONF for a CUDA run; True when it was set in time."""
    if setting is None:
        return False
    if device_kind != "cuda":
        log.info("memory.allocator: %s has no effect on the %s (no CUDA caching allocator); ignored", setting,
                 device_kind)
        return False
    before = os.environ.get(ALLOC_ENV)
    os.environ[ALLOC_ENV] = setting  # child processes (compile workers) inherit it too
    if torch.cuda.is_initialized():
        log.warning("memory.allocator: CUDA was already initialised in this process, so %s=%s may not take effect "
                    "(set it in the environment before starting, or let `ckrun` start the run)", ALLOC_ENV, setting)
        return False
    replaced = f" (replacing the environment's {before!r})" if before not in (None, setting) else ""
    log.info("memory.allocator: %s=%s, set before CUDA starts%s", ALLOC_ENV, setting, replaced)
    if os.environ.get("PYTORCH_ALLOC_CONF"):
        log.warning("memory.allocator: PYTORCH_ALLOC_CONF=%s is set too; newer torch may read it instead",
                    os.environ["PYTORCH_ALLOC_CONF"])
    return True


def apply_compile_budget(plan: MemoryPlan) -> None:
    """Set compile's activation memory budget for this process, before the first compiled step."""
    if plan.activation_memory_budget is None or not plan.compile:
        return
    functorch_config().activation_memory_budget = plan.activation_memory_budget
    log.info("memory.activation_memory_budget: torch.compile's partitioner keeps at most %.2f of its default "
             "activation memory and recomputes the rest (the peak is measured, not assumed monotonic in it)",
             plan.activation_memory_budget)
