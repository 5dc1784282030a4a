"""The tuner's side of the pools' lower bound (ckrun.runner.memory.floor: `pool_floor`, what a plan holds at
least from its pools' policies and the model's parameter counts, which the model child counts on the meta
device: autotune/space/facts.py `ParameterFacts`).

The tuner rules out a plan whose bound is over the limit before predicting it (autotune/search/screening.py),
and when every plan of the space is, it says so at once with the knob or the cap that would change
that (`nothing_fits_line`). Under --nproc the ranks shard (FSDP) what this counts whole: no bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ckrun.runner.plan.choices import choice_class, choice_fields
from ckrun.runner.memory.floor import BF16_BYTES, MOMENTS, Floor, pool_floor  # noqa: F401 - the bound, importable here as before
from ckrun.runner.plan.memory_plan import MemoryPlan, StepFacts, plan_problems
from ckrun.runner.plan.pool_policies import POOL_KINDS
from ckrun.runner.units import format_bytes

from .facts import ParameterFacts


# --- over a space's pool settings -------------------------------------------------------------------


def pool_plan(labels: dict[str, str]) -> MemoryPlan:
    """A plan with these pool policies (by section and tuner label) and nothing else set."""
    fields = {section: choice_fields(POOL_KINDS[section], label) for section, label in labels.items()}
    lossy = any(choice_class(POOL_KINDS[section], label).lossy for section, label in labels.items())
    return MemoryPlan.model_validate({**fields, **({"allow_lossy": True} if lossy else {})})


def settings(values: dict[str, Iterable[str]]) -> list[dict[str, str]]:
    """Every combination of the pools' labels, each section's values in the order given."""
    sections = list(values)
    return [dict(zip(sections, combo, strict=True)) for combo in itertools.product(*values.values())]


def least(values: dict[str, Iterable[str]], facts: ParameterFacts, step: StepFacts,
          context: int = 0) -> tuple[dict[str, str], Floor]:
    """The pool settings with the smallest bound among `values`' combinations that the plan's rules allow
    (runner/plan/memory_plan.py: no lossy state beside the host's optimizer, ...), and the bound."""
    plans = [(labels, pool_plan(labels)) for labels in settings(values)]
    allowed = [(labels, plan) for labels, plan in plans if not plan_problems(plan, step)] or plans
    floors = [(labels, pool_floor(plan, facts, step, context)) for labels, plan in allowed]
    return min(floors, key=lambda pair: pair[1].total)


def nothing_fits_line(space_values: dict[str, list[str]], every_value: dict[str, list[str]],
                      bound: Bound, open_lossy: str) -> str | None:
    """One line when no pool setting of the space leaves the plan under `limit`, naming the pool
    settings outside the space that would (and `open_lossy`, the flag that opens lossy ones), or the
    cap that would; None when some setting of the space may fit."""
    facts, step, context, limit = bound.facts, bound.step, bound.context, bound.limit
    labels, floor = least(space_values, facts, step, context)
    if floor.total <= limit:
        return None
    shown = ", ".join(f"{section} {label}" for section, label in labels.items()
                      if label != default_label(section))
    line = (f"every plan holds at least {floor.words()} before any activation, even with "
            f"{shown or 'the pools as they are'}: over the limit {format_bytes(limit)}")
    wider, wide_floor = least(every_value, facts, step, context)
    if wide_floor.total <= limit:
        opened = ", ".join(f"memory.{section} {label}" for section, label in wider.items()
                           if label not in space_values.get(section, []))
        return f"{line}; {opened} (at least {format_bytes(wide_floor.total)}) could fit: {open_lossy} searches them"
    lossy = ", ".join(f"memory.{section} {label}" for section, label in wider.items()
                      if label not in space_values.get(section, []))
    wider_words = f", or above {format_bytes(wide_floor.total)} with {lossy} ({open_lossy})" \
        if wide_floor.total < floor.total and lossy else ""
    return (f"{line}; no pool setting fits: a limit above {format_bytes(floor.total)}{wider_words}, or a smaller "
            "model")


def default_label(section: str) -> str:
    """The tuner label of a pool's default policy (`fp32`, `full`, `none`)."""
    return MemoryPlan.model_fields[section].default_factory().label()


@dataclass(frozen=True)
class Bound:
    """What the tuner's lower bound reads for one search: the model's parameters, the recipe's step
    facts, the card's CUDA context and the limit (the cap less its margin)."""

    facts: ParameterFacts
    step: StepFacts
    context: int
    limit: int

    def floor(self, candidate) -> Floor | None:
        """The candidate's bound; None under a strategy (the ranks shard what it counts whole)."""
        if candidate.strategy is not None:
            return None
        return pool_floor(candidate.plan, self.facts, replace(self.step, precision=candidate.precision), self.context)

    def over(self, candidate) -> Floor | None:
        """The candidate's bound where it is over the limit: no plan of its pool setting fits."""
        floor = self.floor(candidate)
        return floor if floor is not None and floor.total > self.limit else None
