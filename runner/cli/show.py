"""`ckrun show RECIPE [k=v ...]`: the resolved recipe (defaults filled in, overrides applied) as YAML."""

from __future__ import annotations

from ..library import resolve_recipe
from ..load import load_recipe_document
from ..located import located_errors
from ..yamlio import dump_yaml
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--blocks", action="store_true", help="list the model's repeated blocks instead")


def run(args) -> int:
    path = resolve_recipe(args.recipe)
    recipe, doc = load_recipe_document(path, args.overrides)
    if args.blocks:
        from ..memory.blocks import print_blocks

        with located_errors(doc):
            return print_blocks(recipe, str(path))
    print(dump_yaml(recipe.model_dump(mode="json")), end="")
    return 0


COMMAND = Command(
    "show", "print the resolved recipe as YAML (or its blocks with --blocks)", add_arguments, run,
    epilog="examples:\n  ckrun show recipes/bert_tiny.yaml train.steps=10\n  ckrun show bert_large --blocks",
)
