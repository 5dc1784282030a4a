"""The training loop: recipe in, metrics.jsonl and checkpoints out.

Order of work, as in the recipe's data flow: own the output directory, build the trainer (model on
the device, memory plan, data, optimizer: trainer.py), restore state when resuming, then run steps,
each record to the sinks, with evaluations, checkpoints and the export between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..builders.model import BuildError
from ..parallel.ranks import Ranks
from ..recipe.recipe import Recipe
from ..recipe.yamlio import dump_yaml
from .checkpoint.resume import resume as resume_from_checkpoint
from .checkpoint.sharded import finish_saving
from .checkpoint.store import save_checkpoint
from .eval.schedule import Evaluations
from .output.directory import (METRICS, prepare_output, read_metrics_lines, set_aside_unresumable, write_failure,
                               write_output)
from .output.export import finish_run
from .output.sinks import open_sinks
from .ranked import process_group_scope, save_state, stop_agreed
from .run.guard import LossWatch, StopRequest
from .run.memory_cap import MemoryCapExceeded, OutOfMemory, Prediction, check_predicted_peak
from .run.ownership import own_output
from .run.progress import Progress
from .run.room import check_room
from .run.start_line import start_lines
from .trainer import Trainer, join_group, planned_device_kind

# what a run can end with, besides its result, and what prepares its directory: train()'s callers need no other module
__all__ = ["MemoryCapExceeded", "OutOfMemory", "Prediction", "RunResult", "prepare_output", "train"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    steps_done: int
    losses: list[float] = field(default_factory=list)
    peak_mem_bytes: int = 0
    samples_per_s: list[float] = field(default_factory=list)
    skipped_steps: int = 0
    stopped_by: int | None = None  # the signal (SIGINT/SIGTERM) that ended the run before its last step
    total_steps: int = 0  # the steps the run was to take: train.steps, or what train.epochs came to
    stopped_early: str | None = None  # why eval.early_stopping ended the run before its last step
    resumed_at: int = 0  # the checkpoint's step this run continued from (losses cover only the steps after it)
    output_dir: Path | None = None  # where it wrote: metrics.jsonl, checkpoints, the exported model
    diverged: str | None = None  # the line said when the loss grew far past the first step's (run/guard.py)


Predictor = Callable[[Recipe, torch.device, int], "Prediction | None"]  # (recipe, device, parameters) -> what it said


def train(recipe: Recipe, source: str = "<recipe>", resume: bool = False, out_dir: Path | None = None,
          accept_changes: bool = False, predict: Predictor | None = None) -> RunResult:
    """Train `recipe` into out_dir. A SIGINT/SIGTERM ends the loop after the current step and the run
    ends normally with `stopped_by` set; any other end leaves out_dir resumable or, when no
    checkpoint was written, re-usable without --resume. `accept_changes` resumes despite changed
    settings (--resume-changed); `predict` is `ckrun estimate`'s fake step (the CLI passes runner/predict's,
    which this layer may not import): its time goes on the line before step 1, and a predicted peak over
    memory.max_mem stops a single-process run before it (a rank's share is step 1's to measure)."""
    out_dir = Path(out_dir or recipe.output.dir)
    with StopRequest() as stop, process_group_scope():
        ranks = join_group(recipe, source)
        with own_output(out_dir, ranks, source):  # nothing is written before this run holds out_dir
            prepare_output(out_dir, resume, source, recipe)
            result = _trained(recipe, source, resume, out_dir, stop, ranks, predict, accept_changes)
            if result.stopped_by and ranks.is_main:
                set_aside_unresumable(out_dir)
    return result


def _trained(recipe: Recipe, source: str, resume: bool, out_dir: Path, stop: StopRequest, ranks: Ranks,
             predict: Predictor | None, accept_changes: bool) -> RunResult:
    """train()'s run, in a directory it holds: build, resume, train, save and export."""
    check_room(recipe, planned_device_kind(recipe))  # one line, not the kernel's OOM killer halfway through the build
    log.info("building %s for %s", recipe.model.name, planned_device_kind(recipe))  # a large model takes a while
    trainer = Trainer(recipe, source, ranks)
    try:
        changes = resume_from_checkpoint(trainer, out_dir, source, accept_changes) if resume else {}
        prediction = _predicted(trainer, predict)  # over memory.max_mem: stopped here, before anything is written
    except BaseException:
        trainer.close()
        raise
    if trainer.ranks.is_main:
        write_output(out_dir / "recipe.yaml", dump_yaml(recipe.model_dump(mode="json")), source)
    log.info("training %s on %s: %d steps of batch %d (micro-batch %d), %s", recipe.model.name, trainer.device,
             trainer.total_steps, recipe.train.batch_size, recipe.micro_batch, recipe.precision)
    if trainer.ranks.is_main:
        seconds = prediction.step_s if prediction is not None else None
        for line in start_lines(recipe, trainer.device, seconds, _parameters(trainer), trainer.total_steps):
            log.info(line)
    try:
        result = _run(trainer, out_dir, stop, changes)
    except BuildError as err:  # the data failed mid-run (a corrupt image): the recipe's data to fix
        if trainer.ranks.is_main:
            set_aside_unresumable(out_dir)
        raise err.at(source) from None
    except BaseException:
        if trainer.ranks.is_main:
            set_aside_unresumable(out_dir)
        raise
    finally:
        trainer.close()
    return result


def _run(trainer: Trainer, out_dir: Path, stop: StopRequest, changes: dict) -> RunResult:
    """The steps, each record to the sinks (metrics.jsonl and the recipe's); `changes`: the settings
    --resume-changed accepted, recorded first."""
    recipe = trainer.recipe
    watch = LossWatch(_first_loss(out_dir) if trainer.step else None, getattr(recipe.train.optimizer, "lr", None))
    result = RunResult(trainer.step, total_steps=trainer.total_steps, resumed_at=trainer.step, output_dir=out_dir)
    total, every = trainer.total_steps, recipe.output.checkpoint_every
    output = recipe.output
    progress = Progress(total, trainer.step, output.log_every, output.log_seconds, show=trainer.ranks.is_main)
    evaluations = Evaluations(trainer, out_dir)
    try:
        with open_sinks(trainer, out_dir) as sinks:
            if changes:
                sinks.write({"step": trainer.step, "resumed_with_changes": changes})
            result.stopped_early = evaluations.stopped_already()
            while trainer.step < total and not result.stopped_early and not stop_agreed(stop, trainer.ranks):
                record = sinks.write(trainer.train_step())  # before the check, so the line of a non-finite step shows where it happened
                watch.check(record)
                _note(result, record)
                progress.update(record)
                try:
                    result.stopped_early = evaluations.after_step(sinks)
                except BaseException as err:
                    _keep_before_failed_eval(trainer, out_dir, watch, err)
                    raise
                if every and trainer.step % every == 0 and watch.finite(trainer.step):
                    _save(trainer, out_dir)
                elif trainer.saving is not None:
                    _save(trainer, out_dir, finish_only=True)  # a checkpoint written behind: complete once done
            if trainer.step < total and not result.stopped_early:
                evaluations.at_stop(sinks)  # Ctrl-C: the weights it leaves get their evaluation too
                sinks.ended = "stopped"
    finally:
        progress.close()
        evaluations.close()
    result.diverged = watch.diverged
    if trainer.step < total and not result.stopped_early:
        result.stopped_by = stop.signum
    if trainer.step > 0:  # a stopped run too: its last whole step is saved and exported
        try:
            finish_run(trainer, out_dir, evaluations.best)
        except OSError as err:
            raise write_failure(err, out_dir / "model", trainer.source) from None
    if result.skipped_steps:
        log.info("fp16: %d of %d steps were skipped by the loss scaler", result.skipped_steps, len(result.losses))
    return result


def _predicted(trainer: Trainer, predict: Predictor | None) -> Prediction | None:
    """What the estimate says before step 1 (rank 0), its peak held to memory.max_mem (one process only)."""
    if predict is None or not trainer.ranks.is_main:
        return None
    prediction = predict(trainer.recipe, trainer.device, _parameters(trainer))
    if not trainer.ranks.joined:
        check_predicted_peak(prediction, trainer.recipe.memory.max_mem, trainer.device, trainer.limited_at_context)
    return prediction


def _parameters(trainer: Trainer) -> int:
    return sum(p.numel() for p in trainer.model.parameters())


def _first_loss(out_dir: Path) -> float | None:
    """The first step's loss a resumed run had (metrics.jsonl, cut back to the checkpoint), which divergence is
    measured against."""
    records = read_metrics_lines(out_dir / METRICS)[0] if (out_dir / METRICS).is_file() else []
    return next((r["loss"] for r in records if isinstance(r.get("loss"), float)), None)


def _keep_before_failed_eval(trainer: Trainer, out_dir: Path, watch: LossWatch, err: BaseException) -> None:
    """An evaluation that failed (a metric that raised, returned no number, never returned or ended the
    process) does not take the training so far with it: this step's state is saved before the run ends,
    so metrics.jsonl stays and --resume continues once the metric is fixed. One process only: a group's
    save is a collective, and a rank whose metric failed cannot know that the others' did too."""
    if isinstance(err, KeyboardInterrupt) or trainer.ranks.joined or not watch.finite(trainer.step):
        return
    log.warning("the evaluation after step %d failed; saving the training so far first (--resume continues from "
                "it once the evaluation is fixed)", trainer.step)
    try:
        save_state(trainer, out_dir / "checkpoints", save_checkpoint, wait=True)
    except Exception as save_err:  # noqa: BLE001 - the evaluation's error is the one to report
        log.warning("could not save step %d: %s", trainer.step, save_err)


def _save(trainer: Trainer, out_dir: Path, finish_only: bool = False) -> None:
    root = out_dir / "checkpoints"
    try:
        if finish_only:
            finish_saving(trainer, block=False)
        else:
            save_state(trainer, root, save_checkpoint)
    except OSError as err:
        raise write_failure(err, root / f"step-{trainer.step:08d}", trainer.source) from None


def _note(result: RunResult, record: dict) -> None:
    result.steps_done = record["step"]
    result.losses.append(record["loss"])
    result.samples_per_s.append(record["samples_per_s"])
    result.peak_mem_bytes = max(result.peak_mem_bytes, record["peak_mem_bytes"])
    result.skipped_steps += bool(record.get("skipped"))
