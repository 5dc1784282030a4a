"""The search space: which memory plans are worth measuring for this recipe on this device.

Every knob is one categorical parameter with string or int values, so a proposal is plain data
that optuna stores, a resumed study reads back unchanged, and the same seed proposes again.
Knobs the recipe pins (precision unless --search-precision, compile unless --search-compile,
offload off the GPU, micro_batch of a model with BatchNorm unless --search-micro-batch) are left
out of the space, and each such choice is logged with its reason. The global batch is never a
knob: micro_batch only runs through the divisors of train.batch_size.

Micro-batching changes what is computed where the model looks across samples: BatchNorm
normalises over each micro-batch, dropout draws its masks per micro-batch. The space says so in
its lines, and tuned.yaml in a comment (`micro_batch_comment`).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from runner.memory.blocks import Block, BlockList
from runner.plan import MemoryPlan
from runner.recipe import Recipe

from runner.policies import (CHECKPOINTING, EVERY_K, checkpointing_choices, compression_choices, offload_choices,
                             policy_class)

from .records import TrialRecord
from .labels import adaptive_buckets, compression_fields, parse_checkpointing, parse_offload
from .sharding import add_sharding, describe_sharding, parse_sharding

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
ALLOCATOR_SETTINGS = ("default", "expandable_segments:True")  # "default": PYTORCH_CUDA_ALLOC_CONF left alone
BUDGET_STEP = 0.1  # compile's activation_memory_budget: finer steps than this measure noise, not the knob


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

    @classmethod
    def from_json(cls, data: dict) -> ModelFacts:
        blocks = [Block(i, name, None) for i, name in enumerate(data["blocks"])]
        return cls(BlockList(data["container_name"], blocks, list(data["containers"])),
                   tuple(data.get("batchnorm", ())), tuple(data.get("dropout", ())))


@dataclass(frozen=True)
class Candidate:
    """One point of the space: the memory plan and the precision it runs in."""

    plan: MemoryPlan
    precision: str
    strategy: str | None = None  # distributed.strategy under --nproc; None: the recipe's

    @property
    def key(self) -> str:
        """Identical plans have identical keys: a repeated proposal reuses the earlier measurement."""
        ranks = {"distributed": self.strategy} if self.strategy else {}
        return json.dumps({"memory": self.plan.model_dump(mode="json"), "precision": self.precision, **ranks},
                          sort_keys=True)

    def recipe(self, base: Recipe, cap_bytes: int | None) -> Recipe:
        """`base` running this candidate, validated as the probe's child validates it: a ValidationError
        says what the recipe's schema refuses (the one set of validity rules). max_mem makes the probe
        stop (CUDA: fail to allocate) at the cap."""
        data = base.model_dump(mode="json")
        data.update(memory={**self.plan.model_dump(mode="json"), "max_mem": cap_bytes}, precision=self.precision)
        if self.strategy:
            data["distributed"] = {"strategy": self.strategy}
        return Recipe.model_validate(data)

    def describe(self) -> str:
        parts = [f"micro_batch {self.plan.micro_batch}", f"checkpointing {self.plan.checkpointing.label()}"]
        if self.strategy:
            sharding = self.plan.sharding.model_dump() if self.plan.sharding else None
            parts.insert(0, describe_sharding(self.strategy, sharding))
        if self.plan.offload.moves:
            parts.append(f"offload {self.plan.offload.label()}")
        if self.plan.compile:
            budget = self.plan.activation_memory_budget
            parts.append("compile" + (f" (activation budget {budget:g})" if budget is not None else ""))
        if self.plan.allocator is not None:
            parts.append(f"allocator {self.plan.allocator}")
        for bucket in self.plan.adaptive:
            parts.append(f"up to {bucket.max_len} tokens: {bucket.checkpointing.label()}")
        if self.plan.compression.lossy:
            parts.append(f"compression {self.plan.compression.label()} (lossy)")
        return ", ".join(parts + [self.precision])


@dataclass
class Space:
    """Choices per parameter; parameters absent from `choices` take the value in `fixed`."""

    choices: dict[str, list[Any]]
    fixed: dict[str, Any]
    device_kind: str = "cpu"
    blocks_path: str | None = None  # the recipe's memory.blocks, kept in every plan
    reasons: list[str] = field(default_factory=list)
    batch_size: int = 0
    batchnorm: tuple[str, ...] = ()
    dropout: tuple[str, ...] = ()
    world_size: int = 1  # --nproc: batch_size is then a rank's share of the global batch
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

    def distributions(self) -> dict[str, BaseDistribution]:
        return {**{name: CategoricalDistribution(values) for name, values in self.choices.items()}, **self.numeric}

    def candidate(self, params: dict[str, Any]) -> Candidate:
        """The plan for optuna's `params` (searched knobs) and the pinned ones."""
        values = {**self.fixed, **params}
        compiled = values["compile"]
        strategy, sharding = parse_sharding(values["sharding"]) if "sharding" in values else (None, None)
        plan = MemoryPlan.model_validate({
            "activation_memory_budget": _budget(values.get("activation_memory_budget"), compiled),
            "allocator": None if values.get("allocator", "default") == "default" else values["allocator"],
            "micro_batch": values["micro_batch"], "checkpointing": parse_checkpointing(values["checkpointing"]),
            "offload": parse_offload(values["offload"]), "compile": values["compile"], "blocks": self.blocks_path,
            "adaptive": adaptive_buckets(values),
            **compression_fields(values.get("compression", "none")),
            **({"sharding": sharding} if sharding else {}),
        })
        return Candidate(plan, values["precision"], strategy)

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
        add_sharding(space, recipe, device, nproc)
    _micro_batches(space, recipe.memory.micro_batch or space.batch_size, search_micro_batch)
    _checkpointing(space, facts.blocks)
    _adaptive(space, recipe)
    _offload(space, device)
    _allocator(space, recipe.memory.allocator, device)
    _precision(space, recipe.precision, device, search_precision)
    _compile(space, recipe.memory.compile, search_compile)
    _compression(space, recipe.memory, allow_lossy)
    for reason in space.reasons:
        log.info("space: %s", reason)
    log.info("space: %d plans in all", space.size)
    return space


def _micro_batches(space: Space, recipe_micro: int, search: bool) -> None:
    batch_size = space.batch_size
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    if space.batchnorm and not search:
        space.fixed["micro_batch"] = recipe_micro
        space.reasons.append(f"micro_batch pinned to the recipe's {recipe_micro}: the model has BatchNorm "
                             f"({_layers(space.batchnorm)}), which normalises over each micro-batch, so another "
                             f"micro_batch would change what it computes (--search-micro-batch searches {divisors})")
        return
    space.choices["micro_batch"] = divisors
    whose = f"train.batch_size {batch_size}" if space.world_size == 1 else \
        f"a rank's share {batch_size} (train.batch_size over {space.world_size} ranks)"
    space.reasons.append(f"micro_batch in {divisors}: the divisors of {whose}, so the global "
                         "batch stays the same; the gradient is the same only without BatchNorm and dropout")
    if space.batchnorm:
        space.reasons.append(f"note: micro_batch searched (--search-micro-batch) although the model has BatchNorm "
                             f"({_layers(space.batchnorm)}): below {batch_size} it normalises over fewer samples, "
                             "which changes its statistics and the result")
    if space.dropout:
        space.reasons.append(f"note: the model has dropout ({_layers(space.dropout)}): its masks are drawn per "
                             "micro-batch, so losses differ from the whole batch's (the same in distribution)")


def micro_batch_comment(space: Space, micro: int) -> str | None:
    """tuned.yaml's line on what the chosen micro_batch does to the result, when it does anything."""
    if "micro_batch" not in space.choices and space.batchnorm:
        return (f"micro_batch {micro}: the recipe's, not searched: the model has BatchNorm, which normalises over "
                "each micro-batch (--search-micro-batch searches it)")
    if micro >= space.batch_size:
        return None
    if space.batchnorm:
        return (f"micro_batch {micro} of batch {space.batch_size} (--search-micro-batch): BatchNorm normalises over "
                f"{micro} samples, not {space.batch_size}: the result differs from the whole batch's")
    if space.dropout:
        return (f"micro_batch {micro} of batch {space.batch_size}: dropout masks are drawn per micro-batch; the "
                "gradient is otherwise the whole batch's")
    return (f"micro_batch {micro} of batch {space.batch_size}: the gradient is the whole batch's (no BatchNorm or "
            "dropout layers found)")


def _layers(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:3])
    return f"{len(names)} layer{'s' if len(names) != 1 else ''}: {shown}{', ...' if len(names) > 3 else ''}"


def _checkpointing(space: Space, blocks: BlockList) -> None:
    count = len(blocks)
    options = checkpointing_choices(blocks)  # each policy's own, for this model's blocks
    space.choices["checkpointing"] = options
    space.reasons.append(f"checkpointing in {options}: {count} blocks ({blocks.container_name}); every k-th block "
                         f"for k < {count} from {list(EVERY_K[:4])}...")


def _adaptive(space: Space, recipe: Recipe) -> None:
    """Text of varying length (data.split: lines): short batches may checkpoint less than long ones."""
    if getattr(recipe.data, "split", "packed") != "lines":
        return  # every batch is data.seq_len long: one plan fits them all
    if recipe.memory.adaptive:
        space.fixed["adaptive"] = [bucket.model_dump(mode="json") for bucket in recipe.memory.adaptive]
        space.reasons.append("memory.adaptive pinned to the recipe's buckets")
        return
    space.fixed["short_len"] = max(1, recipe.data.seq_len // 2)
    switchable = [c for c in space.choices["checkpointing"] if not policy_class(CHECKPOINTING, c).spans_blocks]
    space.choices["short_checkpointing"] = ["same"] + switchable
    space.reasons.append(f"short_checkpointing in {space.choices['short_checkpointing']}: data.split lines pads each "
                         f"batch to its longest line, so batches up to {space.fixed['short_len']} tokens may keep "
                         "more (memory.adaptive); probes run the longest batch of each bucket")


def _offload(space: Space, device: Device) -> None:
    options = offload_choices(device.kind)
    if len(options) > 1:
        space.choices["offload"] = options
        space.reasons.append(f"offload in {options}: the run is on CUDA, where host memory can hold activations")
    else:
        space.fixed["offload"] = options[0]
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
    if search or pinned:
        _compile_budget(space)


def _compile_budget(space: Space) -> None:
    from runner.memory.torch_features import missing_budget

    if missing_budget():
        space.reasons.append(f"activation_memory_budget not searched: {missing_budget()}")
        return
    space.numeric["activation_memory_budget"] = FloatDistribution(0.0, 1.0, step=BUDGET_STEP)
    space.reasons.append(f"activation_memory_budget in [0, 1] by {BUDGET_STEP} with compile: what torch.compile's "
                         "partitioner may keep; its peak is not monotonic in it (pytorch issue 197838), so every "
                         "value is measured, none ruled out from its neighbours")


def _allocator(space: Space, pinned: str | None, device: Device) -> None:
    if device.kind != "cuda":
        if pinned is not None:
            space.fixed["allocator"] = pinned
        space.reasons.append(f"allocator not searched: the run is on the {device.kind}, which has no CUDA caching "
                             "allocator to configure")
        return
    space.choices["allocator"] = list(dict.fromkeys([pinned or "default", *ALLOCATOR_SETTINGS]))
    space.reasons.append(f"allocator in {space.choices['allocator']}: PYTORCH_CUDA_ALLOC_CONF per probe, set in the "
                         "probe's environment before CUDA starts (expandable segments fragment less)")


def _compression(space: Space, memory: MemoryPlan, allow_lossy: bool) -> None:
    pinned, lossy = memory.compression.label(), memory.compression.lossy
    if not allow_lossy:
        if lossy:  # an exact plan is what a plan without the key gets: the space's fixed keys stay as they were
            space.fixed["compression"] = pinned
        why = "the recipe's lossy choice (memory.allow_lossy)" if lossy else "it is lossy"
        space.reasons.append(f"compression pinned to {pinned}: {why}; --allow-lossy searches bf16/fp8 storage of "
                             "saved activations, which changes the gradients")
        return
    space.choices["compression"] = compression_choices()
    space.reasons.append(f"compression in {space.choices['compression']} (--allow-lossy): saved activations stored "
                         "rounded; lossy, and each such plan's gradient error is measured in its probe")


def compression_comment(record: TrialRecord) -> str | None:
    """tuned.yaml's line on a lossy winner: what it changes, and by how much on one micro-batch."""
    compression = MemoryPlan.model_validate(record.plan).compression
    if not compression.lossy:
        return None
    policy = compression.label()
    error = record.gradient_error
    measured = f"relative gradient error {error:.2e} against the exact plan (one micro-batch)" if error is not None else \
        "gradient error not measured"
    return (f"LOSSY: memory.compression {policy} stores saved activations rounded: {measured}; set "
            "memory.compression.policy: none for exact gradients")
