"""When a run evaluates, and what follows: every `eval.every` steps and at the last step, once more
at a Ctrl-C stop (the weights a stop leaves are the run's result too), and early stopping fed
from each evaluation. Each evaluation record goes to every sink (metrics.jsonl and the recipe's).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .best import BestKept
from .early_stop import EarlyStop
from .evaluate import make_evaluator
from ..output.directory import METRICS, read_metrics_lines

log = logging.getLogger(__name__)


class Evaluations:
    def __init__(self, trainer, out_dir: Path):
        self.trainer, self.out_dir = trainer, out_dir
        self.evaluator = make_evaluator(trainer)
        spec = trainer.recipe.eval
        self.early = EarlyStop(spec.early_stopping) if spec is not None and spec.early_stopping else None
        self.best = BestKept(spec.best, out_dir, trainer.step) if spec is not None and spec.best else None

    def stopped_already(self) -> str | None:
        """After a resume: the evaluations before the checkpoint, replayed into early stopping, so the
        run stops where an uninterrupted one would have; the reason if they already ended it."""
        metrics = self.out_dir / METRICS
        if self.early is None or self.trainer.step == 0 or not metrics.is_file():
            return None
        records = [r for r in read_metrics_lines(metrics)[0] if r["step"] <= self.trainer.step]
        reason = self.early.replay(records)
        if reason:
            log.info("early stopping had already ended this run at step %d: %s; raise eval.early_stopping.patience "
                     "to train on", self.trainer.step, reason)
        return reason

    def after_step(self, sinks) -> str | None:
        """Evaluate when due; the reason to stop early, or None."""
        if self.evaluator is None or not self.evaluator.due(self.trainer.step):
            return None
        record = self._evaluate(sinks)
        if self.best is not None:
            self.best.observe(record, self.trainer)
        reason = self.early.observe(record) if self.early is not None else None
        if reason and self.trainer.step < self.trainer.total_steps:
            log.info("early stopping after step %d of %d: %s", self.trainer.step, self.trainer.total_steps, reason)
            return reason
        return None

    def at_stop(self, sinks) -> None:
        """A stopped run's last whole step, evaluated unless it just was."""
        if self.evaluator is not None and self.trainer.step > 0 and self.evaluator.last_step != self.trainer.step:
            log.info("eval of the weights the stop leaves (step %d)", self.trainer.step)
            record = self._evaluate(sinks)
            if self.best is not None:
                self.best.observe(record, self.trainer)

    def _evaluate(self, sinks) -> dict:
        record = self.evaluator.run()
        sinks.write(record)
        return record

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.source.close()
