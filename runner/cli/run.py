"""`ckrun run RECIPE [k=v ...]` (or just `ckrun RECIPE ...`): train it.

Every way a run can end has one line and its own exit status: 0 done, 2 bad input (located in
the recipe even when found while building), 3 over memory.max_mem or out of memory, 4 a loss
that is not a number, 5 output that could not be written (disk full), 130/143 stopped by
SIGINT/SIGTERM after a whole step. The errors carry their statuses; runner/cli's `ending` says them.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..builders.checks import load_checked
from ..library import resolve_recipe
from ..located import located_errors
from . import Command, is_rank_zero, add_recipe_arguments

log = logging.getLogger(__name__)


PREDICT_FROM = 10_000_000  # parameters: a smaller model's first step comes within seconds, unannounced


def predicted(recipe, device, parameters: int):
    """What `ckrun estimate`'s fake step says before step 1: the step's time from the time model on this
    device's facts (a model past PREDICT_FROM parameters, a device the table has) and, under memory.max_mem,
    the peak the run holds to the cap before it starts; None when there is nothing to ask, or the model
    cannot run on fake tensors (then step 1 measures)."""
    from ..predict.estimate import EstimateUnavailable, Estimator
    from ..predict.hardware import this_cpu, this_gpu
    from ..train.loop import Prediction
    from .estimate import plan_words

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


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--resume-changed", action="store_true", help="--resume, accepting changed settings (batch "
                        "size, data, seed, precision, ...) that --resume refuses; the changes go to metrics.jsonl")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to train (the same as "
                        "train.device=...; auto takes the GPU when there is one)")
    parser.add_argument("--nproc", type=int, metavar="N", help="start N ranks on this machine through torchrun "
                        "(distributed.strategy ddp, fsdp, hsdp or tp); under srun, on each node of one task per node; under a "
                        "torchrun you started, or srun with a task per GPU, leave it out")


def run(args) -> int:
    from ..parallel.slurm import check_environment

    check_environment()  # a bad variable is one line before anything is read or started
    path = resolve_recipe(args.recipe)
    if args.device is not None:  # a flag for what people look for first; the override does the work
        args.overrides = [*args.overrides, f"train.device={args.device}"]
    recipe, doc = load_checked(path, args.overrides)  # a typo is said before torch is imported
    from ..train.loop import train
    from ..train.run.guard import stop_line

    args.resume = args.resume or args.resume_changed
    if args.nproc is not None:  # this process starts the ranks; each of them comes back through here without it
        from ..train.run.ownership import launch_owned

        flags = ["--resume-changed"] if args.resume_changed else ["--resume"] if args.resume else []
        return launch_owned(recipe, str(path), [args.recipe, *args.overrides, *flags], args.nproc, args.resume,
                            args.verbose, accept_changes=args.resume_changed)
    with located_errors(doc):
        result = train(recipe, str(path), resume=args.resume, accept_changes=args.resume_changed,
                       predict=predicted)
    if result.stopped_by:
        if not is_rank_zero():  # rank 0 says it for the group
            return 128 + result.stopped_by
        print(stop_line(result.stopped_by, result.steps_done, result.total_steps, Path(recipe.output.dir)), file=sys.stderr)
        return 128 + result.stopped_by
    if result.losses:
        from ..train.run.progress import done_line

        log.info(done_line(result, Path(recipe.output.dir)))
    return 0


COMMAND = Command(
    "run", "train a recipe (the default verb: `ckrun RECIPE` is `ckrun run RECIPE`)", add_arguments, run,
    epilog="examples:\n  ckrun recipes/bert_tiny.yaml\n  ckrun recipes/bert_tiny.yaml train.steps=100 memory.micro_batch=4\n"
    "  ckrun recipes/bert_tiny.yaml --resume\n\n"
    "exit status: 0 done, 2 bad input, 3 over memory.max_mem or out of memory, 4 non-finite loss,\n"
    "  5 output could not be written (disk full), 130/143 stopped by SIGINT/SIGTERM",
)
