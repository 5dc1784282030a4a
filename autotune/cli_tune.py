"""`ckrun tune [RECIPE] [k=v ...] --max-mem SIZE`: find the fastest memory plan under a cap,
write DIR/tuned.yaml, then train with it. This module is the command line: its flags (each a field of
`TuneOptions`, with its default), then `check_request` and `tune`, and what they return printed. The
tune itself is autotune/tune.py, the same call as `ckrun.tune(...)`.

Exit status: 0 a plan was found (and trained), 2 bad input, 3 nothing fits under the cap or no plan
could be measured (every probe failed: the line names the fault).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ckrun.runner.cli import Command, gpu_names
from ckrun.runner.recipe.library import DEFAULT_RECIPE
from ckrun.runner.problems import EXIT_BAD_INPUT, EXIT_NOTHING_FITS
from ckrun.runner.train.run.guard import stop_line

from .request import check_request
from .space.knobs import KNOBS
from .tune import PREDICT_TRIALS, TRIALS, Found, TuneOptions, tune

DEFAULTS = TuneOptions(max_mem="")  # each flag's default is the option's


def add_arguments(parser) -> None:
    parser.add_argument("recipe", nargs="?",
                        help=f"recipe file or library name; default ./ckrun.yaml, else {DEFAULT_RECIPE}")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.batch_size=32")
    parser.add_argument("--max-mem", required=True, metavar="SIZE", help="the cap on peak memory: 40GB, 40GiB, 512MB")
    parser.add_argument("--trials", type=int, default=DEFAULTS.trials,
                        help=f"most new plans to measure; the finalists' re-runs come on top (default {TRIALS}; with "
                             f"--predict, plans to predict: default {PREDICT_TRIALS})")
    parser.add_argument("--time-budget", metavar="DURATION",
                        help="wall-clock budget of the search from the process's start (its imports, the model's "
                             "facts, the solver, probes and the finalists' re-runs; the winner's training aside): no "
                             "probe starts that would end past it, the first excepted; the solver and whole-space "
                             "predictions get a quarter of it: 90s, 10m, 1h")
    parser.add_argument("--output", metavar="DIR", help="study directory (default: the recipe's output.dir + /tune); "
                        "the winner trains in the recipe's output.dir, which output.dir=... moves")
    parser.add_argument("--nproc", type=int, default=DEFAULTS.nproc, metavar="N",
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
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="the sampler's seed: the same seed proposes the same plans")
    parser.add_argument("--margin", type=float, default=DEFAULTS.margin,
                        help=f"fraction of the cap kept free (default {DEFAULTS.margin})")
    for knob in KNOBS:  # the options that open a knob the space otherwise pins
        if knob.flag:
            parser.add_argument(knob.flag.option, action="store_true", help=knob.flag.help)
    parser.add_argument("--finalists", type=int, default=DEFAULTS.finalists, metavar="K",
                        help="measure the K fastest plans until each has 3 runs, and rank them by the median "
                             f"(default {DEFAULTS.finalists}; 0 trusts one probe per plan)")
    parser.add_argument("--no-solver", action="store_true",
                        help="no per-block plans from the solver (which times each block in a short real run); "
                             "start from the usual rules only")
    parser.add_argument("--no-screen", action="store_true",
                        help="no predictions: probe every plan, also those the estimator puts over the cap, "
                             "and start at the whole batch")
    parser.add_argument("--probe-timeout", type=float, default=DEFAULTS.probe_timeout, metavar="SECONDS",
                        help="wall-clock limit of one probe, and of each step of the model child (building the "
                             "model, the estimator's warm-up, one prediction); a probe over it counts as "
                             f"infeasible, a prediction over it leaves its plan unscreened (default {DEFAULTS.probe_timeout:g})")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps,
                        help=f"untimed steps per probe (default {DEFAULTS.warmup_steps}: the peak is measured there, step 2 "
                             "being the first with optimizer state)")
    parser.add_argument("--timed-steps", type=int, default=DEFAULTS.timed_steps,
                        help=f"timed steps per probe; the median counts (default {DEFAULTS.timed_steps})")


def run(args) -> int:
    """Check the command line, the recipe and the environment, tune (autotune/tune.py), print what it found."""
    result = tune(check_request(TuneOptions.from_args(args)), on_found=_print_found)
    stopped = result.trained.stopped_by if result.trained is not None else None
    if stopped:
        print(stop_line(stopped, result.trained.steps_done, result.trained.total_steps, Path(result.recipe.output.dir)),
              file=sys.stderr)
        return 128 + stopped  # 130/143, as `ckrun run` stops
    return 0


def _print_found(found: Found) -> None:
    print(found.table)
    if found.change is not None:
        print(f"ckrun tune: {found.change}", flush=True)


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
