"""`ckrun run RECIPE [k=v ...]` (or just `ckrun RECIPE ...`): train it.

Every way a run can end has one line and its own exit status: 0 done, 2 bad input (located in
the recipe even when found while building), 3 over memory.max_mem or out of memory, 4 a loss
that is not a number, 5 output that could not be written (disk full), 130/143 stopped by
SIGINT/SIGTERM after a whole step.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..library import resolve_recipe
from ..load import load_recipe_document
from ..located import located_errors
from ..problems import EXIT_CANNOT_WRITE, EXIT_NON_FINITE, EXIT_OVER_CAP
from . import Command, add_recipe_arguments

log = logging.getLogger(__name__)


PREDICT_FROM = 10_000_000  # parameters: a smaller model's first step comes within seconds, unannounced


def predicted_step(recipe, device, parameters: int) -> float | None:
    """Seconds a step, from the time model on this device's facts (`ckrun estimate`), for the line
    before step 1; None for a small model, a device the table lacks, or a model fake tensors cannot run."""
    if parameters < PREDICT_FROM:
        return None
    from ..predict.estimate import EstimateUnavailable, Estimator
    from ..predict.hardware import this_cpu, this_gpu

    facts = this_gpu() if device.type == "cuda" else this_cpu()
    if facts is None:
        return None
    log.info("predicting the step time on %s (ckrun estimate's fake step)", facts.name)
    try:
        return Estimator(recipe, device.type, facts).estimate().time.seconds
    except (EstimateUnavailable, ValueError) as err:
        log.debug("no predicted step time: %s", err)
        return None


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="where to train (the same as "
                        "train.device=...; auto takes the GPU when there is one)")
    parser.add_argument("--nproc", type=int, metavar="N", help="start N ranks on this machine through torchrun "
                        "(distributed.strategy ddp or fsdp); under srun, on each node of one task per node; under a "
                        "torchrun you started, or srun with a task per GPU, leave it out")


def run(args) -> int:
    from ..train.guard import NonFiniteLoss, stop_line
    from ..train.loop import MemoryCapExceeded, OutOfMemory, train
    from ..train.output import OutputError

    path = resolve_recipe(args.recipe)
    if args.device is not None:  # a flag for what people look for first; the override does the work
        args.overrides = [*args.overrides, f"train.device={args.device}"]
    recipe, doc = load_recipe_document(path, args.overrides)
    if args.nproc is not None:  # this process starts the ranks; each of them comes back through here without it
        from ..train.ownership import launch_owned

        argv = [args.recipe, *args.overrides, *(["--resume"] if args.resume else [])]
        return launch_owned(recipe, str(path), argv, args.nproc, args.resume, args.verbose)
    try:
        with located_errors(doc):
            result = train(recipe, str(path), resume=args.resume, predict_step=predicted_step)
    except MemoryCapExceeded as err:
        _say(f"ckrun: {err}; {err.advice}", every_rank=isinstance(err, OutOfMemory))
        return EXIT_OVER_CAP
    except NonFiniteLoss as err:
        _say(f"ckrun: {err}")
        return EXIT_NON_FINITE
    except OutputError as err:
        print(f"ckrun: {err.strerror}", file=sys.stderr)
        return EXIT_CANNOT_WRITE
    if result.stopped_by:
        if not _is_rank_zero():  # rank 0 says it for the group
            return 128 + result.stopped_by
        print(stop_line(result.stopped_by, result.steps_done, result.total_steps, Path(recipe.output.dir)), file=sys.stderr)
        return 128 + result.stopped_by
    if result.losses:
        from ..train.progress import done_line

        log.info(done_line(result, Path(recipe.output.dir)))
    return 0


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _say(line: str, every_rank: bool = False) -> None:
    """One line on stderr; under torchrun only from rank 0 when every rank ends for the same reason
    (the cap and the loss are reduced over the ranks, so all of them see the same peak and loss)."""
    if every_rank or _is_rank_zero():
        print(line, file=sys.stderr)


COMMAND = Command(
    "run", "train a recipe (the default verb: `ckrun RECIPE` is `ckrun run RECIPE`)", add_arguments, run,
    epilog="examples:\n  ckrun recipes/bert_tiny.yaml\n  ckrun recipes/bert_tiny.yaml train.steps=100 memory.micro_batch=4\n"
    "  ckrun recipes/bert_tiny.yaml --resume\n\n"
    "exit status: 0 done, 2 bad input, 3 over memory.max_mem or out of memory, 4 non-finite loss,\n"
    "  5 output could not be written (disk full), 130/143 stopped by SIGINT/SIGTERM",
)
