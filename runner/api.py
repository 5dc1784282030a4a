"""Training as a call: `ckrun.train("my.yaml", ["train.steps=10"])` runs what `ckrun my.yaml train.steps=10`
runs (runner/cli/run.py is its command line: it parses, calls `train_checked`, prints) and returns the
run's `RunResult`: the steps done, each step's loss, the peak, the output directory. Prints nothing;
what a run says goes to the log (`logging`), as every ckrun module's does.

Bad input is an InputError (one line per problem, `err.lines()`), a run over memory.max_mem a
MemoryCapExceeded, a loss that is not a number a NonFiniteLoss: the CkrunErrors `ckrun run` ends with.
A run stopped by SIGINT or SIGTERM returns with `stopped_by` set. One process: several ranks are
`ckrun RECIPE --nproc N` (or torchrun around a script that calls this).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from .builders.checks import load_checked
from .library import resolve_recipe
from .located import located_errors
from .parallel.slurm import check_environment
from .recipe import Recipe
from .train.loop import RunResult, train as train_recipe

log = logging.getLogger(__name__)

PREDICT_FROM = 10_000_000  # parameters: a smaller model's first step comes within seconds, unannounced


def train(recipe: str | Path, overrides: Sequence[str] = (), *, resume: bool = False,
          accept_changes: bool = False) -> RunResult:
    """Train a recipe (a file or a library name) with dotted overrides, in this process. `resume`:
    continue from output.dir's newest complete checkpoint; `accept_changes`: resume despite changed
    settings, which metrics.jsonl records (`ckrun run --resume-changed`)."""
    path, checked, doc = checked_recipe(recipe, overrides)
    return train_checked(path, checked, doc, resume=resume, accept_changes=accept_changes)


def checked_recipe(recipe: str | Path, overrides: Sequence[str]) -> tuple[Path, Recipe, object]:
    """The recipe's file, the recipe checked with its overrides, and its located document (for lines)."""
    check_environment()  # a bad variable is one line before anything is read or started
    path = resolve_recipe(str(recipe))
    checked, doc = load_checked(path, list(overrides))
    return path, checked, doc


def train_checked(path: Path, recipe: Recipe, doc, resume: bool = False, accept_changes: bool = False) -> RunResult:
    """Train a checked recipe; an error found while building names its line in `doc`."""
    with located_errors(doc):
        return train_recipe(recipe, str(path), resume=resume or accept_changes, accept_changes=accept_changes,
                            predict_step=predicted_step)


def predicted_step(recipe: Recipe, device, parameters: int) -> float | None:
    """Seconds a step, from the time model on this device's facts (`ckrun estimate`), for the line
    before step 1; None for a small model, a device the table lacks, or a model fake tensors cannot run."""
    if parameters < PREDICT_FROM:
        return None
    from .predict.estimate import EstimateUnavailable, Estimator
    from .predict.hardware import this_cpu, this_gpu

    facts = this_gpu() if device.type == "cuda" else this_cpu()
    if facts is None:
        return None
    log.info("predicting the step time on %s (ckrun estimate's fake step)", facts.name)
    try:
        return Estimator(recipe, device.type, facts).estimate().time.seconds
    except (EstimateUnavailable, ValueError) as err:
        log.debug("no predicted step time: %s", err)
        return None
