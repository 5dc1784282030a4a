"""Weights & Biases, offline (`output.sinks: [wandb]`): each record's numbers as W&B history at the
record's step, `train/loss`, `eval/perplexity`, ... as TensorBoard names them, the recipe as the
run's config. Nothing leaves the machine (W&B's error reports are turned off unless
WANDB_ERROR_REPORTING is set): OUTPUT_DIR/wandb/offline-run-* holds the run, and
`wandb sync OUTPUT_DIR/wandb/offline-run-*` uploads it.

Resume: a run keeps one W&B run id (OUTPUT_DIR/wandb/ckrun-run-id) across --resume. Each attempt
writes an offline folder of that id, and `wandb sync` uploads the folders of one run in the order
they were started, as one run. The resumed attempt logs from the step after its checkpoint; W&B
takes steps in increasing order only, so the steps a killed attempt logged after its last
checkpoint keep that attempt's values (the same losses: resume is exact). A run started afresh
(nothing to resume) gets a new id.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from ..recipe_sinks import WandbSink
from .output import Ended, RunInfo, scalars

log = logging.getLogger(__name__)

DIRECTORY = "wandb"
RUN_ID = "ckrun-run-id"


class WandbLog:
    def __init__(self, section: WandbSink):
        self.section, self.run = section, None

    def open(self, run: RunInfo) -> None:
        # offline is not enough for nothing to leave the machine: wandb-core reports its own errors unless told not to
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        directory = run.out_dir / DIRECTORY
        directory.mkdir(exist_ok=True)
        run_id = _run_id(directory, resumed=run.first_step > 0)
        # console off: W&B would wrap stdout and stderr, which ckrun's lines and progress bar write to
        settings = wandb.Settings(silent=True, console="off")
        self.run = wandb.init(mode="offline", dir=str(run.out_dir), id=run_id, resume="allow" if run.first_step else None,
                              project=self.section.project, name=self.section.run_name or run.out_dir.name,
                              tags=self.section.tags or None, config=run.recipe.model_dump(mode="json"), settings=settings)
        log.info("wandb: offline run %s in %s (upload it with `wandb sync %s`)", run_id, directory,
                 Path(self.run.dir).parent)

    def write(self, record: dict) -> None:
        if "resumed_with_changes" in record:  # --resume-changed: the settings the run continued with
            self.run.config.update({f"resumed_with_changes_at_{record['step']}": record["resumed_with_changes"]},
                                   allow_val_change=True)
        values = scalars(record)
        if values:
            self.run.log(values, step=record["step"])

    def close(self, ended: Ended) -> None:
        self.run.finish(exit_code=0 if ended == "finished" else 1)


def _run_id(directory: Path, resumed: bool) -> str:
    """The run's W&B id: the one its earlier attempt used when resuming, else a new one (written down)."""
    path = directory / RUN_ID
    if resumed and path.is_file():
        return path.read_text(encoding="utf-8").strip()
    run_id = secrets.token_hex(4)  # W&B ids are lower-case letters and digits
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id
