"""Safe YAML with line numbers: the recipe loader and the `key=value` override parser.

Built on yaml.SafeLoader's composer so that no Python object can be constructed from a tag,
and every key and value keeps the place it came from. Duplicate keys and non-standard tags are
problems, reported together with every other problem in the file.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .problems import InputError, Place, Problem, dotted

Path_ = tuple[str | int, ...]

_STANDARD_TAGS = {
    f"tag:yaml.org,2002:{name}"
    for name in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")
}


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` and `3E5` as floats (YAML 1.1 demands a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class Document:
    """A YAML mapping as plain Python data plus where each key and value came from."""

    data: dict[str, Any]
    places: dict[Path_, Place] = field(default_factory=dict)
    source: str = "<recipe>"

    def place_of(self, path: Path_) -> Place:
        """The place of `path`: an override that set it or a key inside it, else its nearest ancestor."""
        for other, place in self.places.items():
            if place.override is not None and other[: len(path)] == path:
                return place
        for end in range(len(path), -1, -1):
            if path[:end] in self.places:
                return self.places[path[:end]]
        return Place(self.source)


def load_document(path: Path) -> Document:
    """Read a recipe file; all problems in it are raised together as one InputError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError([Problem(Place(str(path)), "", f"cannot read the file: {err}")]) from None
    return parse_document(text, str(path))


def parse_document(text: str, source: str) -> Document:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = Place(source, mark.line + 1, mark.column + 1) if mark else Place(source)
        raise InputError([Problem(where, "", f"invalid YAML: {err.problem or err}")]) from None
    finally:
        loader.dispose()
    doc = Document({}, {}, source)
    problems: list[Problem] = []
    if node is None:
        problems.append(Problem(Place(source, 1, 1), "", "the file is empty; a recipe is a mapping"))
    elif not isinstance(node, yaml.MappingNode):
        problems.append(Problem(_place(source, node), "", "a recipe must be a mapping of keys"))
    else:
        doc.data = _convert(node, (), doc, problems, _Loader(""))
    if problems:
        raise InputError(problems)
    return doc


def _place(source: str, node: yaml.Node) -> Place:
    return Place(source, node.start_mark.line + 1, node.start_mark.column + 1)


def _convert(node: yaml.Node, path: Path_, doc: Document, problems: list[Problem], loader) -> Any:
    doc.places.setdefault(path, _place(doc.source, node))
    if node.tag not in _STANDARD_TAGS:
        problems.append(
            Problem(_place(doc.source, node), dotted(path), f"tag {node.tag!r} is not allowed in a recipe")
        )
        return None
    if isinstance(node, yaml.MappingNode):
        return _convert_mapping(node, path, doc, problems, loader)
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), doc, problems, loader) for i, item in enumerate(node.value)]
    try:
        return loader.construct_object(node, deep=True)
    except yaml.YAMLError as err:
        problems.append(Problem(_place(doc.source, node), dotted(path), f"invalid value: {err}"))
        return None


def _convert_mapping(node, path, doc, problems, loader) -> dict:
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            problems.append(Problem(_place(doc.source, key_node), dotted(path), "keys must be plain words"))
            continue
        key = str(loader.construct_object(key_node))
        child = path + (key,)
        if key in out:
            first = doc.places[child]
            problems.append(
                Problem(_place(doc.source, key_node), dotted(child), f"duplicate key (first set at line {first.line})")
            )
            continue
        doc.places[child] = _place(doc.source, key_node)
        out[key] = _convert(value_node, child, doc, problems, loader)
    return out


def apply_overrides(doc: Document, overrides: list[str]) -> Document:
    """Apply `dotted.key=value` overrides (values parsed as YAML) to a copy of `doc`."""
    result = Document(copy.deepcopy(doc.data), dict(doc.places), doc.source)
    problems: list[Problem] = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)*", key):
            problems.append(Problem(Place(doc.source, override=text), "", "an override looks like dotted.key=value"))
            continue
        try:
            value = parse_document(f"v: {raw}" if raw.strip() else "v: null", "override").data["v"]
        except InputError:
            value = raw  # not YAML on its own (e.g. a bare colon): take it as the string typed
        path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
        problem = _set_path(result, path, value, Place(doc.source, override=text))
        if problem:
            problems.append(problem)
    if problems:
        raise InputError(problems)
    return result


def _set_path(doc: Document, path: Path_, value: Any, place: Place) -> Problem | None:
    target: Any = doc.data
    for depth, part in enumerate(path[:-1]):
        if isinstance(target, list) and isinstance(part, int) and part < len(target):
            target = target[part]
            continue
        if not isinstance(target, dict):
            return Problem(place, dotted(path[: depth + 1]), "cannot set a key inside a value that is not a mapping")
        if not isinstance(target.get(part), (dict, list)):
            target[part] = {}  # a new section, or a scalar being replaced by a mapping
        target = target[part]
    last = path[-1]
    if isinstance(target, list) and isinstance(last, int) and last < len(target):
        target[last] = value
    elif isinstance(target, dict):
        target[last] = value
    else:
        return Problem(place, dotted(path), "cannot set a key inside a value that is not a mapping")
    for end in range(1, len(path) + 1):
        doc.places[path[:end]] = place if end == len(path) else doc.places.get(path[:end], place)
    for stale in [p for p in doc.places if len(p) > len(path) and p[: len(path)] == path]:
        doc.places[stale] = place
    return None


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
