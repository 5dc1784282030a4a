"""The search space: which memory plans are worth measuring for this recipe on this device.

Every knob is one categorical parameter with string or int values, so a proposal is plain data
that optuna stores, a resumed study reads back unchanged, and the same seed proposes again.
Knobs the recipe pins (precision unless --search-precision, compile unless --search-compile,
offload off the GPU, micro_batch of a model with BatchNorm unless --search-micro-batch) are left
out of the space, and each such choice is logged with its reason. The global batch is never a
knob: micro_batch only runs through the divisors of train.batch_size (of a rank's share under
--nproc). Each knob's choices and reasons come from autotune/knobs.py, the ranks' `sharding` knob
from autotune/sharding.py; a point becomes a typed `Candidate` (autotune/candidate.py).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from runner.memory.blocks import Block, BlockList
from runner.plan import MemoryPlan
from runner.recipe import Recipe
from runner.strategies import Strategy

from .candidate import Candidate
from .knobs import (add_adaptive, add_allocator, add_checkpointing, add_compile, add_compression, add_micro_batches,
                    add_offload, add_precision)
from .labels import adaptive_buckets, compression_fields, parse_checkpointing, parse_offload
from .sharding import ShardingChoice, add_sharding
from .tp_facts import TensorFacts

log = logging.getLogger(__name__)


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
    count: int = 1  # GPUs on this machine: ranks for tune --nproc

    @classmethod
    def from_json(cls, data: dict) -> Device:
        return cls(data["kind"], data["name"], data["total_bytes"], tuple(data["precisions"]), data["torch"],
                   data.get("cuda"), int(data.get("context_bytes") or 0), int(data.get("count") or 1))


@dataclass(frozen=True)
class ModelFacts:
    """What the space needs to know of the model, as the model child reported it (the tuner never
    builds the user's model itself)."""

    blocks: BlockList  # names and containers; the modules stay in the child
    batchnorm: tuple[str, ...] = ()  # BatchNorm layers: they normalise over each micro-batch
    dropout: tuple[str, ...] = ()  # dropout layers with p > 0: masks are drawn per micro-batch
    tensor: TensorFacts | None = None  # its tensor-parallel plan (tp under --nproc); None: the child did not say

    @classmethod
    def from_json(cls, data: dict) -> ModelFacts:
        blocks = [Block(i, name, None) for i, name in enumerate(data["blocks"])]
        tensor = data.get("tensor_parallel")
        return cls(BlockList(data["container_name"], blocks, list(data["containers"])),
                   tuple(data.get("batchnorm", ())), tuple(data.get("dropout", ())),
                   TensorFacts.from_json(tensor) if tensor else None)


@dataclass
class Space:
    """Choices per parameter; parameters absent from `choices` take the value in `fixed`."""

    choices: dict[str, list[Any]]
    fixed: dict[str, Any]
    device_kind: str = "cpu"
    blocks_path: str | None = None  # the recipe's memory.blocks, kept in every plan
    reasons: list[str] = field(default_factory=list)
    batch_size: int = 0  # a rank's share of train.batch_size (the least under --nproc: every strategy divides it)
    batchnorm: tuple[str, ...] = ()
    dropout: tuple[str, ...] = ()
    world_size: int = 1  # --nproc
    base: Recipe | None = None  # the recipe every candidate runs in: what its schema refuses is never probed
    numeric: dict[str, FloatDistribution] = field(default_factory=dict)
    """Continuous knobs (compile's activation_memory_budget): TPE models them as numbers; the grid
    takes their steps. Nothing is pruned from a neighbour's result: each value is measured."""

    @property
    def size(self) -> int:
        size = 1
        for values in [*self.choices.values(), *map(grid_of, self.numeric.values())]:
            size *= len(values)
        return size

    def share(self, strategy: Strategy | None) -> int:
        """A rank's samples per step under `strategy`: the ranks of one tensor-parallel group see the same."""
        if strategy is None:
            return self.batch_size
        return self.batch_size * self.world_size // strategy.data_parallel(self.world_size)

    def strategies(self) -> list[Strategy]:
        """The strategies the `sharding` knob takes (none without --nproc)."""
        labels = self.choices.get("sharding") or ([self.fixed["sharding"]] if "sharding" in self.fixed else [])
        strategies = {}  # by label: a tp plan (a dict) makes a strategy unhashable
        for label in labels:
            strategy = self._sharding(label).strategy
            strategies.setdefault(strategy.label(), strategy)
        return list(strategies.values())

    def _sharding(self, label: str) -> ShardingChoice:
        return ShardingChoice.from_label(label, self.base.distributed if self.base else None)

    def distributions(self) -> dict[str, BaseDistribution]:
        return {**{name: CategoricalDistribution(values) for name, values in self.choices.items()}, **self.numeric}

    def candidate(self, params: dict[str, Any]) -> Candidate:
        """The plan for optuna's `params` (searched knobs) and the pinned ones."""
        values = {**self.fixed, **params}
        compiled = values["compile"]
        sharding = self._sharding(values["sharding"]) if "sharding" in values else None
        plan = MemoryPlan.model_validate({
            "activation_memory_budget": _budget(values.get("activation_memory_budget"), compiled),
            "allocator": None if values.get("allocator", "default") == "default" else values["allocator"],
            "micro_batch": values["micro_batch"], "checkpointing": parse_checkpointing(values["checkpointing"]),
            "offload": parse_offload(values["offload"]), "compile": values["compile"], "blocks": self.blocks_path,
            "adaptive": adaptive_buckets(values),
            **compression_fields(values.get("compression", "none")),
            **({"sharding": sharding.knobs.model_dump()} if sharding and sharding.knobs else {}),
        })
        return Candidate(plan, values["precision"], sharding.strategy if sharding else None)

    def all_params(self) -> list[dict[str, Any]]:
        """Every point, in a fixed order: the grid the benchmark compares against."""
        grids = {**self.choices, **{name: grid_of(d) for name, d in self.numeric.items()}}
        return [dict(zip(grids, combo, strict=True)) for combo in itertools.product(*grids.values())]

    def starting_points(self, recipe: Recipe, fits: Callable[[Candidate], bool] | None = None) -> list[dict]:
        """Known-good plans tried first: no plan, every block, every 2nd block checkpointed; each at the
        largest micro-batch that `fits` (the prediction) accepts, else with the whole batch; in the
        recipe's own precision and compile. A policy with no micro-batch that fits is left out. Under
        --nproc each takes the first sharding (in the order of its choices) with a micro-batch that fits."""
        starts = []
        if "micro_batch" not in self.choices:
            micro_batches = [None]  # pinned: `fixed` holds it
        elif fits:
            micro_batches = sorted(self.choices["micro_batch"], reverse=True)
        else:
            micro_batches = [self.batch_size]  # a rank's share under --nproc
        for checkpointing in ("none", "full", "every:2"):
            base = {"checkpointing": checkpointing, "offload": "none", "precision": recipe.precision,
                    "compile": recipe.memory.compile, "compression": "none", "allocator": "default",
                    "short_checkpointing": "same"}
            base = {k: v for k, v in base.items() if k in self.choices}
            if any(v not in self.choices[k] for k, v in base.items()):
                continue  # every:2 on a model of 2 blocks, or a precision this device lacks
            if "activation_memory_budget" in self.numeric:
                base["activation_memory_budget"] = 1.0  # torch's default: the compiled plan as torch makes it
            shardings = [{"sharding": s} for s in self.choices.get("sharding", [])] or [{}]
            with_micro = [{**base, **sharding, **({"micro_batch": m} if m is not None else {})}
                          for sharding in (shardings if fits else shardings[:1]) for m in micro_batches]
            fitting = (p for p in with_micro if fits is None or fits(self.candidate(p)))
            start = next(fitting, None)
            if start is not None:
                starts.append(start)
        return starts

    def micro_batches(self) -> list[int]:
        return self.choices.get("micro_batch") or [self.fixed["micro_batch"]]

    def own_point(self, recipe: Recipe) -> dict | None:
        """The recipe's own plan as a point of the space (its per-block labels join the choices), or
        None where it sets something the space cannot say (a knob pinned otherwise, memory.adaptive
        buckets, sharding)."""
        plan = recipe.memory
        if plan.adaptive or "sharding" in self.choices:
            return None
        values = {"micro_batch": plan.micro_batch or self.batch_size, "checkpointing": plan.checkpointing.label(),
                  "offload": plan.offload.label(), "precision": recipe.precision, "compile": plan.compile,
                  "allocator": plan.allocator or "default", "compression": plan.compression.label(),
                  "short_checkpointing": "same"}
        if any(self.fixed.get(k, v) != v for k, v in values.items() if k not in self.choices):
            return None
        point = {k: v for k, v in values.items() if k in self.choices}
        for name in ("checkpointing", "offload"):
            if name in point and point[name] not in self.choices[name]:
                self.choices[name].append(point[name])
        if any(v not in self.choices[k] for k, v in point.items()):
            return None
        if "activation_memory_budget" in self.numeric:
            point["activation_memory_budget"] = round(plan.activation_memory_budget if plan.activation_memory_budget
                                                      is not None else 1.0, 1)
        return point


def _budget(value: float | None, compiled: bool) -> float | None:
    """The budget a compiled plan runs with; TPE's 0.30000000000000004 is the grid's 0.3."""
    return round(value, 6) if compiled and value is not None else None


def grid_of(distribution: FloatDistribution) -> list[float]:
    """The values of a stepped float knob, low to high."""
    count = round((distribution.high - distribution.low) / distribution.step) + 1
    return [round(distribution.low + i * distribution.step, 6) for i in range(count)]


def add_proposals(space: Space, proposals: list[dict]) -> list[dict]:
    """The solver's plans (`Proposal.record()`s) as points of the space: their per-block labels join
    the choices (so TPE can move from them to the rules around), and their params come back in order.
    A proposal whose micro-batch or precision the space does not search is left out."""
    points = []
    for proposal in proposals:
        plan = MemoryPlan.model_validate(proposal["plan"])
        params = {"micro_batch": plan.micro_batch, "checkpointing": plan.checkpointing.label(),
                  "offload": plan.offload.label(), "precision": proposal["precision"], "compile": plan.compile}
        params = {k: v for k, v in params.items() if k in space.choices or space.fixed.get(k) != v}
        if any(k not in space.choices for k in params):
            continue  # it differs from a pinned knob (offload on a CPU, another precision)
        for name in ("checkpointing", "offload"):
            if name in params and params[name] not in space.choices[name]:
                space.choices[name].append(params[name])
        if all(params[k] in space.choices[k] for k in params) and params not in points:
            points.append(params)
    return points


def build_space(recipe: Recipe, facts: ModelFacts, device: Device, search_precision: bool = False,
                search_compile: bool = False, search_micro_batch: bool = False, allow_lossy: bool = False,
                nproc: int = 1) -> Space:
    """The space for `recipe` on `device` (each of `nproc` ranks); every automatic choice is logged with its reason."""
    space = Space({}, {}, device.kind, recipe.memory.blocks, batch_size=recipe.train.batch_size // nproc,
                  batchnorm=facts.batchnorm, dropout=facts.dropout, base=recipe)
    if nproc > 1:
        add_sharding(space, recipe, facts.tensor, device, nproc)
    add_micro_batches(space, recipe.memory.micro_batch or space.batch_size, search_micro_batch)
    add_checkpointing(space, facts.blocks)
    add_adaptive(space, recipe)
    add_offload(space, device)
    add_allocator(space, recipe.memory.allocator, device)
    held = recipe.model.lora.base_dtype if recipe.model.lora is not None else "fp32"
    if search_precision and held != "fp32":  # the base is built once, in the dtype only that autocast computes in
        space.reasons.append(f"--search-precision set aside: model.lora.base_dtype {held} needs precision {held}")
        search_precision = False
    add_precision(space, recipe.precision, device, search_precision)
    add_compile(space, recipe.memory.compile, search_compile)
    add_compression(space, recipe.memory, allow_lossy)
    for reason in space.reasons:
        log.info("space: %s", reason)
    log.info("space: %d plans in all", space.size)
    return space


