"""Settings the training process applies before CUDA starts: the caching allocator's configuration
(memory.allocator) and compile's activation memory budget (memory.activation_memory_budget).

The allocator reads its settings once, when CUDA initialises it, so they must be in the environment
before the first CUDA call: the trainer applies them before it picks the device, and the tuner also
puts them in each probe child's environment. Two variables carry them: PYTORCH_CUDA_ALLOC_CONF (the
only one before torch 2.9) and PYTORCH_ALLOC_CONF (2.9's device-generic name). Which one wins when
both are set has changed between releases and differs between torch's two config readers (the
accelerator-wide one and CUDA's own), so a plan's setting goes into both: whatever this torch reads,
it reads the plan's. Where torch can say which settings it parsed (`_accelerator_getAllocatorSettings`: 2.15 has it,
2.11 not; feature-detected), they are read back and logged, and a mismatch is one warning line.
On the CPU there is no caching allocator and the setting does nothing (logged). The budget is read by
torch.compile's partitioner when it compiles, so setting it before the first compiled step is enough.
"""

from __future__ import annotations

import logging
import os

import torch

from ..plan.memory_plan import MemoryPlan
from .torch_features import functorch_config

log = logging.getLogger(__name__)

ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # both, since torch's precedence between them moved
_READ_BACK = getattr(torch._C, "_accelerator_getAllocatorSettings", None)


def allocator_env(setting: str) -> dict[str, str]:
    """The environment entries that make any torch's CUDA allocator start with `setting`."""
    return dict.fromkeys(ALLOC_ENVS, setting)


def settings_in_effect() -> str | None:
    """The allocator settings this torch parsed (from the environment on first use, or set since);
    None when this torch cannot say."""
    return _READ_BACK() if _READ_BACK is not None else None


def apply_allocator(setting: str | None, device_kind: str) -> bool:
    """Put `setting` where this torch reads allocator settings, for a CUDA run; True when it took effect
    (as far as torch can tell)."""
    if setting is None:
        return False
    if device_kind != "cuda":
        log.info("memory.allocator: %s has no effect on the %s (no CUDA caching allocator); ignored", setting,
                 device_kind)
        return False
    replaced = {name: os.environ[name] for name in ALLOC_ENVS if os.environ.get(name) not in (None, setting)}
    os.environ.update(allocator_env(setting))  # child processes (compile workers) inherit it too
    if torch.cuda.is_initialized():
        log.warning("memory.allocator: CUDA was already initialised in this process, so %s=%s may not take effect "
                    "(set it in the environment before starting, or let `ckrun` start the run)", ALLOC_ENV, setting)
        return False
    note = "".join(f" (replacing the environment's {name}={value!r})" for name, value in replaced.items())
    return _read_back(setting, note)


def _read_back(setting: str, note: str) -> bool:
    found = settings_in_effect()
    where = " and ".join(ALLOC_ENVS)
    if found is None:
        log.info("memory.allocator: %s=%s, set before CUDA starts%s (torch %s cannot report the settings in "
                 "effect)", where, setting, note, torch.__version__)
        return True
    if _normal(found) != _normal(setting):
        log.warning("memory.allocator: torch reports allocator settings %r in effect, not %r (something in this "
                    "process made torch read its settings before ckrun set them)", found, setting)
        return False
    log.info("memory.allocator: %s=%s, set before CUDA starts%s; torch reports it in effect", where, setting, note)
    return True


def _normal(settings: str) -> str:
    return ",".join(part.strip() for part in settings.split(",") if part.strip())


def apply_compile_budget(plan: MemoryPlan) -> None:
    """Set compile's activation memory budget for this process, before the first compiled step."""
    if plan.activation_memory_budget is None or not plan.compile:
        return
    functorch_config().activation_memory_budget = plan.activation_memory_budget
    log.info("memory.activation_memory_budget: torch.compile's partitioner keeps at most %.2f of its default "
             "activation memory and recomputes the rest (the peak is measured, not assumed monotonic in it)",
             plan.activation_memory_budget)
