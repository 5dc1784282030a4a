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

from ..problems import InputError, Place, Problem, dotted

Path_ = tuple[str | int, ...]

_STANDARD_TAGS = {
    f"tag:yaml.org,2002:{name}"
    for name in ("str", "int", "float", "bool", "null", "map", "seq", "timestamp")
}


# Limits checked while the file is read, before any document is built: a recipe is a few hundred
# values, so these only ever stop a broken or hostile file (an alias bomb expands 9 aliases of 9
# aliases ... into billions of values from a few hundred bytes, and would run for hours).
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 50
MAX_VALUES = 20_000  # values with every alias expanded: a big recipe has a few hundred
MAX_ALIASES = 1_000

_MERGE_TAG = "tag:yaml.org,2002:merge"


class LimitError(yaml.MarkedYAMLError):
    """The document is over one of the limits above; `problem` says which, `problem_mark` where."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-4` and `3E5` as floats (YAML 1.1 demands a dot), and that
    counts depth, aliases and expanded values while composing, so a bomb stops at the limit."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = self.values = self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            return self._compose_alias(parent, index)
        event = self.peek_event()
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise LimitError(problem=f"values nest deeper than {MAX_DEPTH} levels; a recipe needs a few",
                             problem_mark=event.start_mark)
        first = self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        node.expanded_values = self.values - first + 1  # this node and everything below, aliases expanded
        self.depth -= 1
        return node

    def _compose_alias(self, parent, index):
        event = self.peek_event()
        target = self.anchors.get(event.anchor)
        if target is not None and not hasattr(target, "expanded_values"):
            raise LimitError(problem=f"alias *{event.anchor} refers to a value that contains it",
                             problem_mark=event.start_mark)
        self.aliases += 1
        if self.aliases > MAX_ALIASES:
            raise LimitError(problem=f"more than {MAX_ALIASES} aliases (*name); a recipe needs a few",
                             problem_mark=event.start_mark)
        if target is not None:
            self._count(target.expanded_values, event.start_mark)
        return super().compose_node(parent, index)  # an undefined alias is reported by PyYAML

    def _count(self, values: int, mark) -> int:
        self.values += values
        if self.values > MAX_VALUES:
            raise LimitError(problem=f"more than {MAX_VALUES:,} values with aliases expanded; "
                                     "a recipe holds a few hundred", problem_mark=mark)
        return self.values


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
    text: str = ""
    """The text it was parsed from (overrides are not in it): tuned.yaml edits it to keep its comments."""

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
        with open(path, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)  # never more: the path may be a device or a huge file
    except OSError as err:
        raise InputError([Problem(Place(str(path)), "", f"cannot read the file: {err.strerror or err}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise InputError([Problem(Place(str(path)), "", f"the file is over {MAX_FILE_BYTES >> 20} MiB; "
                                  "a recipe is a few kB (is this the right file?)")])
    return parse_document(decode_utf8(raw, str(path)), str(path))


def decode_utf8(raw: bytes, source: str) -> str:
    """`raw` as text; bytes that are not UTF-8 are a problem located at the first of them."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputError([Problem(Place(source, 1, 1), "", "the file is UTF-16; save it as UTF-8")])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line_start = raw.rfind(b"\n", 0, err.start) + 1
        where = Place(source, raw.count(b"\n", 0, err.start) + 1, err.start - line_start + 1)
        raise InputError([Problem(where, "", f"byte 0x{raw[err.start]:02x} is not UTF-8; save the file as UTF-8")]) from None


# what YAML's reader refuses: C0/C1 controls but tab and line breaks, surrogates, U+FFFE/U+FFFF
_NOT_YAML_TEXT = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010ffff]")


def _unprintable(text: str, source: str) -> Problem | None:
    found = _NOT_YAML_TEXT.search(text)
    if found is None:
        return None
    line_start = text.rfind("\n", 0, found.start()) + 1
    where = Place(source, text.count("\n", 0, found.start()) + 1, found.start() - line_start + 1)
    others = len(_NOT_YAML_TEXT.findall(text)) - 1
    more = f" (and {others} more)" if others else ""
    return Problem(where, "", f"control character U+{ord(found.group()):04X} is not allowed in YAML{more}; remove it")


def parse_document(text: str, source: str) -> Document:
    unprintable = _unprintable(text, source)
    if unprintable:
        raise InputError([unprintable])
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as err:
        raise InputError([_syntax_problem(err, source)]) from None
    except yaml.YAMLError as err:  # unmarked: the reader's own checks, should the ones above miss
        raise InputError([Problem(Place(source), "", f"invalid YAML: {err}")]) from None
    finally:
        loader.dispose()
    doc = Document({}, {}, source, text)
    problems: list[Problem] = []
    if node is None:
        problems.append(Problem(Place(source, 1, 1), "", "the file holds no recipe (it is empty or only comments)"))
    elif not isinstance(node, yaml.MappingNode):
        problems.append(Problem(_place(source, node), "", "a recipe must be a mapping of keys"))
    else:
        doc.data = _convert(node, (), doc, problems, _Loader(""))
    if problems:
        raise InputError(problems)
    return doc


def _syntax_problem(err: yaml.MarkedYAMLError, source: str) -> Problem:
    """One line for a YAML error. Something left open (a quote, a bracket) that runs into the end
    of the file is reported where it was opened: the end of the file says nothing of where to look."""
    def place(mark) -> Place:
        return Place(source, mark.line + 1, mark.column + 1) if mark else Place(source)

    if isinstance(err, LimitError):
        return Problem(place(err.problem_mark), "", err.problem)
    problem, context = err.problem or str(err), err.context or ""
    if err.context_mark and ("end of stream" in problem or "<stream end>" in problem):
        what = re.sub(r"^while (scanning|parsing) ", "", context)
        end = f" (the file ends at line {err.problem_mark.line + 1})" if err.problem_mark else ""
        return Problem(place(err.context_mark), "", f"invalid YAML: {what} starts here and is never closed{end}")
    if context and err.context_mark:
        problem = f"{context} at line {err.context_mark.line + 1}: {problem}"
    return Problem(place(err.problem_mark or err.context_mark), "", f"invalid YAML: {problem}")


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
    except (yaml.YAMLError, ValueError, OverflowError) as err:  # e.g. a 5000-digit int, 2001-02-30
        message = "an integer of thousands of digits" if "int_max_str_digits" in str(err) else str(err)
        problems.append(Problem(_place(doc.source, node), dotted(path), f"invalid value: {message}"))
        return None


def _convert_mapping(node, path, doc, problems, loader) -> dict:
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        key = _key_text(key_node, path, doc, problems)
        if key is None:
            continue
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


def _key_text(key_node: yaml.Node, path: Path_, doc: Document, problems: list[Problem]) -> str | None:
    """A key as the user typed it (`on:` stays "on", `null:` stays "null"), or None after a problem."""
    where = _place(doc.source, key_node)
    if key_node.tag == _MERGE_TAG:
        problems.append(Problem(where, dotted(path), "merge keys (<<) are not supported in recipes; "
                                "write the keys out, or set them with key=value overrides"))
    elif not isinstance(key_node, yaml.ScalarNode):
        problems.append(Problem(where, dotted(path), "keys must be plain words"))
    elif key_node.tag not in _STANDARD_TAGS:
        problems.append(Problem(where, dotted(path), f"tag {key_node.tag!r} is not allowed in a recipe"))
    else:
        return key_node.value
    return None


def apply_overrides(doc: Document, overrides: list[str]) -> Document:
    """Apply `dotted.key=value` overrides (values parsed as YAML) to a copy of `doc`."""
    result = Document(copy.deepcopy(doc.data), dict(doc.places), doc.source, doc.text)
    problems: list[Problem] = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)*", key):
            problems.append(Problem(Place(doc.source, override=text), "", "an override looks like dotted.key=value"))
            continue
        control = re.search(r"[\x00-\x1f\x7f-\x9f]", text)  # a pasted line break or escape sequence
        if control:
            problems.append(Problem(Place(doc.source, override=text), key, f"control character "
                                    f"U+{ord(control.group()):04X} in an override; type the value on one line"))
            continue
        try:
            value = parse_document(f"v: {raw}" if raw.strip() else "v: null", "override").data["v"]
        except InputError:
            value = raw  # not YAML on its own (e.g. a bare colon): take it as the string typed
        path = tuple(int(p) if p.isascii() and p.isdigit() else p for p in key.split("."))
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
