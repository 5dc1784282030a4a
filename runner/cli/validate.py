"""`ckrun validate RECIPE [k=v ...]`: every problem at once, or `OK`; for a recipe that names its device, also
what this machine cannot run (`check_machine`)."""

from __future__ import annotations

from ..builders.checks import load_checked
from ..recipe.library import resolve_recipe
from ..recipe.located import located_errors
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)


def check_machine(recipe) -> None:
    """For a recipe that names its device (train.device cpu or cuda), what `ckrun RECIPE` would refuse on
    this machine before building: the plan on that device (activation or optimizer offload on a CPU), then
    the machine's room for the model. With `auto` the device is wherever the recipe runs: the run checks."""
    if recipe.train.device == "auto":
        return
    import torch

    from ..memory.apply import check_combination
    from ..problems import keyed_error
    from ..train.run.room import check_room

    try:
        check_combination(recipe.memory, torch.device(recipe.train.device), recipe.step_facts())
    except ValueError as err:
        raise keyed_error(err, "<recipe>", "memory") from None
    check_room(recipe, recipe.train.device)


def run(args) -> int:
    path = resolve_recipe(args.recipe)
    recipe, doc = load_checked(path, args.overrides, build_own=True)  # a python model's factory called on the meta device too
    with located_errors(doc):  # what this machine cannot run, as `ckrun RECIPE` would refuse it before building
        check_machine(recipe)
    print(f"{path}: OK")
    return 0


COMMAND = Command(
    "validate", "check a recipe and report every problem, one line each", add_arguments, run,
    epilog="examples:\n  ckrun validate recipes/bert_large.yaml\n  ckrun validate my.yaml train.steps=10",
)
