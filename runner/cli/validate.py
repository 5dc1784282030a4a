"""`ckrun validate RECIPE [k=v ...]`: every problem at once, or `OK`."""

from __future__ import annotations

from ..builders.checks import load_checked
from ..library import resolve_recipe
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)


def run(args) -> int:
    path = resolve_recipe(args.recipe)
    load_checked(path, args.overrides, build_own=True)  # a python model's factory called on the meta device too
    print(f"{path}: OK")
    return 0


COMMAND = Command(
    "validate", "check a recipe and report every problem, one line each", add_arguments, run,
    epilog="examples:\n  ckrun validate recipes/bert_large.yaml\n  ckrun validate my.yaml train.steps=10",
)
