"""The bundled recipe library: found the same way from a checkout and from an installed wheel.

The recipes are YAML files inside the `recipes` package (package data in the wheel), so
`importlib.resources` finds them wherever ckrun is installed. A recipe's library name is its
path inside the package without `.yaml`: `gpt2`, or `family/name` for a file in a sub-folder.
"""

from __future__ import annotations

import difflib
import shutil
from importlib import resources
from pathlib import Path

from ..problems import InputError, Place, Problem

DEFAULT_RECIPE = "bert_tiny"


def library_root() -> Path:
    return Path(str(resources.files("ckrun.recipes")))


def library_recipes() -> dict[str, Path]:
    """Library name -> path of every YAML under the recipes package, sorted by name."""
    root = library_root()
    return {path.relative_to(root).with_suffix("").as_posix(): path for path in sorted(root.rglob("*.yaml"))}


def resolve_recipe(name_or_path: str) -> Path:
    """A path to a recipe file, or a library name such as `gpt2`; an unknown name lists close ones."""
    path = Path(name_or_path).expanduser()
    try:
        if path.is_file():
            return path
        exists = path.exists()
    except OSError as err:  # a name too long for the file system, say
        raise InputError([Problem(Place(name_or_path), "", f"cannot read the file: {err.strerror}")]) from None
    if exists and name_or_path.removesuffix(".yaml") not in library_recipes():  # a directory, /dev/zero
        raise InputError([Problem(Place(name_or_path), "", "is not a regular file; a recipe is a YAML file")])
    return library_recipe(name_or_path, "no such recipe file or library recipe")


def library_recipe(name: str, missing: str = "no such library recipe") -> Path:
    """The library file called `name` (`.yaml` optional); an InputError naming close matches if none."""
    recipes = library_recipes()
    key = name[: -len(Path(name).suffix)] if name.endswith((".yaml", ".yml")) else name
    if key in recipes:
        return recipes[key]
    raise InputError([Problem(Place(name), "", f"{missing}{_close_names(key, recipes)}")])


def _close_names(name: str, recipes: dict[str, Path]) -> str:
    # Every name about as close as the best one, not just the best: `bert` is as close to
    # bert_base as to bert_tiny. A clear winner (`bert_tinny`) is named alone.
    ratio = {r: difflib.SequenceMatcher(None, name, r).ratio() for r in recipes}
    best = max(ratio.values(), default=0.0)
    close = [r for r in sorted(ratio, key=ratio.get, reverse=True) if ratio[r] >= max(0.5, best - 0.1)]
    close += [r for r in recipes if name and name in r and r not in close]  # `llama` -> llama_1b
    if close:
        return f" (did you mean {', '.join(close[:4])}?)"
    return f"; `ckrun ls` lists the library ({len(recipes)} recipes)"


def copy_recipe(name: str, dest: Path, force: bool = False) -> Path:
    """Copy library recipe `name`, comments and all, to `dest` (a file, or a folder to put it in).

    An existing file is kept unless `force`: a user's edited recipe is worth more than a copy."""
    source = library_recipe(name)
    target = dest / source.name if dest.is_dir() else dest
    if target.exists() and not force:
        raise InputError([Problem(Place(str(target)), "", "already exists; pass --force to overwrite it")])
    if not target.parent.is_dir():
        raise InputError([Problem(Place(str(target)), "", f"no folder {target.parent}; create it first")])
    shutil.copyfile(source, target)
    return target
