"""`ckrun show RECIPE [k=v ...]`: the resolved recipe (defaults filled in, overrides applied) as YAML."""

from __future__ import annotations

from ..builders.checks import load_checked
from ..recipe.library import resolve_recipe
from ..recipe.located import located_errors
from ..problems import InputError, Place, Problem, keyed_error
from ..recipe.yamlio import dump_yaml
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--blocks", action="store_true", help="list the model's repeated blocks instead")
    parser.add_argument("--costs", action="store_true",
                        help="per block: bytes kept for backward under keep/recompute/selective/offload (estimated "
                             "on fake tensors) and recompute time (a short real run)")
    parser.add_argument("--json", action="store_true", help="with --costs: print one JSON object")


def run(args) -> int:
    path = resolve_recipe(args.recipe)
    recipe, doc = load_checked(path, args.overrides)
    if args.blocks:
        with located_errors(doc):
            return print_blocks(recipe, str(path))
    if args.costs:
        with located_errors(doc):
            return print_costs(recipe, str(path), args.json)
    print(dump_yaml(recipe.model_dump(mode="json")), end="")
    return 0


def print_blocks(recipe, source: str = "<recipe>") -> int:
    """`ckrun show RECIPE --blocks`: the blocks a plan's indices refer to, built on the meta device."""
    from ..builders.model import build_model, count_parameters
    from ..memory.blocks import find_blocks

    try:
        model = build_model(recipe.model, device="meta", weights=False)
        blocks = find_blocks(model, recipe.memory.blocks)
    except ValueError as err:  # a KeyedError keeps its key (the model, the data); the plan's start with theirs
        raise keyed_error(err, source, "memory") from None
    classes = sorted({type(block.module).__name__ for block in blocks})
    print(f"{blocks.container_name or type(model).__name__}: {len(blocks)} blocks ({', '.join(classes)})")
    width = max(len(block.name) for block in blocks)
    for block in blocks:
        print(f"{block.index:>4}  {block.name:<{width}}  {count_parameters(block.module):>14,} parameters")
    return 0


def print_costs(recipe, source: str, as_json: bool) -> int:
    """`ckrun show RECIPE --costs`: the per-block cost table at the recipe's own micro-batch and
    precision, on the device it trains on (a short real run times the recompute: 2 steps)."""
    import json

    import torch

    from ..predict.block_costs import cost_table, format_table
    from ..predict.estimate import EstimateUnavailable, Estimator
    from ..predict.plan_lines import plan_lines_quiet

    cuda = recipe.train.device == "cuda" or (recipe.train.device == "auto" and torch.cuda.is_available())
    try:
        with plan_lines_quiet():
            table = cost_table(Estimator(recipe, "cuda" if cuda else "cpu"), recipe.micro_batch, recipe.precision, 2)
    except EstimateUnavailable as err:
        raise InputError([Problem(Place(source), "model", f"per-block costs are unavailable: {err}")]) from None
    except ValueError as err:
        raise keyed_error(err, source, "memory") from None
    print(json.dumps(table.record()) if as_json else format_table(table))
    return 0


COMMAND = Command(
    "show", "print the resolved recipe as YAML (or its blocks with --blocks)", add_arguments, run,
    epilog="examples:\n  ckrun show recipes/bert_tiny.yaml train.steps=10\n  ckrun show bert_large --blocks\n"
    "  ckrun show bert_tiny --costs memory.micro_batch=4",
)
