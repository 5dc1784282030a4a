"""DIR/tuned.yaml: the recipe as the user wrote it (overrides applied), with the winning memory
plan and precision in place of its own, under a comment block saying where the plan comes from.

The cap goes in as memory.max_mem, so training the file stops with a clear error instead of
silently using more than the plan was tuned for. The text is validated before it is written:
`ckrun validate DIR/tuned.yaml` must accept what `ckrun tune` writes.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from runner.files import write_atomic
from runner.load import recipe_from_text
from runner.recipe import Recipe
from runner.units import format_bytes
from runner.yamlio import Document, dump_yaml

from .cap import Cap


def tuned_data(doc: Document, winner: dict, cap_text: str) -> dict:
    """The document's data with the winner's plan and precision; the plan written out in full."""
    data = copy.deepcopy(doc.data)
    memory = {k: v for k, v in winner["plan"].items() if v is not None}
    memory["max_mem"] = cap_text  # as the user typed it: `40GB` reads better than 40000000000
    data["memory"] = memory
    data["precision"] = winner["precision"]
    return data


def provenance(winner: dict, cap: Cap, source: str, overrides: list[str], path: Path, trials: int,
               notes: list[str] = ()) -> str:
    device = winner.get("device") or {}
    total = device.get("device_total_bytes")
    versions = f"torch {device.get('torch')}" + (f", CUDA {device['cuda']}" if device.get("cuda") else "")
    lines = [
        f"Tuned by `ckrun tune` on {time.strftime('%Y-%m-%d %H:%M %Z')} from {source}",
        f"  overrides:  {' '.join(overrides)}" if overrides else "",
        f"  train it:   ckrun {path}",
        f"  device:     {device.get('device')}{f' ({format_bytes(total)})' if total else ''}; {versions}",
        f"  measured:   peak {format_bytes(winner['measured_peak'])} within {cap.describe()}, "
        f"{winner['samples_per_s']:.2f} samples/s" + (f" (median of {winner['runs']} runs)" if winner["runs"] > 1 else ""),
        f"  plan:       {winner['label']}",
        f"  chosen:     trial {winner['number']} of {trials}; the study, report.json and pareto.png are in {path.parent}",
        *(f"  note:       {note}" for note in notes),
    ]
    return "".join(f"# {line}\n" for line in lines if line) + "\n"


def write_tuned(directory: Path, doc: Document, winner: dict, cap: Cap, cap_text: str,
                source: str, overrides: list[str], trials: int, notes: list[str] = ()) -> tuple[Path, Recipe]:
    path = directory / "tuned.yaml"
    text = provenance(winner, cap, source, overrides, path, trials, notes) + dump_yaml(tuned_data(doc, winner, cap_text))
    recipe = recipe_from_text(text, str(path))  # an InputError here is a tuner bug: better now than at training
    write_atomic(path, text)
    return path, recipe
