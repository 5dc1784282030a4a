"""`ckrun validate RECIPE [k=v ...]`: every problem at once, or `OK`."""

from __future__ import annotations

from ..builders.checks import load_checked
from ..library import resolve_recipe
from ..located import located_errors
from . import Command, add_recipe_arguments


def add_arguments(parser):
    add_recipe_arguments(parser)


def check_machine(recipe) -> None:
    """The plan on the device the run takes here (CPU offload, ...), then the machine's room for the model."""
    import torch

    from ..memory.apply import check_combination
    from ..problems import keyed_error
    from ..train.run.room import check_room
    from ..train.trainer import planned_device_kind

    kind = planned_device_kind(recipe)
    try:
        check_combination(recipe.memory, torch.device(kind), recipe.step_facts())
    except ValueError as err:
        raise keyed_error(err, "<recipe>", "memory") from None
    check_room(recipe, kind)


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
