"""The recipe's held-out evaluation (`eval:`): how often and on what, your own metrics, and what
watches a metric during the run (early stopping, the best weights kept). Evaluating is
runner/train/eval/'s; what needs the rest of the recipe (held-out data the source can give, a metric
the task reports) is checked by runner/recipe/recipe.py's Recipe.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..plan.choices import Strict
from ..problems import KeyedError
from .data import Data


class EarlyStopping(Strict):
    """Stop when `metric` has not improved by more than `min_delta` for `patience` evaluations in a
    row; the run then ends as a finished one does (saved and exported, exit 0)."""

    metric: str = "loss"
    """`loss`, `perplexity`, `accuracy` or a name eval.metrics returns."""
    patience: int = Field(default=3, gt=0)
    """Evaluations without improvement before the run stops."""
    min_delta: float = Field(default=0.0, ge=0)
    """The least change that counts as an improvement."""
    mode: Literal["min", "max"] | None = None
    """Whether smaller or larger is better; unset: max for accuracy, min for everything else."""


class BestWeights(Strict):
    """Keep the weights of the `keep` best evaluations by `metric` in OUTPUT_DIR/best/step-N (each a
    loadable export, as Lightning's ModelCheckpoint keeps its top k), and with `restore`, export the
    best of them as OUTPUT_DIR/model at the end (as the Trainer's load_best_model_at_end). The last
    step's full training state stays in checkpoints/, so --resume continues from it."""

    metric: str = "loss"
    """`loss`, `perplexity`, `accuracy` or a name eval.metrics returns."""
    mode: Literal["min", "max"] | None = None
    """Whether smaller or larger is better; unset: max for accuracy, min for everything else."""
    keep: int = Field(default=1, gt=0)
    """How many of the best evaluations' weights to keep (top k)."""
    restore: bool = True
    """Export the best evaluation's weights at the end instead of the last step's."""


class EvalSpec(Strict):
    """Held-out evaluation: loss, and perplexity (language models) or accuracy (classification)."""

    every: int = Field(default=0, ge=0)
    """Steps between evaluations; the run's last step is always evaluated, and so is the step a
    Ctrl-C (SIGINT/SIGTERM) stops after (0: only those)."""
    batches: int | None = Field(default=None, gt=0)
    """Batches of train.batch_size per evaluation, the same ones each time so evaluations compare.
    Unset: the whole held-out set, every sample once (synthetic data, which never ends: 4 batches)."""
    data: Data | None = None
    """Held-out data, written like the `data:` section. Unset: synthetic training data is evaluated
    on batches of its seed's stream that no training step draws; file data needs held-out files here."""
    metrics: list[str] = Field(default_factory=list)
    """Your own metrics, `package.module:function` each: called once per evaluation with two 1-D
    tensors, the top class of every sample (or labelled token) and the right answers; returns a
    number (recorded under the function's name) or a dict of named numbers."""
    early_stopping: EarlyStopping | None = None
    """End the run when an evaluation metric stops improving; needs eval.every."""
    best: BestWeights | None = None
    """Keep the best evaluations' weights, and export the best at the end; needs eval.every."""

    @model_validator(mode="after")
    def _best_needs_evaluations(self) -> EvalSpec:
        return self._watched_metric_is_evaluated("best", self.best)

    @model_validator(mode="after")
    def _early_stopping_needs_evaluations(self) -> EvalSpec:
        return self._watched_metric_is_evaluated("early_stopping", self.early_stopping)

    def _watched_metric_is_evaluated(self, key: str, watch: EarlyStopping | BestWeights | None) -> EvalSpec:
        """eval.best and eval.early_stopping watch a metric of the evaluations during the run: there must be
        some (eval.every), and they must report it (loss, perplexity, accuracy, or what eval.metrics returns)."""
        if watch is None:
            return self
        if not self.every:
            raise KeyedError(("eval", "every"), f"eval.{key} needs evaluations during the run; set eval.every to "
                             "the steps between them")
        if watch.metric not in ("loss", "perplexity", "accuracy") and not self.metrics:
            raise KeyedError(("eval", key, "metric"), f"the evaluation reports loss and perplexity or accuracy, "
                             f"not {watch.metric!r}; name one, or add eval.metrics")
        return self
