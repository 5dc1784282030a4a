"""Why a candidate cannot run, said before anything is probed: such a plan is told infeasible and
never run. Every rule is asked of its owner, never written again here: the recipe's schema (a
candidate's recipe validated as the probe's child validates it), the check every rank makes before
it starts (ckrun.runner.parallel.ranks.check_world: the strategy lays out the ranks, the batch and the
micro-batch split over its data-parallel groups), and what the memory layer applies on this device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from ckrun.runner.memory.apply import check_combination
from ckrun.runner.parallel.ranks import check_world
from ckrun.runner.problems import InputError, KeyedError

from .candidate import Candidate

if TYPE_CHECKING:
    from .space import Space


def invalid_reason(candidate: Candidate, space: Space) -> str | None:
    """Why `candidate` cannot run, said before anything is probed (it is told infeasible, never run):
    what the recipe's schema refuses (ckrun.runner.plan.memory_plan.plan_problems; fsdp with fp16 or with segments that
    span blocks), what the ranks refuse (the strategy's layout, a micro-batch that does not divide a
    rank's share), the rules the probe's child would meet, then what this device or torch lacks."""
    if space.base is not None:
        try:
            recipe = candidate.recipe(space.base, None)
        except ValidationError as err:
            return _refusal(err)
        refused = _ranks_refusal(recipe, candidate, space.world_size)
        if refused:
            return refused
    try:
        check_combination(candidate.plan, torch.device(space.device_kind))
    except ValueError as err:
        return str(err)
    return None


def _ranks_refusal(recipe, candidate: Candidate, world_size: int) -> str | None:
    """What N ranks refuse, asked of the check every rank makes before it starts: the strategy's
    layout of the ranks, the batch over its data-parallel groups, the micro-batch in a group's share."""
    if candidate.strategy is None or world_size == 1:
        return None
    try:
        check_world(recipe, world_size)
    except InputError as err:
        first = err.problems[0]
        return f"{first.key}: {first.message}"
    return None


def _refusal(err: ValidationError) -> str:
    """The schema's first refusal as one line, `key: what to do`."""
    first = err.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, KeyedError):
        return f"{cause.key}: {cause.message}"
    return f"{'.'.join(map(str, first['loc']))}: {first['msg']}"
