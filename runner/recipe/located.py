"""Errors found only when the model, data or plan is built still point into the recipe.

Building raises problems that know their key (`train.device`, `memory.checkpointing.layers`)
but not the file's line. `located_errors(doc)` gives each such problem the place of its key in
the loaded recipe: the line that set it, the override that did, or its nearest written parent.
"""

from __future__ import annotations

import contextlib

from ..problems import InputError, Place, Problem
from .yamlio import Document

_UNPLACED_SOURCES = ("<recipe>", "<probe>")


def located(doc: Document, key: str) -> Place:
    """The place of dotted `key` in `doc` (its nearest written ancestor when it was left to its default)."""
    path = tuple(int(part) if part.isdigit() else part for part in key.split(".")) if key else ()
    return doc.place_of(path)


def relocate(err: InputError, doc: Document) -> InputError:
    """`err` with every problem that names only the file placed at its key's line."""
    return InputError([Problem(located(doc, p.key), p.key, p.message) if _unplaced(p.place, doc) else p
                       for p in err.problems])


def _unplaced(place: Place, doc: Document) -> bool:
    return place.override is None and not place.line and place.file in (doc.source, *_UNPLACED_SOURCES)


@contextlib.contextmanager
def located_errors(doc: Document):
    try:
        yield
    except InputError as err:
        raise relocate(err, doc) from None
