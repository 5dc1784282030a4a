"""Early stopping (`eval.early_stopping`): end the run when an evaluation metric stops improving.

Patience counts evaluations, as HF's EarlyStoppingCallback does. The history is the evaluation
records in metrics.jsonl, so a resumed run picks up the count where its checkpoint left it and
stops where the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import math

from ..builders.resolve import BuildError

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
        change = (value - self.best) if self.best is not None else None
        if change is None or (change if self.larger_is_better else -change) > self.spec.min_delta:
            self.best, self.best_step, self.waited = value, record["step"], 0
            return None
        self.waited += 1
        if self.waited < self.spec.patience:
            return None
        return (f"eval {self.metric} has not improved by more than {self.spec.min_delta:g} for {self.waited} "
                f"evaluations (best {self.best:.4g} at step {self.best_step})")

    def replay(self, records: list[dict]) -> str | None:
        """The evaluations a resumed run already made, in order; the reason to stop if they already say so."""
        reason = None
        for record in records:
            if "eval" in record:
                reason = self.observe(record)
        return reason
