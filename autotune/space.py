"""The search space: which memory plans are worth measuring for this recipe on this device.

Every knob is one categorical parameter with string or int values, so a proposal is plain data
that optuna stores, a resumed study reads back unchanged, and the same seed proposes again.
Knobs the recipe pins (precision unless --search-precision, compile unless --search-compile,
offload off the GPU) are left out of the space, and each such choice is logged with its reason.
The global batch is never a knob: micro_batch only runs through the divisors of train.batch_size.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import CategoricalDistribution
from torch.nn.modules.batchnorm import _BatchNorm

from runner.memory.blocks import BlockList
from runner.memory.checkpointing import sqrt_segments
from runner.plan import MemoryPlan
from runner.recipe import Recipe

log = logging.getLogger(__name__)

EVERY_K = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # k for "checkpoint every k-th block": spread, not exhaustive
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Device:
    """What the probe child saw: the parent never touches CUDA itself."""

    kind: str  # "cpu" or "cuda"
    name: str
    total_bytes: int  # 0 on the CPU: no card-level limit to compare a cap with
    precisions: tuple[str, ...]  # the autocast precisions the device runs
    torch: str
    cuda: str | None = None
    context_bytes: int = 0  # the CUDA context once a step's kernels are loaded; counts against a card-level cap

    @classmethod
    def from_json(cls, data: dict) -> Device:
        return cls(data["kind"], data["name"], data["total_bytes"], tuple(data["precisions"]), data["torch"],
                   data.get("cuda"), int(data.get("context_bytes") or 0))


@dataclass(frozen=True)
class Candidate:
    """One point of the space: the memory plan and the precision it runs in."""

    plan: MemoryPlan
    precision: str

    @property
    def key(self) -> str:
        """Identical plans have identical keys: a repeated proposal reuses the earlier measurement."""
        return json.dumps({"memory": self.plan.model_dump(mode="json"), "precision": self.precision}, sort_keys=True)

    def recipe(self, base: Recipe, cap_bytes: int) -> Recipe:
        """`base` running this candidate; max_mem makes the probe stop (CUDA: fail to allocate) at the cap."""
        plan = self.plan.model_copy(update={"max_mem": cap_bytes})
        return base.model_copy(update={"memory": plan, "precision": self.precision})

    def describe(self) -> str:
        parts = [f"micro_batch {self.plan.micro_batch}", f"checkpointing {checkpointing_label(self.plan)}"]
        if self.plan.offload.policy != "none":
            parts.append(f"offload {self.plan.offload.policy}")
        if self.plan.compile:
            parts.append("compile")
        return ", ".join(parts + [self.precision])


@dataclass
class Space:
    """Choices per parameter; parameters absent from `choices` take the value in `fixed`."""

    choices: dict[str, list[Any]]
    fixed: dict[str, Any]
    device_kind: str = "cpu"
    blocks_path: str | None = None  # the recipe's memory.blocks, kept in every plan
    reasons: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        size = 1
        for values in self.choices.values():
            size *= len(values)
        return size

    def distributions(self) -> dict[str, CategoricalDistribution]:
        return {name: CategoricalDistribution(values) for name, values in self.choices.items()}

    def candidate(self, params: dict[str, Any]) -> Candidate:
        """The plan for optuna's `params` (searched knobs) and the pinned ones."""
        values = {**self.fixed, **params}
        plan = MemoryPlan.model_validate({
            "micro_batch": values["micro_batch"], "checkpointing": parse_checkpointing(values["checkpointing"]),
            "offload": {"policy": values["offload"]}, "compile": values["compile"], "blocks": self.blocks_path,
        })
        return Candidate(plan, values["precision"])

    def all_params(self) -> list[dict[str, Any]]:
        """Every point, in a fixed order: the grid the benchmark compares against."""
        names = list(self.choices)
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(self.choices[n] for n in names))]

    def starting_points(self, recipe: Recipe, fits: Callable[[Candidate], bool] | None = None) -> list[dict]:
        """Known-good plans tried first: no plan, every block, every 2nd block checkpointed; each at the
        largest micro-batch that `fits` (the prediction) accepts, else with the whole batch; in the
        recipe's own precision and compile. A policy with no micro-batch that fits is left out."""
        starts = []
        micro_batches = sorted(self.choices["micro_batch"], reverse=True) if fits else [recipe.train.batch_size]
        for checkpointing in ("none", "full", "every:2"):
            base = {"checkpointing": checkpointing, "offload": "none", "precision": recipe.precision,
                    "compile": recipe.memory.compile}
            base = {k: v for k, v in base.items() if k in self.choices}
            if any(v not in self.choices[k] for k, v in base.items()):
                continue  # every:2 on a model of 2 blocks, or a precision this device lacks
            fitting = (m for m in micro_batches if fits is None or fits(self.candidate({**base, "micro_batch": m})))
            micro = next(fitting, None)
            if micro is not None:
                starts.append({**base, "micro_batch": micro})
        return starts


def parse_checkpointing(value: str) -> dict:
    policy, _, every = value.partition(":")
    return {"policy": policy, "every": int(every)} if every else {"policy": policy}


def checkpointing_label(plan: MemoryPlan) -> str:
    policy = plan.checkpointing
    return f"every:{policy.every}" if policy.policy == "every" else policy.policy


def build_space(recipe: Recipe, blocks: BlockList, device: Device, search_precision: bool = False,
                search_compile: bool = False) -> Space:
    """The space for `recipe` on `device`; every automatic choice is logged with its reason."""
    space = Space({}, {}, device.kind, recipe.memory.blocks)
    _micro_batches(space, recipe.train.batch_size, blocks)
    _checkpointing(space, blocks)
    _offload(space, device)
    _precision(space, recipe.precision, device, search_precision)
    _compile(space, recipe.memory.compile, search_compile)
    for reason in space.reasons:
        log.info("space: %s", reason)
    log.info("space: %d plans in all", space.size)
    return space


def _micro_batches(space: Space, batch_size: int, blocks: BlockList) -> None:
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    space.choices["micro_batch"] = divisors
    space.reasons.append(f"micro_batch in {divisors}: the divisors of train.batch_size {batch_size}, so the global "
                         "batch stays the same")
    if blocks.root is not None and any(isinstance(m, _BatchNorm) for m in blocks.root.modules()):
        # gradients are summed over micro-batches exactly, but BatchNorm normalises over what it sees
        space.reasons.append("note: the model has BatchNorm, which normalises over each micro-batch: a smaller "
                             "micro_batch changes its batch statistics")


def _checkpointing(space: Space, blocks: BlockList) -> None:
    count = len(blocks)
    options = ["none", "full"] + [f"every:{k}" for k in EVERY_K if k < count]
    if len(sqrt_segments(blocks)) > 1:
        options.append("sqrt")  # with a single segment sqrt would checkpoint nothing: the same as none
    options.append("selective")
    space.choices["checkpointing"] = options
    space.reasons.append(f"checkpointing in {options}: {count} blocks ({blocks.container_name}); every k-th block "
                         f"for k < {count} from {list(EVERY_K[:4])}...")


def _offload(space: Space, device: Device) -> None:
    if device.kind == "cuda":
        space.choices["offload"] = ["none", "all"]
        space.reasons.append("offload in [none, all]: the run is on CUDA, where host memory can hold activations")
    else:
        space.fixed["offload"] = "none"
        space.reasons.append(f"offload not searched: the run is on the {device.kind}, where there is no device "
                             "memory to free")


def _precision(space: Space, pinned: str, device: Device, search: bool) -> None:
    if not search:
        space.fixed["precision"] = pinned
        space.reasons.append(f"precision pinned to the recipe's {pinned} (pass --search-precision to search "
                             f"{', '.join(device.precisions)})")
        return
    space.choices["precision"] = [p for p in PRECISIONS if p in device.precisions]
    space.reasons.append(f"precision in {space.choices['precision']}: what {device.name} supports "
                         "(--search-precision)")


def _compile(space: Space, pinned: bool, search: bool) -> None:
    if search:
        space.choices["compile"] = [False, True]
        space.reasons.append("compile in [False, True] (--search-compile): slower first step, often faster after")
    else:
        space.fixed["compile"] = pinned
        space.reasons.append(f"compile pinned to the recipe's {pinned} (pass --search-compile to try both)")
