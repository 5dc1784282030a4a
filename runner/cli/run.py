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

from . import Command, is_rank_zero, add_recipe_arguments

log = logging.getLogger(__name__)


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
    from ..api import checked_recipe, train_checked

    if args.device is not None:  # a flag for what people look for first; the override does the work
        args.overrides = [*args.overrides, f"train.device={args.device}"]
    path, recipe, doc = checked_recipe(args.recipe, args.overrides)  # a typo is said before torch is imported
    from ..train.run.guard import stop_line

    args.resume = args.resume or args.resume_changed
    if args.nproc is not None:  # this process starts the ranks; each of them comes back through here without it
        from ..train.run.ownership import launch_owned

        flags = ["--resume-changed"] if args.resume_changed else ["--resume"] if args.resume else []
        return launch_owned(recipe, str(path), [args.recipe, *args.overrides, *flags], args.nproc, args.resume,
                            args.verbose, accept_changes=args.resume_changed)
    result = train_checked(path, recipe, doc, resume=args.resume, accept_changes=args.resume_changed)
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
