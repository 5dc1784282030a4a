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

from typing import TYPE_CHECKING

from .builders.checks import load_checked
from .recipe.library import resolve_recipe
from .recipe.located import located_errors
from .recipe.recipe import Recipe

if TYPE_CHECKING:  # the training stack (torch) is imported once the recipe has passed its checks
    from .train.loop import RunResult
    from .train.run.memory_cap import Prediction

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
    from .parallel.slurm import check_environment

    check_environment()  # a bad variable is one line before anything is read or started
    path = resolve_recipe(str(recipe))
    checked, doc = load_checked(path, list(overrides))
    return path, checked, doc


def train_checked(path: Path, recipe: Recipe, doc, resume: bool = False, accept_changes: bool = False) -> RunResult:
    """Train a checked recipe; an error found while building names its line in `doc`."""
    from .train.loop import train as train_recipe

    with located_errors(doc):
        return train_recipe(recipe, str(path), resume=resume or accept_changes, accept_changes=accept_changes,
                            predict=predicted)


def predicted(recipe: Recipe, device, parameters: int) -> Prediction | None:
    """What `ckrun estimate`'s fake step says before step 1: the step's time from the time model on this
    device's facts (a model past PREDICT_FROM parameters, a device the table has) and, under memory.max_mem,
    the peak the run holds to the cap before it starts; None when there is nothing to ask, or the model
    cannot run on fake tensors (then step 1 measures)."""
    from .predict.estimate import EstimateUnavailable, Estimator
    from .predict.hardware import this_cpu, this_gpu
    from .predict.plan_lines import plan_words
    from .train.run.memory_cap import Prediction

    facts = (this_gpu() if device.type == "cuda" else this_cpu()) if parameters >= PREDICT_FROM else None
    capped = recipe.memory.max_mem is not None
    if facts is None and not capped:
        return None
    log.info("predicting the step%s (ckrun estimate's fake step)", f" time on {facts.name}" if facts else
             "'s peak for memory.max_mem")
    try:
        estimator = Estimator(recipe, device.type, facts)
        estimate = estimator.estimate()
    except (EstimateUnavailable, ValueError) as err:
        log.debug("no prediction: %s", err)
        return None
    return Prediction(estimate.time.seconds if estimate.time else None, estimate.peak_bytes if capped else None,
                      exact=device.type == "cpu" and not estimator.routed.eager, plan=plan_words(recipe))
