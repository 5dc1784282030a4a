"""One search, whoever answers its probes: `ckrun tune` (real probes), `ckrun tune --predict`
(predictions in their place) and `bench/tune_oracle.py` (an oracle's fixed numbers) all run this.

The order: the solver's per-block plans (computed once per study, while the starting points are
chosen where a second pricer solves: autotune/probes/beside.py), the recipe's own plan and the known
starting points, TPE until the budget is spent, then the finalists measured again. What
answers a probe (`evaluate`), what predicts a plan (`predictor`: its peak, and its step time when it
knows the device) and how many re-runs settle the winner are the caller's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import optuna

from ..cap import Cap
from .frontier import solver_points
from ..records import TrialRecord, ranked_feasible
from ..space.facts import Device
from ..space.space import Space
from .study import Budget, Evaluate, trial_records
from .tuner import Tuner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchSettings:
    seed: int = 0
    finalists: int = 2  # plans measured again until each has FINALIST_RUNS runs; 0 for deterministic answers
    solver_off: str | None = None  # why the solver proposes nothing, or None
    timed_steps: int | None = None  # the solver's real block timing (None: its default; 0: predicted times)
    predicted: bool = False  # tune --predict: predictions answer the probes, and the log says so


def budget_line(records: list[TrialRecord], trials: int) -> str:
    """Which --trials pick the same winner, for a predicted search (answers that do not vary): its trials come
    in the same order whatever the budget (the starting points, predicted and ordered before the first,
    then the sampler seeded by --seed and the count so far), so a smaller budget runs a prefix of a larger
    one's. The winner found after K plans is every budget's from K on, until a later plan is predicted faster."""
    ranked = ranked_feasible(records)
    if not ranked:
        return f"no plan fits: --trials {trials} found none; a larger budget tries more plans"
    best = ranked[0]
    spent = sum(1 for r in records if r.number <= best.number and (r.probe_s is not None or r.predicted_s is not None)
                and r.duplicate_of is None and r.repeat_of is None)
    return (f"the winner, trial {best.number}, came after {spent} predicted plan(s): with this --seed every --trials "
            f"from {spent} to {trials} picks it (trials run in the same order whatever the budget); a larger budget "
            "changes it only where a later plan is predicted faster")


def search(study: optuna.Study, fresh: bool, recipe, space: Space, cap: Cap, device: Device, budget: Budget,
           evaluate: Evaluate, predictor=None, settings: SearchSettings = SearchSettings()) -> list[TrialRecord]:
    """Run the search on `study` and return every trial as a record (`study.trial_records`)."""
    off = settings.solver_off or (None if predictor is not None else "no predictions")
    if not fresh and not study.trials:  # killed before its first trial (the starting points were being chosen)
        log.info("tune: --resume: the study has no trial yet, so it starts as a new one")
        fresh = True
    solved = solver_points(study, fresh, space, cap, device, predictor, off, settings.timed_steps, budget)
    if not fresh:
        solved()  # the plans the study started with: their per-block labels join the space's choices
    tuner = Tuner(study, space, cap, evaluate, predictor, settings.seed, settings.predicted)
    if fresh:
        tuner.start(recipe, solved, budget.trials, budget)
    else:
        log.info("tune: --resume: %d trials already in the study are kept, not run again", len(study.trials))
    stopped = tuner.run(budget)
    tuner.confirm(settings.finalists, budget)
    if settings.predicted and fresh and not tuner.exhaustive:
        log.info("tune: %s", budget_line(trial_records(study), budget.trials))
    if settings.predicted and "time budget" in stopped:
        ranked = ranked_feasible(trial_records(study))
        log.info("tune: %s", f"the answer is the best plan predicted to fit when the time budget ran out: trial "
                             f"{ranked[0].number} ({ranked[0].label}); more time prices more plans" if ranked else
                 "the time budget ran out before any plan was predicted to fit")
    spent = time.monotonic() - budget.started
    over = budget.time_s is not None and spent > budget.time_s
    log.log(logging.WARNING if over or tuner.probes < 2 else logging.INFO, "tune: searched for %.0f s%s, %d plans %s%s",
            spent, f" of --time-budget {budget.time_s:g} s" if budget.time_s else "", tuner.probes,
            "predicted" if settings.predicted else "measured",
            f" (over the budget by {spent - budget.time_s:.0f} s: see the lines above)" if over else "")
    return trial_records(study)
