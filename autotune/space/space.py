"""The search space: which memory plans are worth measuring for this recipe on this device.

Every knob is one categorical parameter with string or int values (or a stepped float), so a
proposal is plain data that optuna stores, a resumed study reads back unchanged, and the same seed
proposes again. A space is built over a table of knobs (autotune/space/knobs.py's `KNOBS`), one `Knob`
record each: how it joins the space (its choices, or the value it is pinned to, and why), how a
value becomes the candidate's plan and is read back from one, its starting values and its words in
a log line. Everything here loops over that table; nothing names a knob. Knobs the recipe pins are
left out of the space, and each such choice is logged with its reason. A point becomes a typed
`Candidate` (autotune/space/candidate.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.plan.strategies import Strategy

from .candidate import Candidate
from .facts import Device, ModelFacts

UNSAID = object()
"""What a knob's `from_plan` gives for a plan the space cannot say (the recipe's memory.adaptive
buckets): such a plan is no point of the space."""


@dataclass(frozen=True)
class Flag:
    """`ckrun tune`'s option that opens a knob the space otherwise pins (--search-precision)."""

    option: str
    help: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Asked:
    """What a space is built for: the recipe, what its model and device are, the ranks, and which
    knobs a flag opened (by knob name)."""

    recipe: Recipe
    facts: ModelFacts
    device: Device
    nproc: int = 1
    opened: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Knob:
    """One tuner knob: its whole life in the search, in one record (autotune/space/knobs.py holds the table)."""

    name: str
    """Its parameter in the space and in every study file (optuna's name): never renamed."""
    add: Callable[[Space, Asked], None]
    """Joins the space: its choices (`space.choices`, `space.numeric`) or the value it is pinned to
    (`space.fixed`), with the reason either way (`space.reasons`)."""
    to_plan: Callable[[dict, Space], dict]
    """A point's values (pinned ones included) as its part of the candidate: `{"memory": {field:
    value}}`, `{"precision": ...}` or `{"strategy": ...}`; nothing where the knob is not in the point."""
    from_plan: Callable[[Candidate, Space], Any]
    """The value a candidate (the recipe's own plan, a solver's plan) has, or UNSAID."""
    start: Callable[[Space, Recipe, bool], list]
    """Its values in the known-good starting points (given whether there are predictions)."""
    words: Callable[[Candidate], str | None]
    """What a log line says of it (`checkpointing every:2`), or None where it says nothing."""
    flag: Flag | None = None
    """The option that opens it; without it the knob is pinned to the recipe's value."""
    fits_first: bool = False
    """Its start values are tried in order and the first that fits is taken (micro-batch: the largest
    predicted to fit); else each start value is a starting point of its own (checkpointing)."""
    joins: bool = False
    """A plan's value outside its choices joins them (the solver's per-block labels `layers:1,3`)."""
    solver: bool = False
    """The per-block solver's plans set it; the sampler picks it for them otherwise."""
    note: Callable[[Space, Any], str | None] | None = None
    """tuned.yaml's line on what the winner's value does to the result (given the space and the
    winner's TrialRecord), or None."""
    lighter: Callable[[Space, Any], list] | None = None
    """Its values in the space that hold less memory than the given one, the nearest first (where the
    predicted search goes from a plan over the limit: autotune/search/descent.py); None where its values
    have no such order (checkpointing, the allocator)."""


def later_choices(name: str) -> Callable[[Space, Any], list]:
    """`Knob.lighter` of a knob whose choices go from mild to strong: the values after the given one."""
    def lighter(space: Space, value) -> list:
        values = space.choices.get(name, [])
        return values[values.index(value) + 1:] if value in values else []
    return lighter


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
    knobs: tuple[Knob, ...] = ()
    """The table the space is built over, in order: its candidates, starting points, own and solver points
    and tuned.yaml's notes loop over it."""
    strategies: list[Strategy] = field(default_factory=list)
    """The strategies the ranks' knob takes (none without --nproc)."""
    bound: Any = None
    """The pools' lower bound for this search (autotune/space/pool_floor.py `Bound`, set once the cap is
    known): a plan over it is ruled out unpredicted. None: no bound (no parameter facts, --nproc)."""
    tight: bool = False
    """No pool setting leaves the activations much room under the limit (autotune/space/pool_knobs.py): the
    starting points that save the most come first."""
    pool_start: dict[str, str] | None = None
    """The pool setting of the starting points and the solver's plans (autotune/space/pool_knobs.py), once chosen."""
    pool_alternatives: list[dict[str, str]] = field(default_factory=list)
    """Other pool settings the starting points are made with too (autotune/space/pool_knobs.py: without the
    host's update, where --allow-lossy leaves the activations room without it)."""

    @property
    def size(self) -> int:
        size = 1
        for values in [*self.choices.values(), *map(grid_of, self.numeric.values())]:
            size *= len(values)
        return size

    def searched(self, name: str) -> bool:
        return name in self.choices or name in self.numeric

    def allows(self, name: str, value: Any) -> bool:
        """`value` is one of the searched knob `name`'s choices (or a step of its grid)."""
        return value in (self.choices[name] if name in self.choices else grid_of(self.numeric[name]))

    def share(self, strategy: Strategy | None) -> int:
        """A rank's samples per step under `strategy`: the ranks of one tensor-parallel group see the same."""
        if strategy is None:
            return self.batch_size
        return self.batch_size * self.world_size // strategy.data_parallel(self.world_size)

    def distributions(self) -> dict[str, BaseDistribution]:
        return {**{name: CategoricalDistribution(values) for name, values in self.choices.items()}, **self.numeric}

    def candidate(self, params: dict[str, Any]) -> Candidate:
        """The plan for optuna's `params` (searched knobs) and the pinned ones."""
        values = {**self.fixed, **params}
        memory, parts = {"blocks": self.blocks_path}, {}
        for knob in self.knobs:
            part = knob.to_plan(values, self)
            memory.update(part.pop("memory", {}))
            parts.update(part)
        return Candidate(MemoryPlan.model_validate(memory), parts["precision"], parts.get("strategy"))

    def neighbours(self, params: dict[str, Any]):
        """The points one searched knob away from `params`, in the table's order: (knob name, point)."""
        for name, values in self.choices.items():
            for value in values:
                if value != params.get(name):
                    yield name, {**params, name: value}

    def all_params(self) -> list[dict[str, Any]]:
        """Every point, in a fixed order: the grid the benchmark compares against."""
        grids = {**self.choices, **{name: grid_of(d) for name, d in self.numeric.items()}}
        return [dict(zip(grids, combo, strict=True)) for combo in itertools.product(*grids.values())]

    def starting_points(self, recipe: Recipe, fits: Callable[[Candidate], bool] | None = None) -> list[dict]:
        """Known-good plans tried first: one per combination of the knobs' start values (no plan, every
        block, every 2nd block checkpointed), each in the recipe's own precision and compile, at the
        first value of the `fits_first` knobs that `fits` (the prediction) accepts: the largest
        micro-batch, under --nproc the first sharding with one; without predictions at the whole batch.
        A combination with a value the space lacks, or with nothing that fits, is left out."""
        searched = [knob for knob in self.knobs if self.searched(knob.name)]
        starts = {knob.name: knob.start(self, recipe, fits is not None) for knob in searched}
        points = []
        for pools in [{}, *self.pool_alternatives]:  # the knobs' own starts, then each other pool setting
            here = {name: [pools[name]] if name in pools else values for name, values in starts.items()}
            points += [p for p in self._starts_of(searched, here, fits) if p not in points]
        return points

    def _starts_of(self, searched: list[Knob], starts: dict[str, list], fits) -> list[dict]:
        """`starting_points` of one set of the knobs' start values."""
        alternatives = {k.name: starts[k.name] for k in searched if not k.fits_first}
        ordered = {k.name: starts[k.name] if fits else starts[k.name][:1] for k in searched if k.fits_first}
        points = []
        combos = list(itertools.product(*alternatives.values()))
        if self.tight:  # most knobs off their first (no-op) start value first: the likeliest to fit
            firsts = [values[0] for values in alternatives.values()]
            combos.sort(key=lambda combo: -sum(v != f for v, f in zip(combo, firsts, strict=True)))
        for combo in combos:
            base = dict(zip(alternatives, combo, strict=True))
            if not all(self.allows(name, value) for name, value in base.items()):
                continue  # every:2 on a model of 2 blocks, or a precision this device lacks
            tries = [{**base, **dict(zip(ordered, sizes, strict=True))} for sizes in itertools.product(*ordered.values())]
            start = _first_fitting(tries, fits, self.candidate, bisect=len(ordered) == 1)
            if start is not None:
                points.append(start)
        return points

    def micro_batches(self) -> list[int]:
        return self.choices.get("micro_batch") or [self.fixed["micro_batch"]]

    def own_point(self, recipe: Recipe) -> dict | None:
        """The recipe's own plan as a point of the space (its per-block labels join the choices), or
        None where it sets something the space cannot say (a knob pinned otherwise, memory.adaptive
        buckets)."""
        return self.point_of(Candidate(recipe.memory, recipe.precision))

    def point_of(self, candidate: Candidate) -> dict | None:
        """A candidate's params in this space (see `own_point`), or None where it says what the space cannot."""
        values = {knob.name: knob.from_plan(candidate, self) for knob in self.knobs}
        if any(value is UNSAID for value in values.values()):
            return None
        if any(name in self.fixed and self.fixed[name] != value for name, value in values.items()
               if not self.searched(name)):
            return None
        return self._point({name: value for name, value in values.items() if self.searched(name)})

    def add_proposals(self, proposals: list[dict]) -> list[dict]:
        """The solver's plans (`Proposal.record()`s) as points of the space: their per-block labels join
        the choices (so TPE can move from them to the rules around), and their params come back in order.
        A proposal whose micro-batch or precision the space does not search is left out. Knobs the solver
        does not set are left to the sampler."""
        points = []
        for proposal in proposals:
            planned = Candidate(MemoryPlan.model_validate(proposal["plan"]), proposal["precision"])
            params = {knob.name: knob.from_plan(planned, self) for knob in self.knobs if knob.solver}
            params = {k: v for k, v in params.items() if self.searched(k) or self.fixed.get(k) != v}
            if any(not self.searched(k) for k in params):
                continue  # it differs from a pinned knob (offload on a CPU, another precision)
            point = self._point(params)
            if point is not None and point not in points:
                points.append(point)
        return points

    def _point(self, values: dict[str, Any]) -> dict | None:
        """`values` of searched knobs as a point: a joining knob's new value joins its choices first."""
        for knob in self.knobs:
            value = values.get(knob.name)
            if knob.joins and knob.name in values and knob.name in self.choices and value not in self.choices[knob.name]:
                self.choices[knob.name].append(value)
        return values if all(self.allows(name, value) for name, value in values.items()) else None


def _first_fitting(tries: list[dict], fits, candidate, bisect: bool) -> dict | None:
    """The first of `tries` that `fits` accepts (all of them without `fits`). With `bisect` (one knob,
    largest first: the micro-batch), a binary search: the peak grows with the micro-batch, so a
    micro-batch that fits says every smaller one does (a 1B model's predictions take seconds each)."""
    if fits is None:
        return tries[0] if tries else None
    if not bisect or not tries or fits(candidate(tries[0])):  # the largest first: a small model's fits at once
        return next((p for p in tries if fits(candidate(p))), None)
    low, high = 1, len(tries)  # tries[high:] fit, tries[:low] do not
    while low < high:
        middle = (low + high) // 2
        if fits(candidate(tries[middle])):
            high = middle
        else:
            low = middle + 1
    return tries[low] if low < len(tries) else None


def grid_of(distribution: FloatDistribution) -> list[float]:
    """The values of a stepped float knob, low to high."""
    count = round((distribution.high - distribution.low) / distribution.step) + 1
    return [round(distribution.low + i * distribution.step, 6) for i in range(count)]
