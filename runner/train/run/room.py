"""Whether this machine has room for a run, told in one line before the model is built.

A model too large for the machine used to be built until the kernel killed it: a 46.7B Mixtral from its
default config on a 24 GB CPU box was killed at 21 GB resident, with nothing said. What a run holds at
least is known before anything is allocated: the model's parameters counted on the meta device, and
per parameter what the plan's pools keep (runner/memory/floor.py `pool_floor`: weights, gradients,
optimizer state, the tuner's lower bound; the activations come on top). That bound is held against

- on a CPU, the host memory a new allocation can get now: available RAM and free swap (the kernel's
  MemAvailable and SwapFree), within this process's cgroup limit;
- on CUDA, the card's free memory (NVML: no CUDA context is created);
- memory.max_mem, the recipe's cap, which would stop the run at its first step.

One process only: ranks shard or copy what the bound counts whole. A python model is not counted (its
factory would run twice, side effects and all), and where a figure cannot be read (no /proc, no NVML,
a model the meta device cannot build) nothing is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ...builders.model import build_model
from ...memory.floor import Floor, ParameterFacts, pool_floor
from ...problems import KeyedError
from ...recipe.recipe import Recipe
from ...units import format_bytes

log = logging.getLogger(__name__)

QUANTIZED_BYTES = 0.5  # QLoRA's 4-bit base: the meta build holds it unquantized; its scales come on top


def check_room(recipe: Recipe, device_kind: str) -> None:
    """Raise the one-line problem when the run cannot fit (module docstring); say nothing otherwise."""
    problem = room_problem(recipe, device_kind)
    if problem is not None:
        raise problem


def room_problem(recipe: Recipe, device_kind: str) -> KeyedError | None:
    if recipe.step_facts().distributed or recipe.model.source == "python":
        return None
    try:
        counted = _counted(recipe)
    except Exception as err:  # noqa: BLE001 - the build right after says what is wrong; counting is no reason to stop
        log.debug("room: the parameters were not counted on the meta device (%s)", err)
        return None
    floor = pool_floor(recipe.memory, counted, recipe.step_facts())
    cap = recipe.memory.max_mem
    if cap is not None and floor.total > cap:
        return KeyedError("memory.max_mem", f"{format_bytes(int(cap))} is under what this plan holds before any "
                          f"activation: at least {floor.words()}; raise the cap, or change the plan (`ckrun estimate "
                          "RECIPE` shows each pool)")
    have, what = _room(device_kind)
    log.debug("room: the plan holds at least %s; %s", floor.words(), what.format(format_bytes(have)) if have else
              "this machine's memory could not be read")
    if have is None or floor.total <= have:
        return None
    return KeyedError("model", _too_large(recipe, floor, have, what, device_kind))


def _too_large(recipe: Recipe, floor: Floor, have: int, what: str, device_kind: str) -> str:
    elsewhere = "a GPU (train.device: cuda) or a machine with more memory" if device_kind == "cpu" else \
        "a card with more memory"
    return (f"{recipe.model.name} cannot fit: with this plan it holds at least {floor.words()} before any "
            f"activation, and {what.format(format_bytes(have))}; use a smaller model (model.config), a plan that holds "
            f"less (`ckrun estimate RECIPE` shows each pool), or {elsewhere}")


def _counted(recipe: Recipe) -> ParameterFacts:
    """The model's parameters as the run builds them, counted on the meta device (nothing allocated)."""
    facts = ParameterFacts.of(build_model(recipe.model, device="meta", weights=False))
    lora = recipe.model.lora
    if lora is None or lora.quantize_base is None:
        return facts
    frozen = facts.count - facts.trainable
    return ParameterFacts(facts.count, facts.trainable_bytes + int(QUANTIZED_BYTES * frozen), facts.trainable,
                          facts.trainable_bytes, facts.largest)


def _room(device_kind: str) -> tuple[int | None, str]:
    """(bytes the run can have, the words for them), None where they cannot be read."""
    if device_kind == "cuda":
        from ...memory.nvml import card_free_bytes

        return card_free_bytes(0), "the GPU has {} free"
    return available_host_bytes(), "this machine has {} available (RAM and swap)"


def available_host_bytes() -> int | None:
    """What a new allocation can get from the host now: MemAvailable and SwapFree (/proc/meminfo), at most
    what this process's cgroup limit leaves; None where /proc does not say."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.split()[1:2] != []}
    if "MemAvailable" not in fields:
        return None
    available = fields["MemAvailable"] + fields.get("SwapFree", 0)
    limit = _cgroup_room()
    return available if limit is None else min(available, limit)


def _cgroup_room() -> int | None:
    """cgroup v2's memory.max less memory.current for this process's group (a container's limit), or None."""
    try:
        group = next(line.split("::", 1)[1] for line in Path("/proc/self/cgroup").read_text().splitlines()
                     if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / group.strip().lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        current = int((folder / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)
