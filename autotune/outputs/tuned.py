"""DIR/tuned.yaml: the recipe as the user wrote it (overrides applied), with the winning memory
plan and precision in place of its own, under a comment block saying where the plan comes from.

The file is the recipe's own text with only the keys that change rewritten: those of `memory:`, the
`precision:` line, and those an override changed, as deep as the recipe's block mappings go. Every
other line, the user's comments included, is kept as written. Where the text cannot be edited line by line (a flow-style document,
an anchor the edit would cut) it is dumped instead, and the log says why.

The cap goes in as memory.max_mem, so training the file stops with a clear error instead of
silently using more than the plan was tuned for. The text is validated before it is written:
`ckrun validate DIR/tuned.yaml` must accept what `ckrun tune` writes.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.problems import InputError
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.units import format_bytes
from ckrun.runner.recipe.yamlio import Document, dump_yaml, parse_document

from ..cap import Cap
from ..records import TrialRecord
from ..space.candidate import distributed_section
from ..records import plans
from .report import caveats, summary

log = logging.getLogger(__name__)


def tuned_data(doc: Document, winner: TrialRecord, cap_text: str) -> dict:
    """The document's data with the winner's plan and precision; the plan written out in full."""
    data = copy.deepcopy(doc.data)
    memory = {k: v for k, v in winner.plan.items() if v is not None and not _quiet_default(k, v)}
    memory["max_mem"] = cap_text  # as the user typed it: `40GB` reads better than 40000000000
    data["memory"] = memory
    data["precision"] = winner.precision
    if winner.strategy is not None:  # tune --nproc: how the ranks share the work is part of the plan, all of it
        data["distributed"] = distributed_section(winner.strategy)
        if winner.strategy.shards and "sharding" not in memory:  # written out, as the other knobs are
            from ckrun.runner.plan.memory_plan import Sharding

            memory["sharding"] = Sharding().model_dump(mode="json")
    return data


_QUIET = ("adaptive", "compression", "allow_lossy")  # left out at their defaults: a plan that uses none stays short


def _quiet_default(key: str, value) -> bool:
    from ckrun.runner.plan.memory_plan import MemoryPlan

    return key in _QUIET and value == MemoryPlan().model_dump(mode="json")[key]


def tuned_text(doc: Document, data: dict) -> str:
    """`data` (the tuned recipe) as YAML: the recipe's own text edited where `data` differs from it,
    else a plain dump, with the reason logged."""
    edited, why = _edit_sections(doc, data)
    if edited is None:
        log.info("tuned.yaml: written without the recipe's own comments: %s", why)
        return dump_yaml(data)
    return edited


def _edit_sections(doc: Document, data: dict) -> tuple[str | None, str]:
    """(the edited text, "") or (None, why not). Only the keys whose values differ are rewritten,
    as deep as the recipe's block mappings go, so comments beside unchanged keys stay."""
    if not doc.text:
        return None, "the recipe's text is not at hand"
    original = parse_document(doc.text, doc.source)
    if set(original.data) - set(data):
        return None, "a top-level key of the recipe is gone"
    lines = doc.text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    edits = _edits(original, (), original.data, data, (0, len(lines)), lines)
    if edits is None:
        return None, "its top-level keys do not each start a line"
    overridden = sorted({path[0] for path, *_ in edits if path[0] not in ("memory", "precision", "distributed")})
    if overridden:
        log.info("tuned.yaml: the overrides' values written into %s", ", ".join(overridden))
    for _, begin, end, text in sorted(edits, key=lambda edit: (-edit[1], -edit[2])):  # bottom up: spans stay put
        lines[begin:end] = [text]
    text = "".join(lines)
    try:
        same = parse_document(text, doc.source).data == data
    except InputError:
        same = False
    return (text, "") if same else (None, "editing its lines did not give the tuned values back (an anchor or "
                                         "a block scalar the edit would cut)")


def _edits(doc: Document, path: tuple, old: dict, new: dict, span: tuple[int, int],
           lines: list[str]) -> list[tuple] | None:
    """(path, first line, line after, new text) per key of `new` that differs from `old` in the
    mapping at `path`, which fills `span`; None when that mapping is not one key per line."""
    spans = _key_spans(doc, path, old, span, lines)
    if spans is None:
        return None
    indent = " " * (doc.places[(*path, next(iter(old)))].col - 1) if old else ""
    # a new key goes after the whole mapping, the last key's trailing comments included: they are indented
    # under it (a commented-out line of that section) and would otherwise end up under the new key
    edits, after = [], _before_blank_lines(lines, span)
    for key, value in new.items():
        if key not in old:
            edits.append(((*path, key), after, after, _dumped(key, value, indent)))
        elif old[key] != value:
            inner = old[key]
            deeper = (_edits(doc, (*path, key), inner, value, spans[key], lines)
                      if isinstance(inner, dict) and isinstance(value, dict) and inner and set(inner) <= set(value)
                      else None)
            edits += deeper if deeper is not None else [((*path, key), *spans[key], _dumped(key, value, indent))]
    return edits


def _before_blank_lines(lines: list[str], span: tuple[int, int]) -> int:
    end = span[1]
    while end > span[0] and lines[end - 1].strip() in ("", "..."):
        end -= 1
    return end


def _dumped(key: str, value, indent: str) -> str:
    return "".join(indent + line for line in dump_yaml({key: value}).splitlines(keepends=True))


def _key_spans(doc: Document, path: tuple, mapping: dict, span: tuple[int, int],
               lines: list[str]) -> dict[str, tuple[int, int]] | None:
    """Key -> (first line, line after its last), 0-based, for the keys of the mapping at `path`; None
    unless each starts its own line at one column. A key's span ends before the blank and comment
    lines that precede the next key: those stay with what follows."""
    starts = {key: doc.places.get((*path, key)) for key in mapping}
    if any(place is None for place in starts.values()):
        return None
    columns = {place.col for place in starts.values()}
    first_lines = sorted(place.line - 1 for place in starts.values())
    if len(columns) > 1 or len(set(first_lines)) < len(starts) or (path and first_lines[0] <= span[0]):
        return None  # a flow mapping, or keys sharing a line
    if not path and columns != {1}:
        return None
    spans = {}
    for key, place in starts.items():
        begin = place.line - 1
        end = next((line for line in first_lines if line > begin), span[1])
        while end > begin + 1 and _between_sections(lines[end - 1]):
            end -= 1
        spans[key] = (begin, end)
    return spans


def _between_sections(line: str) -> bool:
    return line.strip() in ("", "...") or line.lstrip().startswith("#")


def provenance(winner: TrialRecord, cap: Cap, source: str, overrides: list[str], path: Path,
               records: list[TrialRecord], notes: list[str] = (), flags: str = "") -> str:
    device = winner.device or {}
    total = device.get("device_total_bytes")
    versions = f"torch {device.get('torch')}" + (f", CUDA {device['cuda']}" if device.get("cuda") else "")
    lines = [
        f"Tuned by `ckrun tune` on {time.strftime('%Y-%m-%d %H:%M %Z')} from {source}",
        f"  overrides:  {' '.join(overrides)}" if overrides else "",
        f"  train it:   ckrun {path}{flags}",
        f"  device:     {device.get('device')}{f' ({format_bytes(total)})' if total else ''}; {versions}",
        f"  {'predicted:' if winner.predicted else 'measured: '}  peak {format_bytes(winner.measured_peak)} "
        f"within {cap.describe()}, "
        f"{winner.samples_per_s:.2f} samples/s" + (f" (median of {winner.runs} runs)" if winner.runs > 1 else ""),
        f"  plan:       {winner.label}",
        f"  chosen:     {_chosen(winner, records)}; the study, report.json and pareto.png are in {path.parent}",
        *(f"  WARNING:    {caveat}" for caveat in caveats(records)),
        *(f"  note:       {note}" for note in notes),
    ]
    return "".join(f"# {line}\n" for line in lines if line) + "\n"


def _chosen(winner: TrialRecord, records: list[TrialRecord]) -> str:
    """Which trial, and among how many plans it was chosen: `measured` counts plans, not re-runs."""
    how = "predicted" if winner.predicted else "measured"
    return (f"trial {winner.number}, the fastest that fits of {len(plans(records))} plan(s) {how} "
            f"({len(records)} trials: {summary(records)})")


def write_tuned(directory: Path, doc: Document, winner: TrialRecord, cap: Cap, cap_text: str,
                source: str, overrides: list[str], records: list[TrialRecord], notes: list[str] = (),
                flags: str = "") -> tuple[Path, Recipe]:
    """`flags`: what `ckrun tuned.yaml` needs besides the file (` --nproc 2`), shown in the comment."""
    path = directory / "tuned.yaml"
    text = (provenance(winner, cap, source, overrides, path, records, notes, flags)
            + tuned_text(doc, tuned_data(doc, winner, cap_text)))
    recipe = recipe_from_text(text, str(path))  # an InputError here is a tuner bug: better now than at training
    write_atomic(path, text)
    return path, recipe
