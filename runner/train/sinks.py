"""The sinks a run's records go to: metrics.jsonl always, then those the recipe chooses
(`output.sinks`, `output.tensorboard`), on rank 0 only (every rank's records are the same, reduced).

When one fails. metrics.jsonl is the run's record, so its failure ends the run as any write into
output.dir does (status 5, everything before it kept, --resume continues). An optional sink
(TensorBoard, W&B, MLflow) that raises, when it opens, writes or closes (its disk full, its store
locked, a bug in its package), is one warning line naming it and the error; it gets no more
records and training goes on, since metrics.jsonl still has every record.

Adding a sink: its section in runner/recipe_sinks.py (in SECTIONS and SinkSection, naming the
packages it needs), its class (open, write, close: output.py's `Sink`) in a module of its own here,
one line in SINKS, its packages as an extra in pyproject.toml; tests/runner/train/test_sinks.py
checks the registry is complete.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from ..problems import one_line
from ..recipe import OutputSpec
from ..recipe_sinks import SinkSection, TensorBoardSink
from .mlflow_log import MlflowLog
from .output import Ended, MetricsLog, RunInfo, Sink
from .tensorboard import TensorBoardLog
from .wandb_log import WandbLog

log = logging.getLogger(__name__)

SINKS: dict[str, type] = {"tensorboard": TensorBoardLog, "wandb": WandbLog, "mlflow": MlflowLog}


def chosen(output: OutputSpec) -> list[SinkSection]:
    """The recipe's optional sinks: output.sinks, with TensorBoard first when output.tensorboard says so."""
    sections = list(output.sinks)
    if output.tensorboard and not any(section.name == "tensorboard" for section in sections):
        sections.insert(0, TensorBoardSink(name="tensorboard"))
    return sections


class Sinks:
    """Every record to every sink, metrics.jsonl first (so the line of a non-finite step is written
    before the run ends on it); an optional sink that fails is dropped with one warning line."""

    def __init__(self, required: list[Sink], optional: dict[str, Sink]):
        self.required, self.optional = required, optional
        self.ended: Ended = "finished"  # the loop says "stopped" when a signal ended it early

    def open(self, run: RunInfo) -> None:
        for sink in self.required:
            sink.open(run)
        for name in list(self.optional):
            self._guarded(name, "could not start", lambda sink: sink.open(run))

    def write(self, record: dict) -> None:
        for sink in self.required:
            sink.write(record)
        for name in list(self.optional):
            self._guarded(name, f"failed at step {record['step']}", lambda sink: sink.write(record))

    def close(self, ended: Ended) -> None:
        try:
            for name in list(self.optional):
                self._guarded(name, "failed to close", lambda sink: sink.close(ended), closing=True)
        finally:
            for sink in self.required:
                sink.close(ended)

    def _guarded(self, name: str, what: str, use, closing: bool = False) -> None:
        sink = self.optional[name]
        try:
            use(sink)
        except Exception as err:  # noqa: BLE001 - an optional sink's failure is its own, never the run's
            del self.optional[name]
            after = "metrics.jsonl has every record" if closing else \
                "it gets no more records, training goes on (metrics.jsonl has every record)"
            log.warning("output.sinks: %s %s (%s: %s); %s", name, what, type(err).__name__,
                        one_line(str(err))[:300] or "no message", after)
            if not closing:
                with contextlib.suppress(Exception):  # let it release what it holds; it said what went wrong
                    sink.close("failed")


@contextlib.contextmanager
def open_sinks(trainer, out_dir: Path) -> Iterator[Sinks]:
    """The run's sinks, open for its records, closed with how the run ended ("failed" on an exception)."""
    if not trainer.ranks.is_main:
        yield Sinks([], {})
        return
    recipe = trainer.recipe
    sinks = Sinks([MetricsLog()], {section.name: SINKS[section.name](section) for section in chosen(recipe.output)})
    sinks.open(RunInfo(out_dir, recipe, trainer.source, trainer.step))
    try:
        yield sinks
    except BaseException:
        sinks.close("failed")
        raise
    sinks.close(sinks.ended)
