"""Each plan's prediction, made once per study: its peak (or the pools' lower bound standing for it,
autotune/space/pool_floor.py), its step time where the device's facts are known, and why a plan
could not be predicted (the user's code, mostly; such a plan is probed unscreened). The tuner asks
it which starting points fit, which plans to tell infeasible without a probe, and in which order
to try the starting points.
"""

from __future__ import annotations

from ..cap import Cap
from ..space.candidate import Candidate
from ..space.space import Space
from ..space.validity import invalid_reason
from .study import Predict, Prediction


class Screening:
    """What the estimator said of each plan, by plan key; `predict` None: no predictions (--no-screen)."""

    def __init__(self, space: Space, cap: Cap, predict: Predict | None):
        self.space, self.cap, self.predict = space, cap, predict
        self.peaks: dict[str, int | None] = {}  # plan key -> predicted peak: the estimator runs once a plan
        self.times: dict[str, dict] = {}  # plan key -> its predicted StepTime record, when timed
        self.unscreened: dict[str, str] = {}  # plan key -> why its prediction failed (the user's code, mostly)
        self.bounded: dict[str, object] = {}  # plan key -> its pools' lower bound (pool_floor.Floor), over the limit

    def peak(self, candidate: Candidate) -> int | None:
        """The plan's predicted peak (its pools' lower bound where that already rules it out), or None."""
        if candidate.key not in self.peaks and self.bound(candidate):
            return self.peaks[candidate.key]
        if candidate.key not in self.peaks:
            # an invalid plan is never probed: asking would only log that it is (fsdp with sqrt segments)
            invalid = invalid_reason(candidate, self.space)
            predicted = self.predict(candidate) if self.predict and not invalid else None
            if isinstance(predicted, Prediction):
                if predicted.reason:
                    self.unscreened[candidate.key] = predicted.reason
                if predicted.time:
                    self.times[candidate.key] = predicted.time
                predicted = predicted.peak
            self.peaks[candidate.key] = predicted
        return self.peaks[candidate.key]

    def seconds(self, candidate: Candidate) -> float | None:
        """The plan's predicted step time, predicting it first; None where no time is predicted."""
        self.peak(candidate)
        return self.time_of(candidate.key)

    def time_of(self, key: str) -> float | None:
        return (self.times.get(key) or {}).get("seconds")

    def fits(self, candidate: Candidate) -> bool:
        """Whether a plan is worth a starting point: valid, and not predicted over the limit."""
        if invalid_reason(candidate, self.space):
            return False  # no starting point is spent on a plan told invalid (a micro-batch another strategy's)
        if candidate.plan.activation_memory_budget is not None:
            return True  # the eager estimate bounds no compiled plan under a budget: it is measured instead
        predicted = self.peak(candidate)
        return predicted is None or predicted <= self.cap.limit

    def bound(self, candidate: Candidate) -> bool:
        """Whether the pools' lower bound (autotune/space/pool_floor.py) rules the plan out without a
        prediction; its bound then stands for its predicted peak."""
        if candidate.key in self.bounded:
            return True
        floor = self.space.bound.over(candidate) if self.space.bound is not None else None
        if floor is None:
            return False
        self.bounded[candidate.key] = floor
        self.peaks[candidate.key] = floor.total
        return True
