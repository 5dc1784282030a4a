"""`ckrun cp NAME DEST [--force]`: copy a library recipe, comments and all, to edit it."""

from __future__ import annotations

from pathlib import Path

from . import Command


def add_arguments(parser):
    parser.add_argument("name", help="library recipe name, as `ckrun ls` lists it")
    parser.add_argument("dest", help="file to write, or an existing folder to put NAME.yaml in")
    parser.add_argument("--force", action="store_true", help="overwrite DEST if it exists")


def run(args) -> int:
    from ..recipe.library import copy_recipe

    target = copy_recipe(args.name, Path(args.dest).expanduser(), force=args.force)
    print(f"copied {args.name} to {target}; run it with: ckrun {target}")
    return 0


COMMAND = Command(
    "cp", "copy a library recipe (with its comments) to a file you can edit", add_arguments, run,
    epilog="examples:\n  ckrun cp bert_large my.yaml\n  ckrun cp gpt2 configs/            # writes configs/gpt2.yaml\n"
    "  ckrun cp gpt2 my.yaml --force     # overwrite my.yaml",
)
