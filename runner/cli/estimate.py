"""`ckrun estimate RECIPE [k=v ...] [--device cuda|cpu] [--json]`: predicted peak of one step, no GPU needed."""

from __future__ import annotations

import json
import time

from ..library import resolve_recipe
from ..load import load_recipe
from ..problems import InputError, Place, Problem, keyed_error
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device to predict for (default cuda: works without a GPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from ..memory.estimate import EstimateUnavailable, Estimator
    from ..memory.measure import format_bytes

    path = resolve_recipe(args.recipe)
    recipe = load_recipe(path, args.overrides)
    started = time.perf_counter()
    try:
        estimate = Estimator(recipe, args.device).estimate()
    except EstimateUnavailable as err:
        raise InputError([Problem(Place(str(path)), "model", f"prediction is unavailable: {err}; "
                                  "`ckrun tune` will measure this recipe instead")]) from None
    except ValueError as err:
        raise keyed_error(err, str(path), "memory") from None
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**estimate.record(), "seconds": round(seconds, 2)}))
        return 0
    print(f"{path}: predicted peak {format_bytes(estimate.peak_bytes)} per step on {args.device} "
          f"(batch {recipe.train.batch_size}, micro-batch {recipe.micro_batch}, {recipe.precision}, "
          f"checkpointing {recipe.memory.checkpointing.policy})")
    for category, count in estimate.breakdown.items():
        print(f"  {category:<16} {format_bytes(count):>10}")
    for note in estimate.notes:
        print(f"  note: {note}")
    for warning in estimate.warnings:
        print(f"  warning: {warning}")
    return 0


COMMAND = Command(
    "estimate", "predict a training step's peak memory on fake tensors (no GPU, no real memory)", add_arguments, run,
    epilog="examples:\n  ckrun estimate recipes/bert_large.yaml --device cuda\n"
    "  ckrun estimate recipes/bert_tiny.yaml --device cpu --json memory.micro_batch=4",
)
