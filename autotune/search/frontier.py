"""The solver's frontier for a tune: one per-block plan per micro-batch and precision, probed first.

The model child (which already holds the estimator, the model built once on fake tensors) runs
`ckrun.autotune.search.solver.frontier`: per-block costs from the estimator and a short timed run (or, with
`timed_steps` 0, the estimator's predicted block times), then the solver. Its plans become points of the space (`Space.add_proposals`), so TPE explores around them.
They are computed once per study and kept in its user attributes: a resumed study gets the same
plans, hence the same choices, even though a new timed run could rank the blocks differently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import optuna

from ..space.pool_floor import pool_plan
from ..space.pool_knobs import start_settings
from ..cap import Cap
from ..space.facts import Device
from ..space.space import Space
from .study import PRE_PROBE_SHARE, Budget

log = logging.getLogger(__name__)

TIMED_BUDGET_S = 600.0  # a --time-budget under this predicts block times instead of timing them
PREDICTED_SOLVER_S = 15.0  # the most a solver on predicted block times gets: the starting points and TPE need the rest
# (its costs come from traced parts: an 8B's cost table of its first micro-batch is four traces, 7 s on a core, and each
# solution that offloads another set of blocks one more; at 30 s it held half of the 60 s an 8B's tune is to answer in)
TIMED_STEPS = 1  # real steps (after a warm-up) that time each block's recompute: ranking, not benchmarking


def solver_points(study: optuna.Study, fresh: bool, space: Space, cap: Cap, device: Device, predictor,
                  off_reason: str | None = None, timed_steps: int | None = None,
                  budget: Budget | None = None) -> Callable[[], list[dict]]:
    """The solver started: a function that gives its plans as params of `space` (whose choices grow by their
    per-block labels) once it has answered (a predictor with a second pricer solves there meanwhile:
    autotune/probes/beside.py). `timed_steps` 0: block times from the predictor's time model instead of a
    real run. Under a time budget the solver gets what is left of its share before the first probe, and
    under TIMED_BUDGET_S it predicts the block times instead of timing them (that run costs a probe's time)."""
    stored = study.user_attrs.get("solver")
    if fresh:
        timed_steps = TIMED_STEPS if timed_steps is None else timed_steps
        seconds = budget.before_probes_left() if budget is not None else None
        if timed_steps == 0 and predictor is not None and not off_reason and (seconds is None or
                                                                             seconds > PREDICTED_SOLVER_S):
            seconds = PREDICTED_SOLVER_S
            log.info("solver: block times predicted; it gets %g s (a large model's estimates take seconds each, and "
                     "the solver runs several per micro-batch): micro-batches not reached by then get no plan",
                     seconds)
        if seconds is not None and seconds <= 0:
            off_reason = off_reason or (f"the {PRE_PROBE_SHARE:.0%} of --time-budget {budget.time_s:g} s that may "
                                        f"pass before the first probe is spent")
        elif seconds is not None and timed_steps and budget.time_s < TIMED_BUDGET_S:
            log.info("solver: block times predicted, not timed: --time-budget %g s is under %g s, and timing the "
                     "blocks takes about a probe", budget.time_s, TIMED_BUDGET_S)
            timed_steps = 0
        solving = _solve(space, cap, device, predictor, off_reason, timed_steps, seconds)

        def solved() -> list[dict]:
            answer = solving()
            study.set_user_attr("solver", answer)
            return _points(space, answer)
        return solved
    if stored is None:  # new choices now would clash with the distributions its trials were told with
        log.info("solver: --resume: the study started without the solver's plans, so it goes on without them")
        return list
    if stored["proposals"]:
        log.info("solver: --resume: the %d plan(s) the study started with", len(stored["proposals"]))
    return lambda: _points(space, stored)


def _points(space: Space, stored: dict) -> list[dict]:
    """The stored answer's plans as points of `space`, its lines logged."""
    for line in stored["lines"]:
        log.info("solver: %s", line)
    points = space.add_proposals(stored["proposals"])
    if len(points) < len(stored["proposals"]):
        log.info("solver: %d plan(s) left out: they differ from a knob the space pins",
                 len(stored["proposals"]) - len(points))
    return points


def start_solving(predictor, request: dict) -> Callable[[], dict]:
    """The solver's `request` started: a function that answers it. A predictor that can solve beside the search
    (`frontier_later`: autotune/probes/beside.py) goes on meanwhile; any other solves now."""
    later = getattr(predictor, "frontier_later", None)
    if later is not None:
        return later(request)
    answer = predictor.frontier(request)
    return lambda: answer


def _solve(space: Space, cap: Cap, device: Device, predictor, off_reason: str | None, timed_steps: int,
           seconds: float | None = None) -> Callable[[], dict]:
    if off_reason or predictor is None:
        off = {"proposals": [], "lines": [f"off ({off_reason or 'no estimator'}): no per-block plans"]}
        return lambda: off
    precisions = space.choices.get("precision") or [space.fixed["precision"]]
    compile_ = space.choices.get("compile", [space.fixed.get("compile", False)])[0]
    request = {"pairs": [[m, p] for p in precisions for m in space.micro_batches()],
               # predictions leave out the CUDA context, which a card-level cap includes
               "limit": cap.limit - device.context_bytes, "offload": "offload" in space.choices,
               "timed_steps": timed_steps, "context": device.context_bytes,
               # the blocks are planned on top of the pools' setting the starting points take: the base bytes it lowers
               "base": pool_plan(start_settings(space)).model_copy(
                   update={"blocks": space.blocks_path, "compile": compile_,  # the recipe's micro-batch: solved first
                           "micro_batch": space.base.memory.micro_batch if space.base else None}).model_dump(mode="json"),
               # monotonic time is the machine's: the child stops there, its estimator's warm-up counted
               "deadline": None if seconds is None else time.monotonic() + seconds}
    answered = start_solving(predictor, request)

    def stored() -> dict:
        answer = answered()
        if answer.get("status") != "ok":
            return {"proposals": [], "lines": [f"no per-block plans: {answer.get('reason', answer.get('status'))}"]}
        return {"proposals": answer["proposals"], "lines": answer["lines"]}
    return stored
