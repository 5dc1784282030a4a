"""YAML file + overrides -> a validated Recipe, with every problem located and explained."""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..environment import IMPORT_ROOTS_ENV
from .key_tree import meant
from ..problems import InputError, KeyedError, Problem, dotted, suggest
from .recipe import Recipe
from .yamlio import Document, apply_overrides, load_document, parse_document


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    return load_recipe_document(path, overrides)[0]


def load_recipe_document(path: str | Path, overrides: list[str] = ()) -> tuple[Recipe, Document]:
    """Read, override and validate against the schema; raises InputError listing every problem at once.
    The verbs that use a recipe load it with runner/builders/checks.py's `load_checked`, which checks more."""
    doc = read_document(path, overrides)
    return validate_document(doc), doc


def read_document(path: str | Path, overrides: list[str] = ()) -> Document:
    add_import_root(Path(path).parent)  # a python model's module may sit beside its recipe
    doc = load_document(Path(path))
    return apply_overrides(doc, list(overrides)) if overrides else doc


_IMPORT_ROOTS: list[str] = []  # folders added for user code, in the order they are searched


def add_import_root(folder: str | Path) -> None:
    """Let `package.module:factory` be found in `folder` (the recipe's, the working directory), as
    `python recipe_dir/script.py` would: appended to sys.path after installed packages (so a user's
    file never shadows a library, nor ckrun: a `runner.py` or `ckrun/` there is the user's own), and
    to CKRUN_IMPORT_ROOTS for ckrun's child processes, which start with `python -P` (no working
    directory first) and append these folders the same way when they import ckrun."""
    folder = str(Path(folder).resolve())
    if folder in _IMPORT_ROOTS:
        return
    _IMPORT_ROOTS.append(folder)
    if folder not in sys.path:
        sys.path.append(folder)
    inherited = os.environ.get(IMPORT_ROOTS_ENV, "")
    if folder not in inherited.split(os.pathsep):
        os.environ[IMPORT_ROOTS_ENV] = os.pathsep.join(filter(None, [inherited, folder]))


def import_roots() -> list[str]:
    """The folders `add_import_root` added, in the order they are searched."""
    return list(_IMPORT_ROOTS)


def recipe_from_text(text: str, source: str = "<recipe>") -> Recipe:
    return validate_document(parse_document(text, source))


class AcrossSections(InputError):
    """Problems only the recipe as a whole has (its sections are each valid): Recipe's own validators,
    which pydantic runs only once every section validated."""


def validate_document(doc: Document) -> Recipe:
    unusable = _unusable_values(doc.data, (), doc)
    try:
        recipe = Recipe.model_validate(doc.data)
    except ValidationError as err:
        flagged = {problem.key for problem in unusable}  # pydantic's complaint about the same value adds nothing
        problems = sorted(unusable + [p for p in _problems(err, doc) if p.key not in flagged],
                          key=lambda p: (p.place.line, p.key))
        whole = not unusable and all(error["loc"] == () for error in err.errors(include_url=False))
        raise (AcrossSections if whole else InputError)(problems) from None
    if unusable:
        raise InputError(unusable)
    return recipe


FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = (1 << 63) - 1


def _unusable_values(data: Any, path: tuple, doc: Document) -> list[Problem]:
    """Values anywhere in the recipe (model.config too) that training cannot use: nan, inf (YAML
    reads 1e400 as inf), floats beyond float32's range, integers beyond int64's, and keys or
    strings holding control characters (YAML's "\\0" escape puts a NUL into a path)."""
    if isinstance(data, dict):
        return [p for key, value in data.items()
                for p in _unusable(key, path + (key,), doc) + _unusable_values(value, path + (key,), doc)]
    if isinstance(data, list):
        return [p for i, value in enumerate(data) for p in _unusable_values(value, path + (i,), doc)]
    return _unusable(data, path, doc)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _unusable(value: Any, path: tuple, doc: Document) -> list[Problem]:
    message = None
    if isinstance(value, float) and math.isnan(value):
        message = "nan is not a number training can use; give a finite value"
    elif isinstance(value, float) and math.isinf(value):
        message = f"{value} is not finite (YAML reads numbers past 1.8e308 as inf); give a finite value"
    elif isinstance(value, float) and abs(value) > FLOAT32_MAX:
        message = f"{value:.3g} is beyond float32's range (3.4e38): training would compute inf; give a smaller value"
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
        message = "this integer is beyond int64's range (9.2e18), which torch cannot hold; give a smaller value"
    elif isinstance(value, str) and _CONTROL.search(value):
        char = _CONTROL.search(value).group()
        message = f"control character U+{ord(char):04X} in {_Shown(value)!r}; names, paths and settings are one plain line"
    return [Problem(doc.place_of(path), dotted(path), message)] if message else []


def _problems(err: ValidationError, doc: Document) -> list[Problem]:
    problems, typo_targets = [], set()
    for error in err.errors(include_url=False):
        path = _data_path(error["loc"], doc.data)
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, KeyedError):
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


_TAG_KEYS = ("policy", "name", "source", "strategy")


def _data_path(loc: tuple, data: Any) -> tuple:
    """pydantic's loc with the union-tag steps removed, so it names keys the user wrote. The data
    may hold anything the YAML did (a list where a tag belongs), so nothing here hashes a value."""
    path: list = []
    current = data
    for index, part in enumerate(loc):
        is_tag = isinstance(current, dict) and any(part == current.get(k) for k in _TAG_KEYS)
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
    kind, ctx, value = error["type"], error.get("ctx") or {}, _Shown(error.get("input"))
    if kind == "extra_forbidden":  # where in the schema such a key belongs, or a sibling it is a typo of
        return f"unknown key{meant(path, data, _known_keys(path[:-1], data))}"
    if kind == "missing":
        return "required key is missing"
    if kind == "union_tag_invalid":
        tags = [t.strip(" '") for t in ctx["expected_tags"].split(",")]
        key, tag = ctx["discriminator"].strip(chr(39)), _Shown(ctx["tag"])
        chosen = value.value.get(key) if isinstance(value.value, dict) else None
        if not isinstance(chosen, str):  # pydantic shows a list or a number as its str(): say what it is
            return f"{key} must be one of {', '.join(tags)} (got {_Shown(chosen)!r})"
        return f"unknown {key} {tag!r}{suggest(tag, tags)}; choose one of {', '.join(tags)}"
    if kind == "union_tag_not_found":
        return f"needs a {ctx['discriminator'].strip(chr(39))!s} key saying which kind it is"
    if kind == "literal_error":
        expected = [t.strip(" '") for t in ctx["expected"].replace(" or ", ",").split(",")]
        return f"{value!r} is not one of {', '.join(expected)}{suggest(value, expected)}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind.startswith("byte_size") and isinstance(value.value, (int, float)) and value.value < 0:
        return f"a size cannot be negative (got {value!r})"
    if kind.startswith("byte_size"):
        return f"{value!r} is not a size; write it like 40GB, 40GiB, 512MB or a number of bytes"
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {value!r})"


class _Shown:
    """A user's value as error messages show it: its repr, cut short (a value may be a 10,000-item
    list, or an int whose repr Python refuses to make)."""

    LIMIT = 60

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        try:
            text = repr(self.value)
        except ValueError:
            return "a huge integer"
        return text if len(text) <= self.LIMIT else f"{text[: self.LIMIT - 5]} ...{text[-1] if text[-1] in ')]}' else ''}"

    def __str__(self) -> str:
        return str(self.value) if isinstance(self.value, str) and len(self.value) <= self.LIMIT else repr(self)


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
