"""Every key the recipe's schema has, and where in it a key the user put in the wrong place belongs.

An unknown key is first compared with its siblings (`train.stpes`: did you mean steps?). When none is
close, the key may be right but misplaced: `optimizer.lr=1e-3` meant `train.optimizer.lr`, `steps: 10`
at the top meant `train.steps`, `train.lr` meant `train.optimizer.lr`. The schema's whole tree is
walked once (every member of every union, list items included), and the paths that end in the written
key are the candidates: those under the key's own parent first, then the shortest; with what the user
wrote beneath the key kept when the schema has it there too.
"""

from __future__ import annotations

import difflib
import functools
import types
import typing
from typing import Any

from pydantic import BaseModel

from ..problems import dotted, suggest
from .recipe import Recipe

SHOWN = 3  # candidates named when several are equally near


def meant(path: tuple, data: Any, siblings: list[str]) -> str:
    """' (did you mean ...?)' for the unknown key at `path` (its value in `data`, the parsed recipe): the same
    name elsewhere in the schema (`compression` at the top is memory.compression, not a typo of precision),
    else a sibling it is a typo of, else a name close to it elsewhere; '' when nothing is near."""
    name = path[-1]
    exact = [p for p in schema_paths() if p[-1] == name and p != tuple(path)] if isinstance(name, str) else []
    if exact:
        return _nearest(path, data, exact)
    sibling = suggest(name, siblings)
    if sibling or not isinstance(name, str):
        return sibling
    close = set(difflib.get_close_matches(name, {p[-1] for p in schema_paths()}, n=1, cutoff=0.8))
    return _nearest(path, data, [p for p in schema_paths() if p[-1] in close]) if close else ""


def _nearest(path: tuple, data: Any, candidates: list[tuple]) -> str:
    """The candidates under the key's own parent first, then the shortest, with what was written beneath."""
    parent = tuple(part for part in path[:-1] if isinstance(part, str))
    below = _written_below(path, data)
    ranked = sorted(candidates, key=lambda p: (p[: len(parent)] != parent, len(p), p))
    nearest = [p for p in ranked if _rank(p, parent) == _rank(ranked[0], parent)][:SHOWN]
    shown = [_shown(p + below if p + below in schema_paths() else p, parent) for p in nearest]
    return f" (did you mean {' or '.join(dict.fromkeys(shown))}?)"


def _shown(path: tuple, parent: tuple) -> str:
    """A sibling by its name, as a typo's suggestion is shown (`project` beside a list item's `projekt`),
    anything else by its whole dotted path."""
    return path[-1] if path[:-1] == parent else dotted(path)


def _rank(path: tuple, parent: tuple) -> tuple:
    return path[: len(parent)] != parent, len(path)


def _written_below(path: tuple, data: Any) -> tuple:
    """The keys the user wrote under the unknown one while each level holds one key (`optimizer.lr=...`)."""
    value = data
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
        else:
            return ()
    below = []
    while isinstance(value, dict) and len(value) == 1:
        key, value = next(iter(value.items()))
        if not isinstance(key, str):
            break
        below.append(key)
    return tuple(below)


@functools.cache
def schema_paths() -> frozenset[tuple[str, ...]]:
    """Every dotted key of the recipe's schema, as tuples: sections and leaves, through every union member."""
    found: set[tuple[str, ...]] = set()
    _walk(Recipe, (), found, set())
    return frozenset(found)


def _walk(model: type[BaseModel], prefix: tuple[str, ...], found: set, seen: set) -> None:
    if model in seen:  # a model that holds itself would never end
        return
    for name, field in model.model_fields.items():
        path = (*prefix, name)
        found.add(path)
        for member in _models_in(field.annotation):
            _walk(member, path, found, seen | {model})


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's value may be: itself, a union's members, a list's or dict's items."""
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, tuple):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []
