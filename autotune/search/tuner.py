"""The tuner: asks TPE for plans, evaluates each new one once (a probe, or screened by its
prediction) and tells optuna.

Every evaluated trial is told to optuna as COMPLETE with its throughput as the value and one
constraint, `(peak - limit) / cap`, positive when the plan does not fit, set with
`Trial.set_constraint` (optuna 5 deprecates TPESampler's `constraints_func` for it; TPE reads both
the same way). An out-of-memory, a crash or a timeout is such an infeasible trial too: TPE learns
from it to stay away, where a FAILed trial would teach it nothing. Plans predicted far over the
cap are told the same way without a probe. After the search, the fastest plans are measured
again (`confirm`) and ranked by the median of their runs.

Determinism: the sampler is re-seeded before each proposal from (seed, proposals so far), so the
same seed proposes the same sequence in one run, and again after a kill and `--resume`.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, Trial, TrialState

from ckrun.runner.units import format_bytes

from ..cap import Cap
from ..records import ProbeResult, TrialRecord, ranked_feasible, read_record, store_record
from ..space.candidate import Candidate
from ..space.knobs import describe
from ..space.space import Space
from ..space.validity import invalid_reason
from .descent import Descent
from .screening import Screening
from .study import PRE_PROBE_SHARE, Budget, Evaluate, Predict, trial_records

log = logging.getLogger(__name__)

STARTUP_TRIALS = 5  # trials (starting points included) before TPE models the space instead of drawing at random
CONVERGED_AFTER = 10  # proposals in a row of already-measured plans that end the search
FINALIST_RUNS = 3  # runs of each finalist: the median of three ignores one outlier, of two it is the mean
UNMEASURED = 1.0  # the constraint of a plan that never reported a peak: as bad as a plan twice the cap
START_SHARE = 0.75  # the starting points' predictions stop once this share of --time-budget has passed
UPFRONT_MAX = 64  # spaces up to this size are predicted whole before the search (the model is built once)


class Tuner:
    """Asks TPE for plans, evaluates each new one once (probe, or screen by prediction) and tells
    optuna; a plan proposed again reuses its measurement instead of being probed twice."""

    def __init__(self, study: optuna.Study, space: Space, cap: Cap, evaluate: Evaluate,
                 predict: Predict | None = None, seed: int = 0, predicted: bool = False):
        self.study, self.space, self.cap, self.seed = study, space, cap, seed
        self.predicted_search = predicted  # tune --predict: predictions answer, and the log never says "probing"
        self.doing = "predicting" if predicted else "probing"
        self.evaluate, self.predict = evaluate, predict
        self.screening = Screening(space, cap, predict)  # each plan predicted once, its answer kept
        self.first_of: dict[str, FrozenTrial] = {}  # plan key -> the trial that evaluated it
        # tune --predict: the walks from the plans priced so far (a resumed study's included)
        self.descent = Descent(space, cap.limit) if predicted else None
        for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            record = read_record(trial)
            if record.duplicate_of is None and record.repeat_of is None:
                self.first_of.setdefault(record.key, trial)
                if self.descent is not None:
                    self.descent.add(trial.number, trial.params, record)
        self.duplicates_in_a_row = 0
        # tune --predict: each new plan's prediction in wall seconds, by whether its parts were traced before it
        self.predicting_s: dict[bool, list[float]] = {True: [], False: []}
        self.budget: Budget | None = None  # set by start(): bounds the predictions before the first probe
        self.priced_first: list = []  # candidates the starting points' choice predicted (each becomes a trial)
        self.origins: list[dict] = []  # points predicted whose neighbours are not yet looked at (`_price_ready`)
        self.exhaustive = False  # set by start() when it queued every plan of a small space
        self.starts_cut = False  # the starting points' predictions stopped at START_SHARE of the budget

    def start(self, recipe, first: Callable[[], list[dict]] | list[dict] | None = None, trials: int | None = None,
              budget: Budget | None = None) -> None:
        """Queue `first` (the solver's plans: a list, or a function that waits for them, called once the
        starting points are chosen), the recipe's own plan, then the starting points; with
        predictions, each at the largest micro-batch predicted to fit, the predicted fastest first.
        A small space is predicted whole, and searched exhaustively when no more plans are predicted
        to fit than `trials` allows. Under a time budget, that whole-space prediction stops when the
        share before the first probe is spent (`Budget.before_probes_left`); the starting points
        (a few predictions, each a fraction of a probe) are always predicted: a probe of a plan far
        over the cap would cost more."""
        self.budget = budget
        own = self._own_plan(recipe)
        fits = self._start_fits if self.predict else None
        starts = [p for p in self.space.starting_points(recipe, fits) if p not in own]
        first = list((first() if callable(first) else first) or [])
        for params in first:
            self.study.enqueue_trial(params, user_attrs={"proposed_by": "solver"})
        if first:
            log.info("tune: %s the solver's %d plan(s) first: %s", self.doing, len(first),
                     "; ".join(describe(self.space.candidate(p)) for p in first))
        own = [p for p in own if p not in first]
        if own:
            log.info("tune: the recipe's own plan first: %s", describe(self.space.candidate(own[0])))
        starts = self._fastest_first([p for p in starts if p not in first + own])
        for params in own + starts:
            self.study.enqueue_trial(params)
        if self.predicted_search:
            self._keep_priced(first + own + starts)
        predicted = any(peak is not None for peak in self.screening.peaks.values())
        how = "the largest micro-batch predicted to fit" if predicted else "the whole batch (no predictions)"
        if "micro_batch" not in self.space.choices:
            how = f"the pinned micro-batch {self.space.fixed['micro_batch']}"
        if self.starts_cut:
            how += " (past the starting points' share of --time-budget, unpredicted ones at the smallest)"
        if self.screening.times:
            how += ", the predicted fastest first"
        log.info("tune: trying %d known starting points first, at %s: %s", len(starts), how,
                 "; ".join(describe(self.space.candidate(p)) for p in starts))
        if trials is not None and self.predict is not None:
            self._maybe_exhaustive(trials)

    def _keep_priced(self, queued: list[dict]) -> None:
        """tune --predict: every plan the starting points' choice predicted is a trial too (after them), so
        none that was predicted to fit is lost, whatever the budget (its trial costs no second prediction)."""
        kept = 0
        for candidate in self.priced_first:
            params = self.space.point_of(candidate)
            if params is not None and params not in queued:
                self.study.enqueue_trial(params, skip_if_exists=True)
                queued.append(params)
                kept += 1
        if kept:
            log.info("tune: %d more plan(s) predicted while choosing the starting points are trials too", kept)

    def _own_plan(self, recipe) -> list[dict]:
        """The recipe's own memory plan (a hand-written one, or a tuned.yaml from `tune --predict`),
        unless it is predicted not to fit."""
        point = self.space.own_point(recipe)
        own = [point] if point is not None else []
        return [p for p in own if not self.predict or self.screening.fits(self.space.candidate(p))]

    def _fastest_first(self, starts: list[dict]) -> list[dict]:
        """Starting points in order of predicted step time, when there are predicted times (past the starting
        points' share of the budget, only those already predicted: the rest follow, unpredicted)."""
        seconds = {json.dumps(p, sort_keys=True): self.screening.time_of(self.space.candidate(p).key) if self.starts_cut
                   else self.screening.seconds(self.space.candidate(p)) for p in starts}
        if not any(v is not None for v in seconds.values()):
            return starts
        return sorted(starts, key=lambda p: (seconds[json.dumps(p, sort_keys=True)] is None,
                                             seconds[json.dumps(p, sort_keys=True)] or 0.0))

    def _maybe_exhaustive(self, trials: int) -> None:
        """Predict every plan of a small space now; when the plans not screened out are no more than
        the trial budget, queue them all (the screened ones too: they cost no probe) instead of sampling."""
        if self.space.size > UPFRONT_MAX:
            log.info("tune: %d plans: more than %d, so predicted one by one as TPE proposes them",
                     self.space.size, UPFRONT_MAX)
            return
        every, fitting = self.space.all_params(), []
        for params in every:  # stops at the first plan over the budget: then TPE samples, as usual
            if self._no_time_to_predict():
                log.info("tune: no exhaustive search: %s before all %d plans were predicted, so TPE samples "
                         "them, each predicted as it comes", self._no_time_to_predict(), len(every))
                return
            peak = self.screening.peak(self.space.candidate(params))
            if peak is None or peak <= self.cap.screen_above:
                fitting.append(params)
            if len(fitting) > trials:
                log.info("tune: more than --trials %d of the %d plans are predicted under the cap plus margin, so "
                         "TPE samples among them", trials, len(every))
                return
        log.info("tune: exhaustive search: %d of %d plans predicted under the cap plus margin, no more than "
                 "--trials %d: measuring every one instead of sampling", len(fitting), len(every), trials)
        self.exhaustive = True  # the queue now depends on --trials: budget_line says nothing of other budgets
        for params in fitting + [p for p in every if p not in fitting]:
            self.study.enqueue_trial(params, skip_if_exists=True)

    def _start_fits(self, candidate: Candidate) -> bool:
        """A starting point predicted to fit; past START_SHARE of the time budget no more are predicted, and
        the rest are taken by what is known without a prediction (`_may_fit_unpredicted`), so the known
        starting points are still tried first, as far as the budget reaches."""
        budget = self.budget
        if budget is not None and budget.time_s is not None and \
                time.monotonic() - budget.started > START_SHARE * budget.time_s:
            if not self.starts_cut:
                self.starts_cut = True
                log.info("tune: no more starting points predicted: %.0f%% of --time-budget %g s has passed; the rest "
                         "are taken at the largest micro-batch already predicted to fit, else unpredicted at the "
                         "smallest (the likeliest to fit), never one predicted or bounded over the limit",
                         100 * START_SHARE, budget.time_s)
            return self._may_fit_unpredicted(candidate)
        if self.predicted_search and candidate.key not in self.screening.peaks:
            self.priced_first.append(candidate)
        return self.screening.fits(candidate)

    def _may_fit_unpredicted(self, candidate: Candidate) -> bool:
        """Whether a starting point may be taken without a new prediction: one predicted already is taken as
        predicted; one the pools' lower bound puts over the limit never; an unpredicted one only at the
        smallest micro-batch, since the peak grows with it (the largest, a short budget's first try before,
        is the likeliest over: a 7B LoRA's every starting point at 24 GB)."""
        if invalid_reason(candidate, self.space) or self.screening.bound(candidate):
            return False
        if candidate.key in self.screening.peaks:
            return self.screening.fits(candidate)
        return self._smallest_micro_batch(candidate)

    def _smallest_micro_batch(self, candidate: Candidate) -> bool:
        """Whether no smaller micro-batch than the candidate's is valid with its other settings."""
        params = self.space.point_of(candidate)
        if params is None or "micro_batch" not in params:
            return True  # the micro-batch is pinned: the only one
        return not any(not invalid_reason(self.space.candidate({**params, "micro_batch": micro}), self.space)
                       for micro in self.space.micro_batches() if micro < params["micro_batch"])

    def _no_time_to_predict(self) -> str | None:
        """Why no more predictions may run before the first probe: the time budget's share for them is spent."""
        left = self.budget.before_probes_left() if self.budget is not None and self.probes == 0 else None
        if left is None or left > 0:
            return None
        return (f"the {PRE_PROBE_SHARE:.0%} of --time-budget {self.budget.time_s:g} s that may pass before the first "
                f"probe is spent")

    def run(self, budget: Budget) -> str:
        """Propose, evaluate and tell until the budget is spent; returns why it stopped."""
        self._redo_interrupted()
        while True:
            reason = self._stop_reason(budget)
            if reason:
                log.info("tune: stopping: %s", reason)
                return reason
            self.study.sampler = self._sampler()
            trial = self.study.ask(self.space.distributions())
            self._evaluate(trial, self.space.candidate(trial.params))
            self.origins.append(trial.params)
            self._descend(budget)
            self._price_ready(budget)

    def _descend(self, budget: Budget) -> None:
        """tune --predict: the walks from the plans priced so far (autotune/search/descent.py), each plan
        they lead to one trial, until they lead nowhere new or the budget is spent. Not while starting
        points are queued (a queued trial is the next one asked)."""
        if self.descent is None or self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        while (step := self.descent.next_moves()) is not None:
            walk, start, points = step
            fresh = self._pricing_order([(p, c) for p in points if self._unpriced(c := self.space.candidate(p))])
            if not fresh:
                continue
            log.info("tune: %d plan(s) one knob %s from trial %d (%s at %.2f s a step%s)", len(fresh), walk,
                     start.number, "the fastest predicted to fit" if walk == "faster" else
                     f"predicted {format_bytes(start.peak)}, over the limit", start.seconds,
                     "" if walk == "faster" else ", faster than any fit so far")
            for point, candidate in fresh:
                if self._stop_reason(budget, candidate):
                    return
                self.study.enqueue_trial(point, user_attrs={"proposed_by": walk})
                self._evaluate(self.study.ask(self.space.distributions()), candidate)
                self.origins.append(point)  # its neighbours already traced are priced after the walks

    def _pricing_order(self, fresh: list[tuple[dict, Candidate]]) -> list[tuple[dict, Candidate]]:
        """A walk's plans in the order the predictor prices them soonest (`prefetch`: a second pricer starts on
        the last of them while this process prices the first); as the walk gives them where it cannot say."""
        prefetch = getattr(self.predict, "prefetch", None)
        if prefetch is None or len(fresh) < 2:
            return fresh
        point_of = {id(candidate): point for point, candidate in fresh}
        return [(point_of[id(candidate)], candidate) for candidate in prefetch([c for _, c in fresh])]

    def _ready(self, candidate: Candidate) -> bool:
        """Whether the predictor composes the plan from parts already traced (False where it cannot say)."""
        ready = getattr(self.predict, "ready", None)
        return bool(ready and ready(candidate))

    def _unpriced(self, candidate: Candidate) -> bool:
        """Not yet evaluated, valid, and not ruled out by its pools' lower bound."""
        return candidate.key not in self.first_of and not invalid_reason(candidate, self.space) and \
            not self.screening.bound(candidate)

    def _price_ready(self, budget: Budget) -> None:
        """tune --predict: the plans one knob from those predicted so far (`origins`) that cost little to
        predict now (composed from parts already traced) are predicted right away, and so on from each of
        them: every trace serves the plans it can, and TPE learns from them all. Not while starting points
        are queued (a queued trial is the next one asked), and within the trials and the time budget."""
        ready = getattr(self.predict, "ready", None)
        if not self.predicted_search or ready is None or \
                self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return
        queue, seen, self.origins = self.origins, set(), []
        while queue:
            for _, point in self.space.neighbours(queue.pop(0)):
                candidate = self.space.candidate(point)
                if candidate.key in seen:
                    continue
                seen.add(candidate.key)
                if not self._unpriced(candidate) or not ready(candidate):
                    continue
                if self._stop_reason(budget, candidate):
                    return
                self.study.enqueue_trial(point, user_attrs={"proposed_by": "neighbour"})
                self._evaluate(self.study.ask(self.space.distributions()), candidate)
                queue.append(point)
                self._descend(budget)  # a new fastest fit, or a faster plan over the limit, is gone on from first

    @property
    def probes(self) -> int:
        """Plans measured; under --predict, plans predicted (one over the cap counts: it was priced too)."""
        return sum(1 for t in self.first_of.values() if self._priced(read_record(t)))

    def _priced(self, record: TrialRecord) -> bool:
        if record.probe_s is not None:
            return True
        return self.predicted_search and record.state == "screened" and record.predicted_s is not None

    def _stop_reason(self, budget: Budget, candidate: Candidate | None = None) -> str | None:
        if self.probes >= budget.trials:
            return f"{self.probes} plans {'predicted' if self.predicted_search else 'measured'} (--trials {budget.trials})"
        if len(self.first_of) >= self.space.size:
            return f"every plan in the space ({self.space.size}) has been tried"
        if self.duplicates_in_a_row >= CONVERGED_AFTER:
            return f"the sampler proposed {CONVERGED_AFTER} already-measured plans in a row: it has converged"
        return self._out_of_time(budget, candidate)

    def _out_of_time(self, budget: Budget, candidate: Candidate | None = None) -> str | None:
        """Why no probe may start now: the time budget is spent, or the next probe (as long as the
        median probe so far) would end past it. The first probe always runs: without one measured
        plan there is nothing to choose."""
        left = budget.time_left()
        if left is None or (self.probes == 0 and not self.predicted_search):  # predictions: the budget holds
            return None
        expected = self.expected_probe_s(candidate)
        if left <= 0:
            return f"the time budget of {budget.time_s:g} s is spent"
        if expected > left:
            return (f"the time budget of {budget.time_s:g} s has {left:.0f} s left, less than a "
                    f"{'prediction' if self.predicted_search else 'probe'} takes ({'mean' if self.predicted_search else 'median'} "
                    f"{expected:.1f} s)")
        return None

    def expected_probe_s(self, candidate: Candidate | None = None) -> float:
        """How long a probe takes here: the median of the probes so far (re-runs included). Under --predict (a
        probe's record holds only the cached answer's time) the mean of the predictions so far of the candidate's
        kind: composed from parts already traced (a fraction of a second) or not (seconds: a trace); the mean of
        all where the candidate is not known yet (the sampler's next)."""
        if self.predicted_search:
            kind = self.predicting_s[self._ready(candidate)] if candidate is not None else \
                [*self.predicting_s[True], *self.predicting_s[False]]
            return statistics.fmean(kind) if kind else 0.0
        records = map(read_record, self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        seconds = [r.probe_s for r in records if r.probe_s and r.duplicate_of is None]
        return statistics.median(seconds) if seconds else 0.0

    def _sampler(self) -> optuna.samplers.TPESampler:
        """A sampler seeded for this proposal: the count of proposals so far (interrupted ones not counted)."""
        count = len(self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING,
                                                                  TrialState.WAITING)))
        return optuna.samplers.TPESampler(seed=(self.seed * 1_000_003 + count) % 2**32,
                                          n_startup_trials=STARTUP_TRIALS, constant_liar=False)

    def _redo_interrupted(self) -> None:
        """A trial left RUNNING by a killed tuner never finished: fail it and measure its plan again first."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL)
            # a second run of a finalist is left to confirm(), which decides again which plans need one
            if set(trial.params) == set(self.space.distributions()) and read_record(trial).repeat_of is None:
                self.study.enqueue_trial(trial.params)
                log.info("tune: trial %d was interrupted mid-probe; measuring its plan again", trial.number)

    def confirm(self, finalists: int, budget: Budget | None = None) -> None:
        """Measure the fastest plans again until the top `finalists` have FINALIST_RUNS runs each: on a
        busy machine one probe's throughput can be off by more than the gap between the best plans.
        Runs made before an interruption count; the extra probes are bounded, and so is their time."""
        self._close_unreached()
        params = {t.number: t.params for t in self.study.get_trials(deepcopy=False)}
        for _ in range(2 * finalists * (FINALIST_RUNS - 1)):
            short = [p for p in ranked_feasible(trial_records(self.study))[:finalists] if p.runs < FINALIST_RUNS]
            if not short:
                return
            late = self._out_of_time(budget) if budget else None
            if late:
                log.info("tune: no more re-runs of the finalists: %s", late)
                return
            number = short[0].number
            self.study.enqueue_trial(params[number], user_attrs={"repeat_of": number})
            trial = self.study.ask(self.space.distributions())
            if trial.params != params[number]:  # only this plan is queued now: anything else is a bug
                raise RuntimeError(f"trial {trial.number} was to measure trial {number}'s plan again but holds "
                                   f"{trial.params}")
            log.info("trial %d: measuring the plan of trial %d again (a finalist, run %d of %d)", trial.number,
                     number, short[0].runs + 1, FINALIST_RUNS)
            self._evaluate(trial, self.space.candidate(trial.params))

    def _close_unreached(self) -> None:
        """Plans still queued when the search stopped (starting points, the solver's, an exhaustive
        grid's) are closed as `skipped`: ask() hands out the oldest queued trial, so a re-run queued
        after them would measure one of them instead. Under --predict a queued plan already predicted
        (a starting point's) is told its prediction instead: a fit is never thrown away."""
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        skipped = []
        for _ in waiting:
            trial = self.study.ask(self.space.distributions())
            candidate = self.space.candidate(trial.params)
            if self.predicted_search and (candidate.key in self.screening.peaks or candidate.key in self.first_of):
                self._evaluate(trial, candidate)  # its prediction is made: telling it costs nothing
                continue
            label = describe(candidate)
            skipped.append(f"{label} ({trial.user_attrs.get('proposed_by', 'a starting point')})")
            store_record(trial, TrialRecord(label=label, state="skipped",
                                            reason=f"queued, but the search stopped before it was "
                                                   f"{'predicted' if self.predicted_search else 'measured'}"))
            self.study.tell(trial, state=TrialState.FAIL)
        if skipped:
            log.info("tune: %d queued plan(s) were not reached before the search stopped (a larger --time-budget "
                     "or --trials reaches them): %s", len(skipped), "; ".join(skipped))

    def _evaluate(self, trial: Trial, candidate: Candidate) -> None:
        earlier = self.first_of.get(candidate.key)
        repeat = "repeat_of" in trial.user_attrs  # a finalist measured again on purpose: not a duplicate
        if earlier is not None and not repeat:
            self._tell_duplicate(trial, earlier)
            return
        self.duplicates_in_a_row = 0
        started, ready = time.monotonic(), self.predicted_search and self._ready(candidate)
        record, constraint = self._record(trial.number, candidate, screen=not repeat)
        if self.predicted_search:
            self.predicting_s[ready].append(time.monotonic() - started)
        trial.set_constraint("peak", constraint)
        store_record(trial, record)
        told = self.study.tell(trial, record.samples_per_s or 0.0)
        self.first_of.setdefault(candidate.key, told)
        if self.descent is not None and not repeat:
            self.descent.add(trial.number, trial.params, record)
        _log_trial(trial.number, candidate, record, self.predicted_search)

    def _tell_duplicate(self, trial: Trial, earlier: FrozenTrial) -> None:
        self.duplicates_in_a_row += 1
        store_record(trial, read_record(earlier).model_copy(update={"state": "duplicate", "duplicate_of": earlier.number}))
        trial.set_constraint("peak", earlier.constraints["peak"])
        self.study.tell(trial, earlier.value)
        log.info("trial %d: same plan as trial %d; reusing its measurement", trial.number, earlier.number)

    def _record(self, number: int, candidate: Candidate, screen: bool = True) -> tuple[TrialRecord, float]:
        """The trial's record and constraint: the candidate measured, unless it is invalid or (`screen`)
        predicted clearly over the cap."""
        known = {"key": candidate.key, "plan": candidate.plan.model_dump(mode="json"), "precision": candidate.precision,
                 "label": describe(candidate), "strategy": candidate.strategy}
        invalid = invalid_reason(candidate, self.space) if screen else None
        if invalid:
            return TrialRecord(**known, state="invalid", reason=invalid), UNMEASURED
        screening = self.screening
        if screen and (candidate.key in screening.bounded or
                       (candidate.key not in screening.peaks and screening.bound(candidate))):
            floor = screening.bounded[candidate.key]
            reason = (f"holds at least {floor.words()} before any activation (its pools' lower bound) > limit "
                      f"{format_bytes(self.cap.limit)}; not {'predicted' if self.predicted_search else 'probed'}")
            return (TrialRecord(**known, predicted_peak=floor.total, state="screened", reason=reason),
                    self.cap.constraint(floor.total))
        # the estimate runs eager: it bounds no compiled plan's peak under a budget (not even monotonic in it)
        measure_only = candidate.plan.activation_memory_budget is not None
        predicted = screening.peak(candidate) if screen and not measure_only else None
        known.update(predicted_peak=predicted, unscreened=screening.unscreened.get(candidate.key),
                     predicted_s=screening.time_of(candidate.key))
        if predicted is not None and predicted > self.cap.screen_above:
            reason = f"predicted {format_bytes(predicted)} > cap {format_bytes(self.cap.bytes)}; not probed"
            return TrialRecord(**known, state="screened", reason=reason), self.cap.constraint(predicted)
        log.info("trial %d: %s %s", number, self.doing, describe(candidate))
        return self._measured(known, self.evaluate(candidate, number))

    def _measured(self, known: dict, result: ProbeResult) -> tuple[TrialRecord, float]:
        """What the probe said, judged against the limit; `known` is the plan and its prediction."""
        peak = result.measured_peak_bytes if result.measured_peak_bytes is not None else result.peak_mem_bytes
        constraint = self.cap.constraint(peak) if peak is not None else UNMEASURED
        measured = {**known, "measured_peak": peak, "probe_s": result.probe_s or 0.0, "reason": result.reason,
                    "device": {"device": result.device, "device_total_bytes": result.device_total_bytes,
                               "torch": result.torch, "cuda": result.cuda}}
        if result.status != "ok":
            return TrialRecord(**measured, state=result.status), max(constraint, 1e-6)
        # gradient_error: a lossy plan's (memory.compression), how far its gradient moved
        # update_error: a lossy optimizer's (memory.weights bf16, optimizer_state 8bit/...), how far its update moved
        measured.update(samples_per_s=result.samples_per_s, gradient_error=result.gradient_error,
                        update_error=result.update_error)
        if result.predicted:  # tune --predict: what the prediction said
            measured.update(step_s=result.step_s, mfu=result.mfu, hfu=result.hfu, predicted=True)
        if peak > self.cap.limit:
            measured.update(state="over_limit", reason=f"measured {format_bytes(peak)} > limit {self.cap.describe()}")
        return TrialRecord(**{"state": "feasible", **measured}), constraint


def _log_trial(number: int, candidate: Candidate, record: TrialRecord, predicted: bool = False) -> None:
    """`trial N: STATE: plan (numbers)`; under --predict the words say predicted, never measured."""
    peak = record.measured_peak or record.predicted_peak
    speed = record.samples_per_s
    how = "predicted " if predicted or not record.measured_peak else ""
    numbers = ", ".join(x for x in (f"{how}peak {format_bytes(peak)}" if peak else "",
                                    f"{how}{speed:.1f} samples/s" if speed else "",
                                    f"gradient error {record.gradient_error:.2e}" if record.gradient_error is not None
                                    else "",
                                    f"update error {record.update_error:.2e}" if record.update_error is not None
                                    else "") if x)
    state = PREDICTED_WORDS.get(record.state, record.state) if predicted else record.state
    log.info("trial %d: %s: %s%s%s", number, state, describe(candidate),
             f" ({numbers})" if numbers else "", f" - {record.reason}" if record.reason else "")


PREDICTED_WORDS = {"feasible": "predicted to fit", "over_limit": "predicted over the limit",
                   "unavailable": "no prediction"}


