"""`ckrun ls [FAMILY]`: the recipe library with each model's parameter count.

Counts are computed, never written down: every model is built on the meta device (shapes
only, no memory, well under a second each), so a count cannot drift from its recipe.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..problems import EXIT_BAD_INPUT, InputError, Place, Problem
from . import Command


@dataclass(frozen=True)
class Entry:
    name: str
    family: str
    parameters: int | None  # None when the recipe does not load or build
    description: str


def add_arguments(parser):
    parser.add_argument("family", nargs="?", help="only this family (language, vision, classic)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list: name, family, parameters (null if it does not build), description, path")


def run(args) -> int:
    from ..library import library_recipes

    recipes = library_recipes()
    everything = [describe(name, path) for name, path in recipes.items()]
    entries = [e for e in everything if args.family in (None, e.family)]
    if not entries:
        families = ", ".join(sorted({e.family for e in everything}))
        raise InputError([Problem(Place(args.family), "", f"no such family; the library has {families}")])
    entries.sort(key=lambda e: (_family_rank(e.family), e.family, e.name))
    if args.json:
        print(json.dumps([{**asdict(e), "path": str(recipes[e.name])} for e in entries], indent=1))
    else:
        print_table(entries)
    return EXIT_BAD_INPUT if any(e.parameters is None for e in everything) else 0


def describe(name: str, path: Path) -> Entry:
    """The row of one recipe; a broken one is reported on stderr and shown without a count."""
    from ..builders.model import build_model, count_parameters
    from ..load import load_recipe

    try:
        recipe = load_recipe(path)
    except InputError as err:
        print(f"ckrun ls: {err.problems[0]}", file=sys.stderr)
        return Entry(name, "?", None, f"(does not validate: ckrun validate {name})")
    try:
        count = count_parameters(build_model(recipe.model, device="meta"))
    except (ValueError, TypeError) as err:  # BuildError, or a factory rejecting its arguments
        print(f"ckrun ls: {path}: model: {err}", file=sys.stderr)
        count = None
    return Entry(name, recipe.family or "-", count, recipe.description)


def _family_rank(family: str) -> int:
    # the design's order: the models people train first, the teaching examples last
    order = ("language", "vision", "classic")
    return order.index(family) if family in order else len(order)


def format_count(count: int | None) -> str:
    """335.1M, 1.56B: three significant figures is what a reader compares model sizes by."""
    if count is None:
        return "?"
    for unit, size, digits in (("B", 1e9, 2), ("M", 1e6, 1), ("k", 1e3, 1)):
        if count >= size:
            return f"{count / size:.{digits}f}{unit}"
    return str(count)


def print_table(entries: list[Entry]) -> None:
    rows = [("NAME", "FAMILY", "PARAMS", "DESCRIPTION")]
    rows += [(e.name, e.family, format_count(e.parameters), e.description) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for name, family, params, description in rows:
        print(f"{name:<{widths[0]}}  {family:<{widths[1]}}  {params:>{widths[2]}}  {description}")


COMMAND = Command(
    "ls", "list the recipe library: name, family, parameter count, description", add_arguments, run,
    epilog="examples:\n  ckrun ls\n  ckrun ls vision\n  ckrun ls --json | jq -r '.[].name'\n  ckrun cp gpt2 my.yaml     # then edit my.yaml",
)
