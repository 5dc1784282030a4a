"""`ckrun ls [FAMILY]`: the recipe library with each model's parameter count.

Counts are computed: every model is built on the meta device (shapes only, no memory). Building
needs torch and transformers' modeling modules (seconds to import), so each count is kept in the
user's cache ($XDG_CACHE_HOME/ckrun/parameter_counts.json) under a key of everything it depends on:
the model section, the versions of torch, transformers and torchvision, and for a python model its
module file's content. A later `ls` builds only what changed. The library's own counts ship with it
(recipes/parameter_counts.json, under the same key less the versions), so a first `ls` builds
nothing; tests/runner/recipe/test_library.py builds every library model and holds that table to them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..builders.user_code import module_file
from ..problems import EXIT_BAD_INPUT, InputError, Place, Problem
from ..disk.user_cache import file_digest, key_of, read_table, write_table
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
    from ..recipe.library import library_recipes

    recipes = library_recipes()
    counts = read_table(COUNTS, _is_count)
    everything = [describe(name, path, counts) for name, path in recipes.items()]
    write_table(COUNTS, counts)
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


def describe(name: str, path: Path, counts: dict[str, int] | None = None) -> Entry:
    """The row of one recipe; a broken one is reported on stderr and shown without a count.
    `counts`: counts by `_count_key`, read and added to (None: build every model)."""
    from ..recipe.load import load_recipe

    try:
        recipe = load_recipe(path)
    except InputError as err:
        print(f"ckrun ls: {err.problems[0]}", file=sys.stderr)
        return Entry(name, "?", None, f"(does not validate: ckrun validate {name})")
    key = _count_key(recipe.model)
    count = counts.get(key) if counts is not None and key else None
    if count is None and key:
        count = shipped_counts().get(_count_key(recipe.model, versioned=False))
    if count is None:
        count = _built_count(recipe, path)
        if count is not None and counts is not None and key:
            counts[key] = count
    return Entry(name, recipe.family or "-", count, recipe.description)


def _built_count(recipe, path: Path) -> int | None:
    from ..builders.model import build_model, count_parameters

    try:
        return count_parameters(build_model(recipe.model, device="meta", weights=False))
    except (ValueError, TypeError) as err:  # BuildError, or a factory rejecting its arguments
        print(f"ckrun ls: {path}: model: {err}", file=sys.stderr)
        return None


def _count_key(model, versioned: bool = True) -> str | None:
    """What a count depends on, hashed; None when it cannot be told (a python model's file not found).
    `versioned`: with the installed torch, transformers and torchvision (the user's cache) or without
    (the shipped table, which the library's test holds to the versions it runs on)."""
    section = model.model_dump(mode="json")
    for key in ("revision", "lora"):  # newer than most counts kept: unset, they leave the keys as they were
        if section.get(key) is None:
            section.pop(key, None)
    parts = [json.dumps(section, sort_keys=True)]
    if model.source == "python":
        source = module_file(model.name.split(":")[0])
        if source is None:
            return None
        parts.append(file_digest(source))
    if not versioned:  # nor Python's: the table is one file for every install
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return key_of(parts, ("torch", "transformers", "torchvision"))


COUNTS = "parameter_counts.json"


def shipped_counts() -> dict[str, int]:
    """The library's counts by version-free key; empty when the table is missing or damaged (then built)."""
    from ..recipe.library import library_root

    try:
        table = json.loads((library_root() / COUNTS).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {key: row["parameters"] for key, row in table.items()
            if isinstance(row, dict) and _is_count(row.get("parameters"))}


def shipped_table(recipes: dict[str, Path]) -> dict[str, dict]:
    """What recipes/parameter_counts.json holds for `recipes`: each model's built count under its key."""
    from ..recipe.load import load_recipe

    table = {}
    for name, path in recipes.items():
        recipe = load_recipe(path)
        table[_count_key(recipe.model, versioned=False)] = {"recipe": name, "parameters": _built_count(recipe, path)}
    return dict(sorted(table.items(), key=lambda item: item[1]["recipe"]))


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
