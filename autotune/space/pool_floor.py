"""A lower bound on a plan's peak from what only the pools' policies change, without a fake step.

At the optimizer's step (or, where gradients leave early, throughout the backward) every parameter,
every gradient that is still on the device and the device's share of the optimizer state are alive
at once, whatever the activation knobs do: checkpointing, offload, micro-batching, compile and the
loss shrink only what comes on top. So from the model's parameter counts (the model child counts them
on the meta device: autotune/space/facts.py `ParameterFacts`) and a plan's weights, optimizer state,
optimizer step and optimizer offload, `pool_floor` says how many bytes the plan holds at least; the
CUDA context comes on top of that on a card. Each bound takes the pool's best case:

- parameters: as built, or 2 B an element where memory.weights holds them in bf16 or the optimizer
  offload holds bf16 copies of host masters (memory.optimizer_offload master: its best case, every
  parameter an nn.Linear's);
- gradients: the trainable parameters' bytes in the same dtype; none where the step runs in the
  backward, or where every gradient goes to the host as it is made (master); with the optimizer
  offloaded and every gradient final once accumulated (one micro-batch, no clipping), only the device's
  share (less the largest parameter: the offload splits between them);
- optimizer state: AdamW's two moments (ckrun's adamw only: another optimizer is taken to keep none),
  in the parameters' dtype or the low-bit policy's bytes without its scales, for the device's share.

The tuner rules out a plan whose bound is over the limit before predicting it (autotune/search/screening.py),
and when every plan of the space is, it says so at once with the knob or the cap that would change
that (`nothing_fits_line`). Under --nproc the ranks shard (FSDP) what this counts whole: no bound.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace

from ckrun.runner.choices import choice_class, choice_fields
from ckrun.runner.plan import MemoryPlan, StepFacts, gradients_final, plan_problems
from ckrun.runner.pool_policies import POOL_KINDS
from ckrun.runner.units import format_bytes

from .facts import ParameterFacts

MOMENTS = 2  # AdamW's first and second moment
BF16_BYTES = 2


@dataclass(frozen=True)
class Floor:
    """Bytes a plan holds at least, per pool, and the context on top (a card's)."""

    parameters: int
    gradients: int
    optimizer_state: int
    context: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.context

    def words(self) -> str:
        return (f"{format_bytes(self.total)} (parameters {format_bytes(self.parameters)}, gradients "
                f"{format_bytes(self.gradients)}, optimizer state {format_bytes(self.optimizer_state)}"
                + (f", CUDA context {format_bytes(self.context)}" if self.context else "") + ")")


def pool_floor(plan: MemoryPlan, facts: ParameterFacts, step: StepFacts, context: int = 0) -> Floor:
    """The fewest bytes `plan` can hold on the device (module docstring), the CUDA context added."""
    bf16 = plan.weights.holds_bf16 or plan.optimizer_offload.masters_on_host
    parameters = min(facts.bytes, BF16_BYTES * facts.count) if bf16 else facts.bytes
    gradients = min(facts.trainable_bytes, BF16_BYTES * facts.trainable) if bf16 else facts.trainable_bytes
    moment = plan.optimizer_state.moment_bytes()
    state = 0 if not step.adamw else int(MOMENTS * (gradients if moment is None else moment * facts.trainable))
    host = plan.optimizer_offload.host_fraction()
    largest = facts.largest / max(facts.trainable_bytes, 1)  # the largest parameter's share of them
    device_share = lambda total: max(0, int((1 - host - largest) * total)) if host else total  # noqa: E731
    if plan.optimizer_step.updates_in_backward or plan.optimizer_offload.masters_on_host:
        gradients = 0
    elif host and gradients_final(plan, step):
        gradients = device_share(gradients)
    return Floor(parameters, gradients, device_share(state), context)


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
    (runner/plan.py: no lossy state beside the host's optimizer, ...), and the bound."""
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
