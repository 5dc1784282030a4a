"""TensorBoard event files, a second sink for the records metrics.jsonl gets (`output.tensorboard: true`).

Each step record becomes scalars `train/loss`, `train/lr`, `train/samples_per_s`, ... and each
evaluation `eval/loss`, `eval/accuracy` or `eval/perplexity`, at the record's step, in
OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR`). A resumed run purges the events from
its checkpoint's step on, so the curves show each step once.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DIRECTORY = "tensorboard"


class TensorBoardLog:
    def __init__(self, directory: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events a killed attempt wrote after its last checkpoint are dropped, not drawn twice
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=first_step or None)
        log.info("tensorboard: events in %s (view them with `tensorboard --logdir %s`)", directory, directory.parent)

    def append(self, record: dict) -> None:
        group, values = ("eval", record["eval"]) if isinstance(record.get("eval"), dict) else ("train", record)
        for key, value in values.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{group}/{key}", value, record["step"])

    def close(self) -> None:
        self.writer.close()


class _NoLog:
    def append(self, record: dict) -> None:
        pass


@contextlib.contextmanager
def tensorboard_log(enabled: bool, out_dir: Path, first_step: int):
    """The TensorBoard sink when the recipe asks for one, else a sink that drops records."""
    if not enabled:
        yield _NoLog()
        return
    board = TensorBoardLog(out_dir / DIRECTORY, first_step)
    try:
        yield board
    finally:
        board.close()
