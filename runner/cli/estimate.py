"""`ckrun estimate RECIPE [k=v ...] [--device cuda|cpu] [--json]`: predicted peak of one step, no GPU needed."""

from __future__ import annotations

import contextlib
import json
import logging
import time

from ..library import resolve_recipe
from ..load import load_recipe_document
from ..located import located_errors
from ..problems import InputError, Place, Problem, keyed_error
from ..units import format_bytes
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device to predict for (default cuda: works without a GPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--nproc", type=int, metavar="N", help="predict one of N ranks (distributed.strategy ddp "
                        "or fsdp): its share of the batch, FSDP's shards and gathered blocks, DDP's buckets")


def run(args) -> int:
    from ..predict.estimate import EstimateUnavailable, Estimator

    path = resolve_recipe(args.recipe)
    recipe, doc = load_recipe_document(path, args.overrides)
    started = time.perf_counter()
    if args.nproc is not None:  # one rank of N: runner/predict/ranks.py
        from ..dist.launch import check_launch
        from ..predict.ranks import per_rank

        check_launch(recipe, str(path), args.nproc)
        Estimator = per_rank(args.nproc, str(path))  # noqa: N806 - stands in for the class
    with located_errors(doc), _plan_lines_quiet():
        estimate = _estimate(Estimator, EstimateUnavailable, recipe, args.device, str(path))
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**estimate.record(), "seconds": round(seconds, 2)}))
        return 0
    per = f" per rank of {args.nproc}" if args.nproc else ""
    print(f"{path}: predicted peak {format_bytes(estimate.peak_bytes)} per step{per} on {args.device} "
          f"(batch {recipe.train.batch_size}, micro-batch {recipe.micro_batch}, {recipe.precision}, "
          f"checkpointing {recipe.memory.checkpointing.policy})")
    for category, count in estimate.breakdown.items():
        print(f"  {category:<16} {format_bytes(count):>10}")
    for note in estimate.notes:
        print(f"  note: {note}")
    for warning in estimate.warnings:
        print(f"  warning: {warning}")
    return 0


@contextlib.contextmanager
def _plan_lines_quiet():
    """The estimator applies the plan to a stand-in model; the lines a run prints for that ("checkpointing
    2 of 2 blocks") would only repeat the recipe above the prediction. Warnings still show; -v shows all."""
    logs = [logging.getLogger(name) for name in ("runner.memory", "runner.dist")]  # the plan; FSDP's sharding
    levels = [plan_log.level for plan_log in logs]
    for plan_log in logs:
        if not plan_log.isEnabledFor(logging.DEBUG):
            plan_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for plan_log, level in zip(logs, levels, strict=True):
            plan_log.setLevel(level)
def _estimate(estimator, unavailable, recipe, device: str, source: str):
    from ..build.resolve import BuildError
    from ..predict.estimate import Estimator
    from ..predict.fallback import estimate_or_probe

    try:
        if estimator is not Estimator:  # one rank of N: no real probe stands in for a fake process group
            return estimator(recipe, device).estimate()
        return estimate_or_probe(lambda estimator_class: estimator_class(recipe, device))
    except unavailable as err:
        raise InputError([Problem(Place(source), "model", f"prediction is unavailable: {err}; "
                                  "`ckrun tune` will measure this recipe instead")]) from None
    except BuildError as err:  # the model or data (it knows its key): not the memory plan
        raise err.as_input_error(source) from None
    except ValueError as err:
        raise keyed_error(err, source, "memory") from None


COMMAND = Command(
    "estimate", "predict a training step's peak memory on fake tensors (no GPU, no real memory)", add_arguments, run,
    epilog="examples:\n  ckrun estimate recipes/bert_large.yaml --device cuda\n"
    "  ckrun estimate recipes/bert_tiny.yaml --device cpu --json memory.micro_batch=4",
)
