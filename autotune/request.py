"""What a tune is asked for, checked into a `TuneRequest` before anything starts: the recipe and its
overrides, the cap (autotune/cap.py's one parser), the budget, the GPU named, the ranks and the study's
directory. `ckrun tune` (autotune/cli_tune.py) and `ckrun.tune(...)` (autotune/api.py) both fill in a
`TuneOptions` and call `check_request`; a refusal is one InputError line naming the flag.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ckrun.runner.builders.checks import load_checked
from ckrun.runner.recipe.library import DEFAULT_RECIPE, resolve_recipe
from ckrun.runner.parallel.slurm import check_environment
from ckrun.runner.problems import InputError, Place, Problem
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.units import format_bytes
from ckrun.runner.recipe.yamlio import dump_yaml

from .cap import Cap
from .outputs.rank_tune import check_ranks
from .search.predicted import named_facts
from .search.study import Budget, process_started
from .tune import PREDICT_TRIALS, TRIALS, TuneOptions, TuneRequest

log = logging.getLogger(__name__)

PREDICT_BUDGET_S = 540.0  # tune --predict's --time-budget when none is given: ends within 10 minutes here


def check_request(options: TuneOptions) -> TuneRequest:
    """Check the options, the recipe and the environment: the request `tune` takes."""
    check_environment()  # a bad variable is one line before anything is read or started
    path, overrides = _recipe_source(options.recipe, list(options.overrides))
    recipe, doc = load_checked(path, overrides, user_code=False)  # the user's code is checked in the model child
    cap, budget = Cap.parse(options.max_mem, options.margin, ("--max-mem", "--margin")), _budget(options)
    gpu = named_facts(options, recipe)  # the device predictions are priced on (--gpu), when named
    check_ranks(recipe, str(path), options.nproc)
    directory = _directory(options.output, recipe)
    log.info("tune: %s, batch %d, on %s; cap %s, limit %s", recipe.model.name, recipe.train.batch_size,
             recipe.train.device, format_bytes(cap.bytes), cap.describe())
    log.debug("tune: resolved recipe:\n%s", dump_yaml(recipe.model_dump(mode="json")))
    return TuneRequest(path, overrides, recipe, doc, cap, budget, directory, options, gpu)


def _recipe_source(given: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """RECIPE may be left out: `ckrun tune train.steps=5 --max-mem 1GB` has overrides only."""
    if given is not None and "=" in str(given) and not Path(given).exists():
        overrides.insert(0, given)
        given = None
    if given is not None:
        return resolve_recipe(str(given)), overrides
    if Path("ckrun.yaml").is_file():
        log.info("tune: no recipe given: using ./ckrun.yaml")
        return Path("ckrun.yaml"), overrides
    log.info("tune: no recipe given and no ./ckrun.yaml here: using the library's %s", DEFAULT_RECIPE)
    return resolve_recipe(DEFAULT_RECIPE), overrides


def _budget(options: TuneOptions) -> Budget:
    trials = options.trials if options.trials is not None else PREDICT_TRIALS if options.predict else TRIALS
    if trials < 1:
        raise _bad("--trials", f"at least 1 plan must be measured but got {trials}")
    if options.finalists < 0:
        raise _bad("--finalists", f"cannot be negative but got {options.finalists}")
    if options.probe_timeout <= 0 or options.warmup_steps < 0 or options.timed_steps < 1:
        raise _bad("--probe-timeout/--warmup-steps/--timed-steps", "need a positive timeout, warm-up >= 0, timed >= 1")
    seconds = parse_duration(options.time_budget) if options.time_budget is not None else None
    if seconds is None and options.predict:
        seconds = PREDICT_BUDGET_S
        log.info("tune: --predict: a time budget of %g min (--time-budget changes it): a large model's predictions "
                 "take seconds each, and a predicted search should answer in minutes", seconds / 60)
    return Budget(trials, seconds, process_started())


def parse_duration(text: str | float) -> float:
    """Seconds of `90s`, `10m`, `1h` (or a number of seconds)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if not match or float(match[1]) <= 0:
        raise _bad("--time-budget", f"{text!r} is not a duration; write it like 90s, 10m or 1h")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def _bad(flag: str, message: str) -> InputError:
    return InputError([Problem(Place(flag), "", message)])


def _directory(output: str | Path | None, recipe: Recipe) -> Path:
    if output:
        directory = Path(output)
    else:
        directory = Path(recipe.output.dir) / "tune"
        log.info("tune: study directory %s (the recipe's output.dir + /tune; --output to change)", directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory
