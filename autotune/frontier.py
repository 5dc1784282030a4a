"""The solver's frontier for a tune: one per-block plan per micro-batch and precision, probed first.

The model child (which already holds the estimator, the model built once on fake tensors) runs
`autotune.solver.frontier`: per-block costs from the estimator and a short timed run (or, with
`timed_steps` 0, the estimator's predicted block times), then the solver. Its plans become points of the space (`Space.add_proposals`), so TPE explores around them.
They are computed once per study and kept in its user attributes: a resumed study gets the same
plans, hence the same choices, even though a new timed run could rank the blocks differently.
"""

from __future__ import annotations

import logging

import optuna

from runner.plan import MemoryPlan

from .cap import Cap
from .facts import Device
from .space import Space

log = logging.getLogger(__name__)

TIMED_STEPS = 1  # real steps (after a warm-up) that time each block's recompute: ranking, not benchmarking


def solver_points(study: optuna.Study, fresh: bool, space: Space, cap: Cap, device: Device, predictor,
                  off_reason: str | None = None, timed_steps: int | None = None) -> list[dict]:
    """The solver's plans as params of `space` (whose choices grow by their per-block labels).
    `timed_steps` 0: block times from the predictor's time model instead of a real run."""
    stored = study.user_attrs.get("solver")
    if fresh:
        stored = _solve(space, cap, device, predictor, off_reason, TIMED_STEPS if timed_steps is None else timed_steps)
        study.set_user_attr("solver", stored)
    elif stored is None:  # new choices now would clash with the distributions its trials were told with
        log.info("solver: --resume: the study started without the solver's plans, so it goes on without them")
        return []
    elif stored["proposals"]:
        log.info("solver: --resume: the %d plan(s) the study started with", len(stored["proposals"]))
    for line in stored["lines"]:
        log.info("solver: %s", line)
    points = space.add_proposals(stored["proposals"])
    if len(points) < len(stored["proposals"]):
        log.info("solver: %d plan(s) left out: they differ from a knob the space pins",
                 len(stored["proposals"]) - len(points))
    return points


def _solve(space: Space, cap: Cap, device: Device, predictor, off_reason: str | None, timed_steps: int) -> dict:
    if off_reason or predictor is None:
        return {"proposals": [], "lines": [f"off ({off_reason or 'no estimator'}): no per-block plans"]}
    precisions = space.choices.get("precision") or [space.fixed["precision"]]
    compile_ = space.choices.get("compile", [space.fixed.get("compile", False)])[0]
    request = {"pairs": [[m, p] for p in precisions for m in space.micro_batches()],
               # predictions leave out the CUDA context, which a card-level cap includes
               "limit": cap.limit - device.context_bytes, "offload": "offload" in space.choices,
               "timed_steps": timed_steps,
               "base": MemoryPlan(blocks=space.blocks_path, compile=compile_).model_dump(mode="json")}
    answer = predictor.frontier(request)
    if answer.get("status") != "ok":
        return {"proposals": [], "lines": [f"no per-block plans: {answer.get('reason', answer.get('status'))}"]}
    return {"proposals": answer["proposals"], "lines": answer["lines"]}
