"""Predictions in the tuner's own process: a prediction is a function call, so it needs no child.

`tune --predict` of a library model (transformers, torchvision: no code of the user's runs), and its
screening on a CPU, price plans here: one process's plans composed from parts (runner/predict/compose.py, a few traced blocks
shared by every plan), a rank's under --nproc by the rank predictor (runner/predict/per_rank.py, the
split fake model kept per layout). The model child (autotune/probes/screen.py) stays where the user's
own model code runs, which a hang or a crash must not take the tuner down with, and where the tuner
itself must stay off the GPU (a measured tune on CUDA).

The interface is the child's predictor's (`IsolatedPredictor`): called with a candidate, it answers a
`Prediction` (the peak with the CUDA context, the step time on the named device) or why there is none;
`frontier` answers the solver; `summary` says what report.json says about predicting.
"""

from __future__ import annotations

import gc
import logging
import os
import time

from ckrun.runner.problems import first_line
from ckrun.runner.recipe.recipe import Recipe

from ..search.study import Prediction
from .screen import CHILD_ENV, Screening
from ..space.candidate import Candidate
from ..space.knobs import describe

log = logging.getLogger(__name__)

FULL_EVERY = 100  # while a pricer lives, collections of the middle generation per full one (Python's default: 10)


def in_process(recipe: Recipe, predict: bool, device_kind: str) -> bool:
    """Whether this tune's predictions run in its own process: a model whose code is a library's (a python
    model's factory is the user's, kept in the child), predicted for a GPU (no probe shares the GPU with
    the tuner) or tuned on the CPU (there is no GPU to keep the tuner off)."""
    if os.environ.get(CHILD_ENV):
        return False  # a stand-in model child is given (the tests'): it answers
    return recipe.model.source != "python" and (predict or device_kind == "cpu")


class PricedPredictor(Screening):
    """Predicted peaks and step times for the tuner, made in this process (module docstring)."""

    def __init__(self, recipe: Recipe, device_kind: str, time_facts, context_bytes: int = 0, nproc: int = 1,
                 screen_above: int | None = None, beside=None):
        """`screen_above`: the peak (CUDA context included) over which a plan is screened out whatever its
        exact figure: past it, its live tensors' peak is enough (no allocator replay). `beside`: a second
        pricer (autotune/probes/beside.py `Beside`) that makes traces on another core, or None."""
        super().__init__()
        self.beside = beside
        self.recipe, self.device_kind, self.time_facts, self.nproc = recipe, device_kind, time_facts, nproc
        self.context_bytes, self.screen_above = context_bytes, screen_above
        self.priced = 0  # plans answered, composed or not
        self._frozen_at: int | None = None  # the pricer's trace count when the heap was last frozen
        self._thresholds: tuple[int, int, int] | None = None  # the collector's before the pricer spaced its full collections
        self.seconds = 0.0  # spent predicting
        self._pricer = None

    def __call__(self, candidate: Candidate) -> Prediction | None:
        from ckrun.runner.predict.estimate import EstimateUnavailable

        if self.off or not self._started():
            return None
        started = time.monotonic()
        try:
            estimate = self._estimate(candidate)
        except (EstimateUnavailable, ValueError) as err:
            log.info("screening: no prediction for %s (%s)", describe(candidate), first_line(err))
            return Prediction(None, f"unscreened: {first_line(err)}")
        finally:
            self.seconds += time.monotonic() - started
            self._keep_long_lived()
        self.priced += 1
        if self.priced == 1:  # what a user waits for first (bench/tune_shapes.py reads this line)
            log.info("screening: first plan priced: %s, %s in %.1f s (%.1f CPU s since the process began)",
                     describe(candidate), "its whole step" if any("not composed" in n for n in estimate.notes) else
                     "composed from parts", time.monotonic() - started, time.process_time())
        self._warn(estimate.warnings)
        return Prediction(estimate.peak_bytes + self.context_bytes, time=estimate.time.record() if estimate.time else None)

    def ready(self, candidate: Candidate) -> bool:
        """Whether the candidate is priced without tracing anything new (a fraction of a trace's time)."""
        if self.nproc > 1 or self.off or self._pricer is None:
            return False
        return self._pricer.ready(candidate.plan, candidate.precision)

    def _estimate(self, candidate: Candidate):
        if self.nproc > 1:
            return self._pricer.estimate(candidate.recipe(self.recipe, None))
        over = None if self.screen_above is None else self.screen_above - self.context_bytes
        return self._pricer.estimate(candidate.plan, candidate.precision, over)

    def _started(self) -> bool:
        """The pricer, built the first time it is asked: the fake model and its warmed-up optimizer."""
        if self._pricer is not None:
            return True
        from ckrun.runner.predict.estimate import EstimateUnavailable

        started = time.monotonic()
        try:
            self._pricer = self._build()
        except (EstimateUnavailable, ValueError) as err:
            self._turn_off(f"the estimator cannot model this recipe: {first_line(err)}")
            return False
        log.info("screening: the model built on fake tensors in this process in %.1f s%s", time.monotonic() - started,
                 "" if self.nproc > 1 else "; each plan is composed from traced blocks")
        return True

    def _build(self):
        if self.nproc > 1:
            from ckrun.runner.predict.per_rank import RankPredictor

            return RankPredictor(self.nproc, self.device_kind, self.time_facts)
        from ckrun.runner.predict.compose import Composer
        from ckrun.runner.predict.parts import PartsEstimator

        tracer = None
        if self.beside is not None:
            from .beside import Taking

            tracer = Taking(self.beside)
        return Composer(PartsEstimator(self.recipe, self.device_kind, self.time_facts), tracer=tracer)

    def prefetch(self, candidates: list[Candidate]) -> list[Candidate]:
        """These plans are priced next: returned in the order to price them, those composed from what is traced
        first, then by the cost of the first trace each needs now, the cheapest first (`trace_cost`). The second
        pricer makes the traces they will need in that order (`Composer.traces_ahead`: a trace the plans before
        make is not asked again) but the first, from the last, while this process prices from the first
        (autotune/probes/beside.py): the two meet in the middle, where in the walk's own order the dear offloaded
        plan's trace, often its first, fell to this process, and the second one made traces of plans whose
        blocks cheaper ones had traced by then. The order is the same with a second pricer or without one, so
        is the search."""
        if self.nproc > 1 or self.off or not self._started():
            return candidates
        from ckrun.runner.predict.compose import trace_cost

        alone = [self._pricer.next_trace(c.plan, c.precision) for c in candidates]
        ordered = [candidates[i] for i in sorted(range(len(candidates)), key=lambda i: trace_cost(alone[i]))]
        if self.beside is not None and not self.beside.broken:
            ahead = self._pricer.traces_ahead([(c.plan, c.precision) for c in ordered])
            needed = [t for t in ahead if t is not None]
            # this process makes the first trace itself where it needs it at once; after plans composed from what
            # is traced (a tenth of a second each), the other process has it under way by then
            self.beside.ask(list(reversed(needed[1:] if ahead and ahead[0] is not None else needed)))
        return ordered

    def frontier_later(self, request: dict):
        """`frontier`, started now: a function that answers it. With a second pricer it solves there while this
        process goes on; should that one break, this one solves when asked (with the time the request gave)."""
        if self.beside is None or self.nproc > 1 or not self.beside.solve(request):
            answer = self.frontier(request)
            return lambda: answer
        given = None if request.get("deadline") is None else request["deadline"] - time.monotonic()

        def answer() -> dict:
            solved = self.beside.solved()
            if solved is not None:
                return solved
            return self.frontier({**request, "deadline": None if given is None else time.monotonic() + given})
        return answer

    def frontier(self, request: dict) -> dict:
        """The solver's plans (autotune/search/solver.py), answered as the model child answers them."""
        if self.nproc > 1 or self.off or not self._started():
            return {"status": "unavailable", "reason": f"no estimator ({self.off or 'ranks'})"}
        from ..search.solver import answer_request

        try:
            return answer_request(self._pricer, request)
        except ValueError as err:
            return {"status": "unavailable", "reason": first_line(err)}
        finally:
            self._keep_long_lived()

    def summary(self) -> dict:
        """What report.json says about screening."""
        traces = getattr(self._pricer, "traces", None)
        beside = {} if self.beside is None else {"traced_beside": self.beside.taken}
        return {"state": "off" if self.off else "on", "reason": self.off or "", "faults": [],
                "warnings": list(self.warnings), "in_process": True, "priced": self.priced,
                "predict_s": round(self.seconds, 3), **({"traces": traces} if traces is not None else {}), **beside}

    def _keep_long_lived(self) -> None:
        """Everything the pricer holds now (the fake model, its traces: millions of objects for an 8B) lives
        until the search ends, yet each full collection of Python's garbage collector walked it again: 20
        of them, 6.7 s of the 8B's 85 s search. Once a prediction made new traces, the heap is frozen
        (`gc.freeze`: later collections skip it); `close` unfreezes it. Not where the caller froze objects
        of its own: unfreezing would give theirs back too."""
        traces = getattr(self._pricer, "traces", None)
        if traces is None or traces == self._frozen_at or (self._frozen_at is None and gc.get_freeze_count()):
            return
        self._frozen_at = traces
        gc.freeze()
        if self._thresholds is None:
            # frozen objects no longer count as long-lived, so a full collection came after few new ones: 102 of
            # them in the 8B's search (2.4 s); one after FULL_EVERY collections of the middle generation: 6 (0.7 s)
            self._thresholds = gc.get_threshold()
            gc.set_threshold(*self._thresholds[:2], max(self._thresholds[2], FULL_EVERY))

    def close(self) -> None:
        """Take down what the pricer holds (the rank predictor's fake process group), and give the objects
        frozen while it priced back to the garbage collector, its thresholds as they were."""
        close = getattr(self._pricer, "close", None)
        if close is not None:
            close()
        if self.beside is not None:
            self.beside.close()
        if self._frozen_at is not None:
            self._frozen_at = None
            gc.unfreeze()
        if self._thresholds is not None:
            gc.set_threshold(*self._thresholds)
            self._thresholds = None
