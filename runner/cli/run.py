"""`ckrun run RECIPE [k=v ...]` (or just `ckrun RECIPE ...`): train it."""

from __future__ import annotations

import logging
import sys

from ..library import resolve_recipe
from ..load import load_recipe
from ..problems import EXIT_OVER_CAP
from . import Command, add_recipe_arguments

log = logging.getLogger(__name__)


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")


def run(args) -> int:
    from ..train.loop import MemoryCapExceeded, train

    path = resolve_recipe(args.recipe)
    recipe = load_recipe(path, args.overrides)
    try:
        result = train(recipe, str(path), resume=args.resume)
    except MemoryCapExceeded as err:
        print(f"ckrun: {err}; lower memory.micro_batch or checkpoint more blocks", file=sys.stderr)
        return EXIT_OVER_CAP
    if result.losses:
        log.info("done: %d steps, loss %.4f -> %.4f, metrics in %s/metrics.jsonl", result.steps_done,
                 result.losses[0], result.losses[-1], recipe.output.dir)
    return 0


COMMAND = Command(
    "run", "train a recipe (the default verb: `ckrun RECIPE` is `ckrun run RECIPE`)", add_arguments, run,
    epilog="examples:\n  ckrun recipes/bert_tiny.yaml\n  ckrun recipes/bert_tiny.yaml train.steps=100 memory.micro_batch=4\n"
    "  ckrun recipes/bert_tiny.yaml --resume",
)
