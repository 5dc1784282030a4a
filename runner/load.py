"""YAML file + overrides -> a validated Recipe, with every problem located and explained."""

from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .problems import InputError, Problem, dotted, suggest
from .recipe import KeyedValueError, Recipe
from .yamlio import Document, apply_overrides, load_document, parse_document


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    return load_recipe_document(path, overrides)[0]


def load_recipe_document(path: str | Path, overrides: list[str] = ()) -> tuple[Recipe, Document]:
    """Read, override and validate; raises InputError listing every problem at once."""
    doc = load_document(Path(path))
    if overrides:
        doc = apply_overrides(doc, list(overrides))
    return validate_document(doc), doc


def recipe_from_text(text: str, source: str = "<recipe>") -> Recipe:
    return validate_document(parse_document(text, source))


def validate_document(doc: Document) -> Recipe:
    try:
        return Recipe.model_validate(doc.data)
    except ValidationError as err:
        raise InputError(_problems(err, doc)) from None


def _problems(err: ValidationError, doc: Document) -> list[Problem]:
    problems, typo_targets = [], set()
    for error in err.errors(include_url=False):
        path = _data_path(error["loc"], doc.data)
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, KeyedValueError):
            path, message = cause.path, str(cause)
        else:
            message = _message(error, path, doc.data)
        if error["type"] == "extra_forbidden":
            typo_targets |= {path[:-1] + (k,) for k in _close_keys(path, doc.data)}
        # a missing key has no place of its own: point at the mapping that lacks it
        place = doc.place_of(path[:-1] if error["type"] == "missing" else path)
        problems.append((path, error["type"], Problem(place, dotted(path), message)))
    # `trian:` already says "did you mean train?"; "train is missing" would only repeat it
    kept = [p for path, kind, p in problems if not (kind == "missing" and path in typo_targets)]
    return sorted(dict.fromkeys(kept), key=lambda p: (p.place.line, p.key))


def _close_keys(path: tuple, data: Any) -> list[str]:
    return difflib.get_close_matches(str(path[-1]), _known_keys(path[:-1], data), n=1, cutoff=0.6)


_TAG_KEYS = ("policy", "name", "source")


def _data_path(loc: tuple, data: Any) -> tuple:
    """pydantic's loc with the union-tag steps removed, so it names keys the user wrote."""
    path: list = []
    current = data
    for index, part in enumerate(loc):
        is_tag = isinstance(current, dict) and part in {current.get(k) for k in _TAG_KEYS}
        if is_tag and index < len(loc) - 1:
            continue  # the tag pydantic inserts for a discriminated union member
        if isinstance(current, dict) and part in current:
            path.append(part)
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            path.append(part)
            current = current[part]
        elif isinstance(part, str) and (part.startswith(("function-", "tagged-union", "union")) or "[" in part):
            continue
        else:
            path.append(part)
            current = None
    return tuple(path)


def _message(error: dict, path: tuple, data: Any) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        return f"unknown key{suggest(path[-1], _known_keys(path[:-1], data))}"
    if kind == "missing":
        return "required key is missing"
    if kind == "union_tag_invalid":
        tags = [t.strip(" '") for t in ctx["expected_tags"].split(",")]
        return f"unknown {ctx['discriminator'].strip(chr(39))} {ctx['tag']!r}{suggest(ctx['tag'], tags)}; choose one of {', '.join(tags)}"
    if kind == "union_tag_not_found":
        return f"needs a {ctx['discriminator'].strip(chr(39))!s} key saying which kind it is"
    if kind == "literal_error":
        expected = [t.strip(" '") for t in ctx["expected"].replace(" or ", ",").split(",")]
        return f"{value!r} is not one of {', '.join(expected)}{suggest(value, expected)}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind.startswith("byte_size"):
        return f"{value!r} is not a size; write it like 40GB, 40GiB, 512MB or a number of bytes"
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {value!r})"


def _known_keys(path: tuple, data: Any) -> list[str]:
    """Field names of the schema section at `path`, following union tags through `data`."""
    model: Any = Recipe
    for part in path:
        field = model.model_fields.get(part) if _is_model(model) else None
        if field is None:
            return []
        data = data.get(part) if isinstance(data, dict) else None
        model = _pick_member(field.annotation, data)
    return list(model.model_fields) if _is_model(model) else []


def _pick_member(annotation: Any, data: Any) -> Any:
    members = [a for a in _flatten(annotation) if _is_model(a)]
    for member in members:
        for name, field in member.model_fields.items():
            if typing.get_origin(field.annotation) is typing.Literal and isinstance(data, dict):
                if data.get(name) in typing.get_args(field.annotation):
                    return member
    return members[0] if members else None


def _flatten(annotation: Any) -> list:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _flatten(arg)]
    return [annotation]


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)
