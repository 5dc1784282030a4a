"""The bundled recipe library: found the same way from a checkout and from an installed wheel."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .problems import InputError, Place, Problem, suggest

DEFAULT_RECIPE = "bert_tiny"


def library_recipes() -> dict[str, Path]:
    """Library name (file stem, or family/stem) -> path of every YAML under the recipes package."""
    root = Path(str(resources.files("recipes")))
    found = {}
    for path in sorted(root.rglob("*.yaml")):
        found[path.stem] = path
    return found


def resolve_recipe(name_or_path: str) -> Path:
    """A path to a recipe file, or a library name such as `gpt2`; an unknown name lists close ones."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    recipes = library_recipes()
    name = Path(name_or_path).stem if name_or_path.endswith((".yaml", ".yml")) else name_or_path
    if name in recipes and not path.parent.parts:
        return recipes[name]
    hint = suggest(name, recipes)
    if not hint and not path.suffix:
        hint = f" (library recipes: {', '.join(sorted(recipes))})"
    raise InputError([Problem(Place(name_or_path), "", f"no such recipe file or library recipe{hint}")])
