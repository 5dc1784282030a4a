"""One point of the space, typed: the memory plan, its precision and (under --nproc) the strategy.

A candidate has one serialisation, `request()` / `from_request()`: how the tuner hands it to the
model child, which reads it back here and builds the candidate's recipe with the same `recipe()`
as the probe's. Its strategy goes into every file as `distributed_section` writes it, and comes
back through the recipe's schema. Light: the model child imports this, optuna stays out. How a
candidate reads in a log line is its knobs' to say (`ckrun.autotune.space.knobs.describe`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import TypeAdapter

from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.plan.strategies import Distributed, Strategy

_STRATEGY = TypeAdapter(Distributed)


def distributed_section(strategy: Strategy) -> dict:
    """The recipe's `distributed:` for `strategy`, as every tuner file writes it (a candidate's recipe,
    the model child's request, a trial's record, tuned.yaml); the recipe's schema reads it back."""
    return strategy.model_dump(mode="json", exclude_none=True)


@dataclass(frozen=True)
class Candidate:
    """One point of the space: the memory plan and the precision it runs in."""

    plan: MemoryPlan
    precision: str
    strategy: Strategy | None = None  # under --nproc, how the ranks share the work; None: one process, the recipe's

    @property
    def key(self) -> str:
        """Identical plans have identical keys: a repeated proposal reuses the earlier measurement. The
        strategy by its label (its other fields, tp's plan, are the recipe's: the same in one study),
        so the keys of studies started before hsdp and tp stay theirs."""
        ranks = {"distributed": self.strategy.label()} if self.strategy else {}
        return json.dumps({"memory": self.plan.model_dump(mode="json"), "precision": self.precision, **ranks},
                          sort_keys=True)

    def recipe(self, base: Recipe, cap_bytes: int | None) -> Recipe:
        """`base` running this candidate, validated as the probe's child validates it: a ValidationError
        says what the recipe's schema refuses (the one set of validity rules). max_mem makes the probe
        stop (CUDA: fail to allocate) at the cap."""
        data = base.model_dump(mode="json")
        data.update(memory={**self.plan.model_dump(mode="json"), "max_mem": cap_bytes}, precision=self.precision)
        if self.strategy:
            data["distributed"] = distributed_section(self.strategy)
        return Recipe.model_validate(data)

    def request(self) -> dict:
        """The candidate as JSON data for the model child (`from_request` reads it back)."""
        return {"plan": self.plan.model_dump(mode="json"), "precision": self.precision,
                "distributed": distributed_section(self.strategy) if self.strategy else None}

    @classmethod
    def from_request(cls, request: dict) -> Candidate:
        distributed = request.get("distributed")
        return cls(MemoryPlan.model_validate(request["plan"]), request["precision"],
                   _STRATEGY.validate_python(distributed) if distributed else None)
