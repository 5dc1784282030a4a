"""Per-block plans from a solver: for one micro-batch and precision, which blocks keep their
activations, which recompute them and which offload them, for the least predicted step time under
the cap.

The costs are `ckrun.runner.predict.block_costs.CostTable`: per block the bytes each choice leaves for
backward and the seconds it adds. A plan's predicted peak is the bytes no choice changes plus the
blocks' bytes; and in backward, a block that recomputes (or fetches back) holds all of its
activations again on top of the bytes of the blocks before it. So the solver is an exact dynamic
programme over the blocks in order, its state the bytes the blocks so far leave (in units of
about 1/2048 of the budget, rounded up): a knapsack whose items are the blocks, with that side
condition checked at each block. States dominated by one with fewer bytes and no more time are
dropped, which keeps it exact and small.

The model of the peak is approximate (gradients and temporaries move the real peak), so each plan
is checked with the estimator and, while it is predicted over, solved again with the budget cut
by the excess. The plan is written with the fields a recipe already has (`checkpointing: {policy:
layers}`, `offload: {policy: layers}`), so tuned.yaml reads like a hand-written plan.

What a block may be given is no list of the solver's: it is every `block_action` the plan's policy
types declare (runner/plan/policies.py; keep, recompute, selective, offload today), each written back by
the classes that say they can (`on_blocks`). An action some class writes for any set of blocks is a
per-block choice (one per plan field: a plan holds one checkpointing policy); an action that can
only cover every block (selective) is the whole-model alternative to the per-block plan.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckrun.runner.memory.blocks import short_list
from ckrun.runner.plan.memory_plan import POLICY_FIELDS, FullCheckpointing, MemoryPlan, Policy
from ckrun.runner.predict.block_costs import CostTable
from ckrun.runner.units import format_bytes

log = logging.getLogger(__name__)

RESOLUTION = 2048  # byte units per budget: finer costs more states, coarser wastes up to 1/RESOLUTION per block
REFITS = 6  # solves per plan while the estimator puts the solution over the limit


@dataclass(frozen=True)
class Option:
    """One choice for one block, in integer byte units and seconds."""

    choice: str  # keep, or an Action's name: recompute | selective | offload
    saved: int  # units the block leaves for backward
    seconds: float  # what the choice adds to a step
    transient: int = 0  # units the block holds again in backward (recompute, fetch), on top of the earlier blocks'


def solve(blocks: list[list[Option]], budget: int) -> tuple[float, list[int]] | None:
    """(least total seconds, the option index per block) with the saved units at most `budget` and,
    at every block, the earlier blocks' units plus its transient at most `budget`; None if no choice
    fits. Ties go to fewer units, then to the lexicographically smallest choice list."""
    states: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}  # units so far -> (seconds, picks)
    for options in blocks:
        following: dict[int, tuple[float, tuple[int, ...]]] = {}
        for units, (seconds, picks) in states.items():
            for index, option in enumerate(options):
                total = units + option.saved
                if total > budget or units + option.transient > budget:
                    continue
                candidate = (seconds + option.seconds, (*picks, index))
                if total not in following or candidate < following[total]:
                    following[total] = candidate
        states = _pareto(following)
        if not states:
            return None
    units = min(states, key=lambda u: (states[u][0], u, states[u][1]))
    return states[units][0], list(states[units][1])


def _pareto(states: dict[int, tuple[float, tuple[int, ...]]]) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Only states faster than every state with fewer units: more units never make a later block fit."""
    kept, best = {}, None
    for units in sorted(states):
        if best is None or states[units] < best:
            kept[units], best = states[units], states[units]
    return kept


# --- from a cost table to a plan ------------------------------------------------------------------


@dataclass(frozen=True)
class Proposal:
    plan: MemoryPlan
    precision: str
    predicted_peak: int
    added_s: float
    """Seconds per step the recomputes and copies add, by the cost table."""
    reason: str

    def record(self) -> dict:
        return {"plan": self.plan.model_dump(mode="json"), "precision": self.precision,
                "predicted_peak": self.predicted_peak, "added_s": self.added_s, "reason": self.reason}


KEEP = "keep"  # no action: the block keeps its activations (each field's `on_blocks` of no block)


@dataclass(frozen=True)
class Action:
    """One thing the solver may do to a block: a `block_action` of the policy types of one plan field."""

    name: str  # the cost table's column: recompute | selective | offload
    field: str  # the plan field it is written to: checkpointing | offload
    writers: tuple[type[Policy], ...]  # the field's classes that do it, in union order

    @property
    def recomputes(self) -> bool:
        return any(getattr(cls, "recomputes", False) for cls in self.writers)

    @property
    def moves(self) -> bool:
        return any(getattr(cls, "moves", False) for cls in self.writers)

    def written(self, chosen: list[int], count: int) -> dict | None:
        """The field's recipe data for this action on exactly `chosen`, by the first class that can say it."""
        return next((fields for cls in self.writers if (fields := cls.on_blocks(chosen, count)) is not None), None)

    @property
    def per_block(self) -> bool:
        """Some class writes it for one block and not another; else it can only cover every block."""
        return self.written([0], 2) is not None


def actions(offload: bool = True) -> list[Action]:
    """Every action the plan's policy types declare, in field and union order (offload's only with
    `offload`: moving activations to the host needs CUDA)."""
    found = []
    for field, classes in POLICY_FIELDS.items():
        names = dict.fromkeys(cls.block_action for cls in classes if cls.block_action not in (None, KEEP))
        found += [Action(name, field, tuple(cls for cls in classes if cls.block_action == name)) for name in names]
    return [action for action in found if offload or not action.moves]


def block_options(table: CostTable, unit: int, chosen: list[Action]) -> list[list[Option]]:
    """Each block's options in units of `unit` bytes (rounded up: the solution never under-counts):
    keep, then each of `chosen` that the table has costs for and that leaves fewer bytes than keeping."""
    up = lambda n: math.ceil(max(0, n) / unit)  # noqa: E731
    blocks, earlier = [], 0  # earlier: what the blocks before this one save when all are recomputed
    for cost in table.blocks:
        options = [Option(KEEP, up(cost.keep_bytes), 0.0)]
        for action in chosen:
            saved, seconds = cost.of(action.name)
            if saved is None or (action.moves and saved >= cost.keep_bytes):
                continue  # no cost measured for it here, or nothing to move
            held = _recompute_transient(table, cost, earlier) if action.recomputes else cost.keep_bytes
            options.append(Option(action.name, up(saved), _seconds(seconds), up(held)))
        earlier += cost.recompute_bytes
        blocks.append(options)
    return blocks


def _recompute_transient(table: CostTable, cost, earlier: int) -> int:
    """What recomputing the block holds in backward beyond base_bytes and the earlier blocks' savings.

    Its activations (keep_bytes) on top of base_bytes overstates it whenever base_bytes is the
    head's and loss's memory, gone by the time the blocks recompute: a language model's logits
    then made every recompute look over a limit that full checkpointing meets. The full plan's own
    peak bounds it instead: with every block recomputed, the earlier blocks' savings plus this
    block's recompute stayed within full_peak, and any other plan only changes those savings. The
    smaller of the two is used; the estimator checks every solution anyway (`_per_block`)."""
    return min(cost.keep_bytes, max(0, table.full_peak - table.base_bytes - earlier))


def _seconds(measured: float | None) -> float:
    return 1.0 if measured is None else measured  # untimed: fewest recomputes wins


def plan_for(choices: list[str], base: MemoryPlan) -> MemoryPlan:
    """`base` with per-block choices (keep or an action's name) written as the recipe's own fields."""
    count, update, known = len(choices), {}, actions()
    for field, classes in POLICY_FIELDS.items():
        if not any(action.field == field for action in known):
            continue  # no block action lives in this field (compression): the base's stays
        found = [action for action in known if action.field == field and action.name in choices]
        if len(found) > 1:
            raise ValueError(f"{field}: one plan cannot hold both {found[0].name} and {found[1].name}")
        chosen = [i for i, choice in enumerate(choices) if found and choice == found[0].name]
        keep = next(cls.on_blocks([], count) for cls in classes if cls.block_action == KEEP)
        data = found[0].written(chosen, count) if found else keep
        update[field] = getattr(MemoryPlan.model_validate({field: data}), field)
    return base.model_copy(update=update)


def propose(table: CostTable, limit: int, predict: Callable[[MemoryPlan], int], base: MemoryPlan,
            offload: bool = False, context: int = 0) -> Proposal | None:
    """The fastest plan the estimator puts at or under `limit`, or None: the solver's per-block plan,
    or an action that only covers every block (selective checkpointing) where the costs say that is
    faster and it fits."""
    possible = actions(offload)
    proposal = _per_block(table, limit, predict, base, [action for action in possible if action.per_block], context)
    for action in possible:
        if not action.per_block:
            proposal = _every_block_under(action, table, limit, predict, base, proposal, context)
    return proposal


def _per_block(table: CostTable, limit: int, predict: Callable[[MemoryPlan], int], base: MemoryPlan,
               per_block: list[Action], context: int = 0) -> Proposal | None:
    """The fastest solution over each pairing of per-block actions (one per plan field), else every
    block recomputed where that is known to fit."""
    fields = {}
    for action in per_block:
        fields.setdefault(action.field, []).append(action)
    solved = [_solved(table, limit, predict, base, list(pairing), context)
              for pairing in itertools.product(*fields.values())]
    solved = [proposal for proposal in solved if proposal is not None]
    return min(solved, key=lambda p: p.added_s) if solved else _every_block(table, limit, base, context)


def _solved(table: CostTable, limit: int, predict: Callable[[MemoryPlan], int], base: MemoryPlan,
            chosen: list[Action], context: int = 0) -> Proposal | None:
    budget = limit - table.base_bytes
    for _ in range(REFITS):
        if budget <= 0:
            break
        unit = max(1, math.ceil(budget / RESOLUTION))
        options = block_options(table, unit, chosen)
        solved = solve(options, budget // unit)
        if solved is None:
            break
        seconds, picks = solved
        choices = [options[i][pick].choice for i, pick in enumerate(picks)]
        plan = plan_for(choices, base)
        peak = predict(plan)
        if peak <= limit:
            return Proposal(plan, table.precision, peak, seconds, _reason(table, choices, seconds, peak, limit, context))
        budget -= peak - limit + unit  # the model of the peak was short by this much: ask for less
    return None


def _every_block(table: CostTable, limit: int, base: MemoryPlan, context: int = 0) -> Proposal | None:
    """Every block recomputed, when the estimator put that under the limit: the programme's rounding
    (units rounded up) or its additive model can miss the one plan that is known to fit."""
    if table.full_peak > limit:
        return None
    choices = [FullCheckpointing.block_action] * len(table.blocks)
    seconds = sum(_seconds(cost.of(FullCheckpointing.block_action)[1]) for cost in table.blocks)
    return Proposal(plan_for(choices, base), table.precision, table.full_peak, seconds,
                    _reason(table, choices, seconds, table.full_peak, limit, context))


def _every_block_under(action: Action, table: CostTable, limit: int, predict: Callable[[MemoryPlan], int],
                       base: MemoryPlan, best: Proposal | None, context: int = 0) -> Proposal | None:
    """`action` on every block in place of `best`, where the costs say it is faster and it fits."""
    costs = [cost.of(action.name) for cost in table.blocks]
    seconds = sum(_seconds(s) for _, s in costs)
    if best is not None and seconds >= best.added_s or any(saved is None for saved, _ in costs):
        return best
    plan = plan_for([action.name] * len(table.blocks), base)
    peak = predict(plan)
    if peak > limit:
        return best
    return Proposal(plan, table.precision, peak, seconds,
                    f"micro_batch {table.micro_batch}, {table.precision}: {getattr(plan, action.field).label()} "
                    f"{action.field} of every block (+{1000 * seconds:.1f} ms a step by the costs, less than the "
                    f"per-block plan's); {_within(peak, limit, context)}")


def _reason(table: CostTable, choices: list[str], seconds: float, peak: int, limit: int, context: int = 0) -> str:
    acted = [action for action in actions() if action.name in choices]
    picked = {action.name: [i for i, x in enumerate(choices) if x == action.name] for action in acted}
    what = "; ".join(f"{name} blocks {short_list(v)}" for name, v in picked.items()) or "keep every block"
    recomputed = sum(len(picked[action.name]) for action in acted if action.recomputes)
    return (f"micro_batch {table.micro_batch}, {table.precision}: {what} ({recomputed} of "
            f"{len(choices)} recomputed, +{1000 * seconds:.1f} ms a step by the costs); {_within(peak, limit, context)}")


def _within(peak: int, limit: int, context: int) -> str:
    """A predicted peak against the limit, in the numbers the tune's header uses: a card-level cap counts
    the CUDA context, which the estimator's peaks leave out."""
    if not context:
        return f"predicted {format_bytes(peak)} <= limit {format_bytes(limit)}"
    return (f"predicted {format_bytes(peak + context)} (the CUDA context's {format_bytes(context)} included) <= "
            f"limit {format_bytes(limit + context)}")


# --- the frontier: one proposal per micro-batch and precision ---------------------------------------


def frontier(estimator, pairs: list[tuple[int, str]], limit: int, base: MemoryPlan, offload: bool = False,
             timed_steps: int = 1, context: int = 0, seconds: float | None = None) -> tuple[list[Proposal], list[str]]:
    """The solver's plan for each (micro_batch, precision) that needs one, with a line per decision.

    Per precision the micro-batches go from the largest down and stop at the first where keeping
    every block is predicted to fit (smaller ones only run slower); a pair where even recomputing
    every block is predicted over the limit (and no offload) gets no plan. `limit` is for the
    estimator's peaks, which leave out the `context` a card-level cap counts: the lines add it back.
    With `seconds`, pairs not reached within them get no plan (a --time-budget's share), and the
    micro-batches start at `base`'s (the recipe's own; those above it come last): a large model's
    estimates take long, and the recipe's micro-batch is the likeliest to fit."""
    deadline = None if seconds is None else time.monotonic() + seconds
    estimator = _Deadlined(estimator, deadline) if deadline is not None else estimator
    proposals, lines = [], []
    try:
        _solve_pairs(estimator, pairs, limit, base, offload, timed_steps, seconds, deadline, context, proposals, lines)
    except _OutOfTime:
        lines.append(f"stopped mid-way: its {seconds:.0f} s were spent (a large model's estimates take long); the "
                     "micro-batches not solved get no plan")
    return proposals, lines


def answer_request(estimator, request: dict) -> dict:
    """`frontier` asked as the tuner asks it (autotune/search/frontier.py `_solve`: JSON, its deadline on the
    machine's monotonic clock), answered as the tuner reads it. Where the plans do not apply, ValueError."""
    deadline = request.get("deadline")
    proposals, lines = frontier(estimator, [tuple(pair) for pair in request["pairs"]], int(request["limit"]),
                                MemoryPlan.model_validate(request["base"]), bool(request["offload"]),
                                int(request["timed_steps"]), int(request.get("context", 0)),
                                None if deadline is None else deadline - time.monotonic())
    return {"status": "ok", "proposals": [p.record() for p in proposals], "lines": lines}


class _OutOfTime(Exception):
    pass


class _Deadlined:
    """The estimator, whose every estimate (and cost table's block bytes) past `deadline` raises _OutOfTime: a
    large model's cost table is many estimates, and the solver's share of the time ends between any two of
    them. A composer's estimate that needs a new trace (`ready` says not) is not started when less time is
    left than its traces take (`trace_s`): a trace in flight cannot be stopped, and one started near the
    deadline ran past it (an 8B's solver took 46 s of its 30)."""

    def __init__(self, estimator, deadline: float):
        self._estimator, self._deadline = estimator, deadline

    def estimate(self, plan, precision=None, *args, **kwargs):
        self._in_time(plan, precision)
        return self._estimator.estimate(plan, precision, *args, **kwargs)

    def _in_time(self, plan, precision) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _OutOfTime()
        ready, expected = getattr(self._estimator, "ready", None), getattr(self._estimator, "trace_s", None)
        if ready is not None and expected is not None and left < expected() and not ready(plan, precision):
            raise _OutOfTime()

    def __getattr__(self, name):
        found = getattr(self._estimator, name)
        if name == "block_bytes":  # the cost table's estimates (runner/predict/block_costs.py)
            def block_bytes(plan, precision):
                self._in_time(plan, precision)
                return found(plan, precision)
            return block_bytes
        return found


def _solve_pairs(estimator, pairs, limit, base, offload, timed_steps, seconds, deadline, context, proposals,
                 lines) -> None:
    """`frontier`'s loop: its proposals and lines appended as they come (so a stop keeps those made)."""
    from ckrun.runner.predict.block_costs import cost_table

    show = lambda n: format_bytes(n + context)  # noqa: E731
    for precision in dict.fromkeys(p for _, p in pairs):
        for micro in _micro_order([m for m, p in pairs if p == precision], base.micro_batch, seconds is not None):
            if deadline is not None and time.monotonic() > deadline:
                lines.append(f"micro_batch {micro}, {precision} and below: not solved, the time budget's share "
                             f"before the first probe ({seconds:.0f} s left when the solver started) is spent")
                break
            at = base.model_copy(update={"micro_batch": micro})
            predict = lambda plan, precision=precision: estimator.estimate(plan, precision).peak_bytes  # noqa: E731
            kept = predict(at.model_copy(update={"checkpointing": MemoryPlan().checkpointing}))
            if kept <= limit:
                lines.append(f"micro_batch {micro}, {precision}: keeping every block is predicted to fit "
                             f"({show(kept)}); no solver plan needed here or below")
                break
            table = cost_table(estimator, micro, precision, timed_steps, pools=at)  # the base's pools priced in
            if table.full_peak > limit and not offload:
                lines.append(f"micro_batch {micro}, {precision}: even recomputing every block is predicted over "
                             f"the limit ({show(table.full_peak)}); no plan")
                continue
            proposal = propose(table, limit, predict, at, offload, context)
            if proposal is None:
                lines.append(f"micro_batch {micro}, {precision}: the solver found no plan the estimator puts "
                             f"under {show(limit)}")
                continue
            proposals.append(proposal)
            lines.append(proposal.reason)


def _micro_order(micro_batches: list[int], own: int | None, hurried: bool) -> list[int]:
    """Largest first; `hurried` (a deadline), from the recipe's own micro-batch down, then those above it."""
    ordered = sorted(micro_batches, reverse=True)
    if not hurried or own is None or own not in ordered:
        return ordered
    return [m for m in ordered if m <= own] + [m for m in ordered if m > own]
