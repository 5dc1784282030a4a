"""`ckrun tune [RECIPE] [k=v ...] --max-mem SIZE`: find the fastest memory plan under a cap,
write DIR/tuned.yaml, then train with it. This module is the command line: its flags, and each
checked into one line before anything starts; the tune itself is autotune/tune.py.

Exit status: 0 a plan was found (and trained), 2 bad input, 3 nothing fits under the cap or no plan
could be measured (every probe failed: the line names the fault).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from ckrun.runner.builders.checks import load_checked
from ckrun.runner.cli import Command, gpu_names
from ckrun.runner.library import DEFAULT_RECIPE, resolve_recipe
from ckrun.runner.parallel.slurm import check_environment
from ckrun.runner.problems import EXIT_BAD_INPUT, EXIT_NOTHING_FITS, InputError, Place, Problem
from ckrun.runner.recipe import Recipe
from ckrun.runner.units import format_bytes
from ckrun.runner.yamlio import dump_yaml

from .cap import Cap
from .outputs.rank_tune import check_ranks
from .search.predicted import named_facts
from .search.study import Budget, process_started
from .space.knobs import KNOBS
from .tune import TuneOptions, TuneRequest, tune

log = logging.getLogger(__name__)

PREDICT_BUDGET_S = 540.0  # tune --predict's --time-budget when none is given: ends within 10 minutes here


def add_arguments(parser) -> None:
    parser.add_argument("recipe", nargs="?",
                        help=f"recipe file or library name; default ./ckrun.yaml, else {DEFAULT_RECIPE}")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.batch_size=32")
    parser.add_argument("--max-mem", required=True, metavar="SIZE", help="the cap on peak memory: 40GB, 40GiB, 512MB")
    parser.add_argument("--trials", type=int, default=20,
                        help="most new plans to measure; the finalists' re-runs come on top (default 20)")
    parser.add_argument("--time-budget", metavar="DURATION",
                        help="wall-clock budget of the search from the process's start (its imports, the model's "
                             "facts, the solver, probes and the finalists' re-runs; the winner's training aside): no "
                             "probe starts that would end past it, the first excepted; the solver and whole-space "
                             "predictions get a quarter of it: 90s, 10m, 1h")
    parser.add_argument("--output", metavar="DIR", help="study directory (default: the recipe's output.dir + /tune); "
                        "the winner trains in the recipe's output.dir, which output.dir=... moves")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="tune for N ranks on this machine (torchrun): the cap holds per rank, each probe is a "
                             "group of N ranks, and how they share the work joins the search: ddp, fsdp and FSDP's "
                             "knobs, hsdp:S (N >= 4) and tp:T (a model with a tensor-parallel plan) (default 1)")
    parser.add_argument("--no-train", action="store_true", help="stop after writing DIR/tuned.yaml")
    parser.add_argument("--predict", action="store_true",
                        help="predict every plan instead of measuring it (peak and step time on --gpu, a roofline): "
                             "no GPU needed, nothing trained; tuned.yaml is marked predicted")
    parser.add_argument("--gpu", metavar="NAME",
                        help=f"the GPU to predict for: {gpu_names()}, the name torch reports, or a facts .json "
                             "measured on it (default: this machine's GPU)")
    parser.add_argument("--resume", action="store_true", help="continue the study in DIR; finished trials are kept")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed proposes the same plans")
    parser.add_argument("--margin", type=float, default=0.05, help="fraction of the cap kept free (default 0.05)")
    for knob in KNOBS:  # the options that open a knob the space otherwise pins
        if knob.flag:
            parser.add_argument(knob.flag.option, action="store_true", help=knob.flag.help)
    parser.add_argument("--finalists", type=int, default=2, metavar="K",
                        help="measure the K fastest plans until each has 3 runs, and rank them by the median "
                             "(default 2; 0 trusts one probe per plan)")
    parser.add_argument("--no-solver", action="store_true",
                        help="no per-block plans from the solver (which times each block in a short real run); "
                             "start from the usual rules only")
    parser.add_argument("--no-screen", action="store_true",
                        help="no predictions: probe every plan, also those the estimator puts over the cap, "
                             "and start at the whole batch")
    parser.add_argument("--probe-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="wall-clock limit of one probe, and of each step of the model child (building the "
                             "model, the estimator's warm-up, one prediction); a probe over it counts as "
                             "infeasible, a prediction over it leaves its plan unscreened (default 600)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="untimed steps per probe (default 2: the peak is measured there, step 2 being the first with optimizer state)")
    parser.add_argument("--timed-steps", type=int, default=3, help="timed steps per probe; the median counts (default 3)")


def run(args) -> int:
    """Check the command line, the recipe and the environment, then tune (autotune/tune.py)."""
    check_environment()  # a bad variable is one line before anything is read or started
    path, overrides = _recipe_source(args.recipe, args.overrides)
    recipe, doc = load_checked(path, overrides, user_code=False)  # the user's code is checked in the model child
    options = TuneOptions.from_args(args)
    cap, budget = _cap(args), _budget(args)
    gpu = named_facts(options, recipe)  # the device predictions are priced on (--gpu), when named
    check_ranks(recipe, str(path), args.nproc)
    directory = _directory(args.output, recipe)
    log.info("tune: %s, batch %d, on %s; cap %s, limit %s", recipe.model.name, recipe.train.batch_size,
             recipe.train.device, format_bytes(cap.bytes), cap.describe())
    log.debug("tune: resolved recipe:\n%s", dump_yaml(recipe.model_dump(mode="json")))
    return tune(TuneRequest(path, overrides, recipe, doc, cap, budget, directory, options, gpu))


def _recipe_source(given: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """RECIPE may be left out: `ckrun tune train.steps=5 --max-mem 1GB` has overrides only."""
    overrides = list(overrides)
    if given is not None and "=" in given and not Path(given).exists():
        overrides.insert(0, given)
        given = None
    if given is not None:
        return resolve_recipe(given), overrides
    if Path("ckrun.yaml").is_file():
        log.info("tune: no recipe given: using ./ckrun.yaml")
        return Path("ckrun.yaml"), overrides
    log.info("tune: no recipe given and no ./ckrun.yaml here: using the library's %s", DEFAULT_RECIPE)
    return resolve_recipe(DEFAULT_RECIPE), overrides


def _cap(args) -> Cap:
    try:
        cap = int(TypeAdapter(ByteSize).validate_python(args.max_mem))
    except ValidationError:
        raise _bad("--max-mem", f"{args.max_mem!r} is not a size; write it like 40GB, 40GiB or 512MB") from None
    if cap <= 0:
        raise _bad("--max-mem", f"the cap must be positive but got {args.max_mem!r}")
    if not 0 <= args.margin < 0.5:
        raise _bad("--margin", f"a fraction of the cap in [0, 0.5) but got {args.margin}")
    return Cap(cap, args.margin)


def _budget(args) -> Budget:
    if args.trials < 1:
        raise _bad("--trials", f"at least 1 plan must be measured but got {args.trials}")
    if args.finalists < 0:
        raise _bad("--finalists", f"cannot be negative but got {args.finalists}")
    if args.probe_timeout <= 0 or args.warmup_steps < 0 or args.timed_steps < 1:
        raise _bad("--probe-timeout/--warmup-steps/--timed-steps", "need a positive timeout, warm-up >= 0, timed >= 1")
    seconds = parse_duration(args.time_budget) if args.time_budget else None
    if seconds is None and args.predict:
        seconds = PREDICT_BUDGET_S
        log.info("tune: --predict: a time budget of %g min (--time-budget changes it): a large model's predictions "
                 "take seconds each, and a predicted search should answer in minutes", seconds / 60)
    return Budget(args.trials, seconds, process_started())


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match[1]) <= 0:
        raise _bad("--time-budget", f"{text!r} is not a duration; write it like 90s, 10m or 1h")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def _bad(flag: str, message: str) -> InputError:
    return InputError([Problem(Place(flag), "", message)])


def _directory(output: str | None, recipe: Recipe) -> Path:
    if output:
        directory = Path(output)
    else:
        directory = Path(recipe.output.dir) / "tune"
        log.info("tune: study directory %s (the recipe's output.dir + /tune; --output to change)", directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


COMMAND = Command(
    "tune", "search memory plans under a cap, write tuned.yaml, then train with the fastest", add_arguments, run,
    epilog="examples:\n  ckrun tune recipes/bert_large.yaml --max-mem 40GB\n"
    "  ckrun tune --max-mem 24GB --trials 30 --time-budget 20m      # ./ckrun.yaml, else the default recipe\n"
    "  ckrun tune bert_tiny --max-mem 150MB --no-train --output runs/t  # then: ckrun runs/t/tuned.yaml\n"
    "  ckrun tune bert_tiny --max-mem 150MB --output runs/t --resume    # continue a stopped study\n"
    "  ckrun tune recipes/bert_large.yaml --max-mem 40GB --predict --gpu h100   # no GPU needed: predicted\n"
    f"exit status: 0 tuned (and trained), {EXIT_BAD_INPUT} bad input, {EXIT_NOTHING_FITS} nothing fits under the cap "
    "or no plan could be measured (the line says why)",
)
