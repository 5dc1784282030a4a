"""TensorBoard event files, a sink for the records metrics.jsonl gets (`output.sinks: [tensorboard]`, or
`output.tensorboard: true`).

Each step record becomes scalars `train/loss`, `train/lr`, `train/samples_per_s`, ... and each
evaluation `eval/loss`, `eval/accuracy` or `eval/perplexity`, at the record's step, in
OUTPUT_DIR/tensorboard (`tensorboard --logdir OUTPUT_DIR`). A resumed run purges the events from
its checkpoint's step on, so the curves show each step once.
"""

from __future__ import annotations

import logging

from .output import Ended, RunInfo, scalars

log = logging.getLogger(__name__)

DIRECTORY = "tensorboard"


class TensorBoardLog:
    def __init__(self, section=None):
        self.writer = None

    def open(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        directory = run.out_dir / DIRECTORY
        # purge_step: events a killed attempt wrote after its last checkpoint are dropped, not drawn twice
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=run.first_step or None)
        log.info("tensorboard: events in %s (view them with `tensorboard --logdir %s`)", directory, directory.parent)

    def write(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def close(self, ended: Ended) -> None:
        self.writer.close()
