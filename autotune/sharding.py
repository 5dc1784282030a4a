"""`ckrun tune --nproc N`: how the ranks share the work, as one more knob of the space.

With N ranks the memory of a rank depends on the strategy as much as on checkpointing: DDP keeps
the whole model, its gradients and optimizer state on every rank (and buckets of the gradients
besides); FSDP2 keeps 1/N of them and gathers each block's parameters while it runs. FSDP's own
knobs trade communication for memory the way checkpointing trades recompute: keeping the gathered
parameters from forward to backward (`reshard_after_forward: false`) saves a second all-gather,
and CPU offload (CUDA only) moves the shards, gradients and the optimizer step to the host.

The knob `sharding` takes one string per choice, so optuna stores it as it stores the others:
`ddp`, `fsdp`, `fsdp:keep` (reshard_after_forward false), `fsdp:cpu` (offload cpu), `fsdp:keep,cpu`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.recipe import Recipe

if TYPE_CHECKING:
    from .space import Device, Space

FSDP_VARIANTS = {"keep": ("reshard_after_forward", False), "cpu": ("offload", "cpu")}


def parse_sharding(value: str) -> tuple[str, dict | None]:
    """(distributed.strategy, memory.sharding) of a `sharding` choice."""
    strategy, _, variant = value.partition(":")
    if strategy == "ddp" or not variant:
        return strategy, None
    return strategy, dict(FSDP_VARIANTS[name] for name in variant.split(","))


def sharding_value(strategy: str, knobs: dict | None) -> str:
    """The choice for a strategy and its memory.sharding (the inverse of `parse_sharding`)."""
    knobs = knobs or {}
    variant = [name for name, (key, value) in FSDP_VARIANTS.items() if knobs.get(key) == value]
    return strategy + (":" + ",".join(variant) if strategy == "fsdp" and variant else "")


def describe_sharding(strategy: str, knobs: dict | None) -> str:
    """How a plan's label names it: `fsdp (reshard_after_forward false, offload cpu)`."""
    changed = [f"{key} {str(value).lower()}" for key, value in (knobs or {}).items()
               if (key, value) in FSDP_VARIANTS.values()]
    return strategy + (f" ({', '.join(changed)})" if changed else "")


def add_sharding(space: Space, recipe: Recipe, device: Device, nproc: int) -> None:
    """The `sharding` knob for `nproc` ranks, or the recipe's strategy pinned; the reason either way."""
    pinned = recipe.distributed.strategy
    space.world_size = nproc
    if pinned == "ddp":
        space.fixed["sharding"] = "ddp"
        space.reasons.append(f"sharding pinned to the recipe's ddp over {nproc} ranks (distributed.strategy: none "
                             "lets the tuner choose between ddp and fsdp)")
        return
    variants = ["fsdp", "fsdp:keep"] + (["fsdp:cpu"] if device.kind == "cuda" else [])
    own = sharding_value("fsdp", recipe.memory.sharding.model_dump() if recipe.memory.sharding else None)
    if pinned == "fsdp":
        space.choices["sharding"] = list(dict.fromkeys([own, *variants]))
        why = "the recipe's fsdp, with its knobs searched"
    else:
        space.choices["sharding"] = ["ddp", *variants]
        why = f"distributed.strategy none with --nproc {nproc}: ddp and fsdp both searched"
    offload = "" if device.kind == "cuda" else "; FSDP's CPU offload not searched: it needs CUDA"
    space.reasons.append(f"sharding in {space.choices['sharding']}: {why} (fsdp:keep keeps each block's gathered "
                         f"parameters from forward to backward){offload}")
