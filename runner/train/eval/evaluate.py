"""Held-out evaluation during training: loss, and perplexity or accuracy by task.

Evaluation must leave training exactly as it would have been without it: it runs under
`torch.no_grad()` with the model in eval mode (no dropout draws, BatchNorm statistics left
alone), in the run's precision, and puts every RNG state back afterwards, so the training losses
with and without evaluation are bit-identical and a resumed run evaluates the same way.
An evaluation's batches are the same each time (a pure function of the seed), so the numbers
compare across steps and across runs.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

import torch

from ...builders.resolve import BuildError
from ...builders.sources import build_data
from ...recipe.recipe import LANGUAGE_TASKS, infer_task
from ..checkpoint.store import restore_rng_state, rng_state
from .metrics import Metrics
from ..step import call_model, label_count, loss_sum, predict_only_at

log = logging.getLogger(__name__)

# synthetic batches from this step on are evaluation's: no training run gets to 2**40 steps, so
# they are batches of the same distribution that training never sees
HELD_OUT_STEP = 1 << 40
SYNTHETIC_BATCHES = 4  # synthetic data never ends: eval.batches unset evaluates this many


@contextlib.contextmanager
def preserved_rng(device: torch.device):
    """Whatever runs inside may draw random numbers: the training RNG streams come out unchanged."""
    saved = rng_state(device)
    try:
        yield
    finally:
        restore_rng_state(saved, device)


def make_evaluator(trainer) -> Evaluator | None:
    """The recipe's evaluation, or None when it has no `eval:` section."""
    if trainer.recipe.eval is None:
        return None
    try:
        with preserved_rng(trainer.device):  # building data must not move the training streams either
            return Evaluator(trainer)
    except BuildError as err:
        key = err.key if err.key.startswith("eval.") or trainer.recipe.eval.data is None else f"eval.{err.key}"
        raise BuildError(key, str(err)).at(trainer.source) from None


class Evaluator:
    def __init__(self, trainer):
        recipe = trainer.recipe
        self.trainer, self.spec = trainer, recipe.eval
        data = self.spec.data
        if data is None:  # synthetic training data: later steps of its own stream
            self.source, self.first_step = build_data(recipe, trainer.model), HELD_OUT_STEP
            self.task = recipe.data.task or infer_task(recipe.model)
        else:
            if "task" in type(data).model_fields and data.task is None:
                data = data.model_copy(update={"task": recipe.data.task})  # python models name it once
            held_out = recipe.model_copy(update={"data": data})  # records: labels get the training data's ids
            self.source = build_data(held_out, trainer.model, getattr(trainer.data, "label_ids", None))
            self.first_step = 0
            self.task = data.task or infer_task(recipe.model)
        self.samples = self._sample_count(getattr(self.source, "rows", None))
        self.metrics = Metrics(self.spec.metrics)
        self.last_step: int | None = None  # the step evaluated last

    def _sample_count(self, rows: int | None) -> int:
        """Samples per evaluation: eval.batches of the batch, or (unset) every held-out row once."""
        batch = self.trainer.recipe.train.batch_size
        if self.spec.batches is None and rows and self.first_step == 0:
            log.info("eval: the whole held-out set, %d samples (%d batches of %d)", rows, -(-rows // batch), batch)
            return rows
        batches = self.spec.batches or SYNTHETIC_BATCHES
        where = "of the synthetic data (its stream from step 2**40, which no training step draws)" \
            if self.first_step else "of the held-out data"
        log.info("eval: %d batches of %d %s", batches, batch, where)
        return batches * batch

    def due(self, step: int) -> bool:
        return bool(self.spec.every and step % self.spec.every == 0) or step == self.trainer.total_steps

    def run(self) -> dict:
        """Evaluate the model as it is now; returns the metrics record {"step": N, "eval": {...}}."""
        trainer, model = self.trainer, self.trainer.model
        started, was_training = time.perf_counter(), model.training
        sums = {"loss": torch.zeros((), device=trainer.device), "labels": torch.zeros((), device=trainer.device),
                "correct": torch.zeros((), device=trainer.device)}
        with preserved_rng(trainer.device), torch.no_grad():
            model.eval()
            try:
                for batch in self._batches():
                    for start in range(0, len(batch.labels), trainer.recipe.micro_batch):
                        self._add(sums, batch.slice(start, start + trainer.recipe.micro_batch))
            finally:
                model.train(was_training)
        record = self._summary(sums, time.perf_counter() - started)
        self.last_step = trainer.step
        log.info("eval at step %d: %s", trainer.step, "  ".join(f"{k} {v:.4g}" for k, v in record.items()))
        return {"step": trainer.step, "eval": record}

    def _batches(self):
        """The evaluation's batches, the last one cut so that no sample counts twice."""
        size = self.trainer.recipe.train.batch_size
        for index in range(-(-self.samples // size)):
            batch = self.source.global_batch(self.first_step + index)
            keep = min(size, self.samples - index * size)
            yield (batch if keep == size else batch.slice(0, keep)).to(self.trainer.device)

    def _add(self, sums: dict, micro) -> None:
        forward = self.trainer.forward_model
        with self.trainer.precision.autocast(), predict_only_at(forward, micro.positions):
            logits = call_model(forward, micro)
        sums["loss"] += loss_sum(logits, micro.labels, micro.positions)
        sums["labels"] += label_count(micro.labels)
        if self.task not in LANGUAGE_TASKS:  # one label per sample: the top class is right or wrong
            sums["correct"] += (logits.argmax(-1) == micro.labels).sum()
        sparse = micro.positions is not None and logits.shape[1] == micro.positions.shape[1]
        self.metrics.add(logits, micro.labels.gather(1, micro.positions) if sparse else micro.labels)

    def _summary(self, sums: dict, seconds: float) -> dict:
        labels = sums["labels"].item()
        record = {"loss": sums["loss"].item() / labels}
        if self.task in LANGUAGE_TASKS:
            if record["loss"] < 700:  # exp overflows beyond; a model that far off has no useful perplexity
                record["perplexity"] = math.exp(record["loss"])
        else:
            record["accuracy"] = sums["correct"].item() / labels
        record.update(self.metrics.compute())
        record.update(samples=self.samples, time_s=seconds)
        return record
