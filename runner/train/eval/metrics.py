"""Custom evaluation metrics (`eval.metrics: [my_metrics:f1]`): functions of the held-out predictions.

A metric is called once per evaluation with two 1-D CPU tensors over the whole evaluation:
`predictions`, the top class of each sample (classification) or of each labelled token (language
models, seq2seq), and `labels`, the right answers in the same order. It returns a number, recorded
under the function's name, or a dict of named numbers. Top classes rather than logits keep a
language model's evaluation from holding [samples, tokens, vocabulary] floats (HF Trainer users
reduce them the same way with `preprocess_logits_for_metrics`).
"""

from __future__ import annotations

import math
import numbers

import torch

from ...builders.contract import where_raised
from ...builders.data import IGNORE
from ...builders.resolve import BuildError, resolve_import_path
from ...builders.user_code import Overdue, bounded

RESERVED = ("loss", "perplexity", "accuracy", "samples", "time_s")  # the evaluation's own names


class Metrics:
    """The recipe's metric functions and the predictions of one evaluation, gathered batch by batch."""

    def __init__(self, paths: list[str]):
        self.functions = [(path, path.partition(":")[2], resolve_import_path(path)) for path in paths]
        self.predictions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if not self.functions:
            return
        labelled = labels != IGNORE
        self.predictions.append(logits.argmax(-1)[labelled].cpu())
        self.labels.append(labels[labelled].cpu())

    def compute(self) -> dict[str, float]:
        """Every metric of the predictions gathered since the last call; a metric that raises, never
        returns (CKRUN_USER_CODE_TIMEOUT) or returns something else than numbers is one line naming it
        (a BuildError on eval.metrics)."""
        if not self.functions:
            return {}
        predictions, labels = torch.cat(self.predictions), torch.cat(self.labels)
        self.predictions, self.labels = [], []
        found: dict[str, float] = {}
        for index, (path, name, function) in enumerate(self.functions):
            try:
                with bounded(f"the evaluation metric {path}"):
                    value = function(predictions, labels)
            except Overdue as err:
                raise BuildError(f"eval.metrics.{index}", str(err)) from None
            except Exception as err:  # noqa: BLE001 - user code: one line naming it and where it raised
                raise BuildError(f"eval.metrics.{index}", f"{path} raised {type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:200]}{where_raised(err)}") from None
            found.update(_named(value, name, path, index))
        return found


def _named(value, name: str, path: str, index: int) -> dict[str, float]:
    values = dict(value) if isinstance(value, dict) else {name: value}
    for key, number in values.items():
        if isinstance(number, torch.Tensor) and number.numel() == 1:
            number = number.item()
        if not isinstance(number, numbers.Real) or isinstance(number, bool) or not math.isfinite(float(number)):
            raise BuildError(f"eval.metrics.{index}", f"{path} returned {str(number)[:60]!r} for {key!r}; return a "
                             "finite number or a dict of them")
        if key in RESERVED or not isinstance(key, str):
            raise BuildError(f"eval.metrics.{index}", f"{path} returned a metric named {key!r}; name it something "
                             f"other than {', '.join(RESERVED)}")
        values[key] = float(number)
    return values
