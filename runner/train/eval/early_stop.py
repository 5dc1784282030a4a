"""Early stopping (`eval.early_stopping`): end the run when an evaluation metric stops improving.

Patience counts evaluations, as HF's EarlyStoppingCallback does: an evaluation improves on the best
seen by more than `min_delta`, or it counts against patience; a smaller improvement still becomes
the best (as the Trainer's best_metric does), so the reason names the best value there was. The history is the evaluation
records in metrics.jsonl, so a resumed run picks up the count where its checkpoint left it and
stops where the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import math

from ...builders.resolve import BuildError

log = logging.getLogger(__name__)


class EarlyStop:
    def __init__(self, spec):
        self.spec = spec
        self.metric = spec.metric
        self.larger_is_better = (spec.mode or ("max" if spec.metric == "accuracy" else "min")) == "max"
        self.best: float | None = None
        self.best_step = 0
        self.waited = 0  # evaluations since the best one

    def observe(self, record: dict) -> str | None:
        """Take one evaluation record ({"step", "eval": {...}}); the reason to stop, or None."""
        values = record["eval"]
        if self.metric == "perplexity" and "perplexity" not in values and "loss" in values:
            values = {**values, "perplexity": math.inf}  # a loss past exp's range: no improvement, not a failure
        if self.metric not in values:
            raise BuildError("eval.early_stopping.metric", f"the evaluation reports {', '.join(values)}, not "
                                                           f"{self.metric!r}; name one of them")
        value = values[self.metric]
        gain = None if self.best is None else (value - self.best if self.larger_is_better else self.best - value)
        if gain is None or gain > 0:  # the best is the best seen, as the Trainer's best_metric: a message never
            self.best, self.best_step = value, record["step"]  # names a "best" worse than the last value
        if gain is None or gain > self.spec.min_delta:
            self.waited = 0
            return None
        self.waited += 1
        if self.waited < self.spec.patience:
            return None
        last = "" if self.best_step == record["step"] else f"; step {record['step']}: {value:.4g}"
        return (f"eval {self.metric} has not improved by more than {self.spec.min_delta:g} over its best for "
                f"{self.waited} evaluations (best {self.best:.4g} at step {self.best_step}{last})")

    def replay(self, records: list[dict]) -> str | None:
        """The evaluations a resumed run already made, in order; the reason to stop if they already say so."""
        reason = None
        for record in records:
            if "eval" in record:
                reason = self.observe(record)
        return reason
