"""What validate reads of local data files before a run would: cheaply, without torch.

The run reads text, records and image folders when it builds the data, seconds or minutes after
`validate` said OK; a path that matches nothing, a records file without the recipe's fields or an
image folder without class folders was found only then (issue 32: validate said OK, the run
refused). Here each is looked at as far as one line tells: the paths match files, the first
record of each records file has the input and target fields (its first line, not the whole file),
an image folder has class folders. The run's own reading keeps every deeper check.
"""

from __future__ import annotations

import csv
import glob
import json
from pathlib import Path

from ..problems import KeyedError, one_line
from .resolve import BuildError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_DELIMITERS = {".csv": ",", ".tsv": "\t"}


def matching_files(patterns: list[str], key: str) -> list[Path]:
    """The files the patterns match, sorted (folders are not files); validate and the run read the same list.
    Each pattern must match a file: a name mistyped among several would otherwise leave its file out of the
    training without a word."""
    files: set[Path] = set()
    for pattern in patterns:
        found = {Path(f) for f in glob.glob(str(Path(pattern).expanduser())) if Path(f).is_file()}
        if not found:
            others = f" (one of {len(patterns)} paths: fix or remove it)" if len(patterns) > 1 else ""
            raise BuildError(f"{key}.paths", f"no files match {pattern}{others}")
        files |= found
    return sorted(files)


def local_data_problems(data, key: str, task: str | None) -> list[KeyedError]:
    """The problems of a text, records or image_folder section that reading its files' first lines finds."""
    try:
        if data.first_lines in ("files", "records"):  # the section says what its files' first lines tell
            files = matching_files(data.paths, key)
            if data.first_lines == "records":
                for path in files:
                    _first_record_fits(path, data, key, task)
        elif data.first_lines == "class_folders":
            _has_class_folders(Path(data.root).expanduser(), data.root, key)
    except KeyedError as err:
        return [err]
    return []


def _first_record_fits(path: Path, data, key: str, task: str | None) -> None:
    suffix = path.suffix.lower()
    if suffix not in (*JSONL_SUFFIXES, *CSV_DELIMITERS):
        raise KeyedError(f"{key}.paths", f"{path}: records are read from .jsonl (one JSON object per line) or .csv "
                                         f"(a header row) files, not {suffix or 'a file without suffix'}; rename or convert it")
    try:
        with path.open(encoding="utf-8-sig", newline="") as file:
            record, where = _first(file, suffix, path, key)
    except UnicodeDecodeError:
        raise KeyedError(f"{key}.paths", f"{path}: bytes that are not UTF-8; save the file as UTF-8") from None
    except OSError as err:
        raise KeyedError(f"{key}.paths", f"cannot read {path}: {err.strerror or err}") from None
    if record is None:
        raise KeyedError(f"{key}.paths", f"{path} holds no records; give a file with one example per line or row")
    for name, setting in ((data.input_field, "input_field"), (data.target_field, "target_field")):
        if name not in record:
            raise KeyedError(f"{key}.{setting}", f"{where}: no field {name!r} (it has {field_list(record)}); "
                                                 f"fix the file or set {key}.{setting}")


def field_list(record: dict) -> str:
    """A record's first field names for a one-line message (a quoted CSV header may hold line breaks)."""
    return one_line(", ".join(map(str, list(record)[:8]))) or "none"


def _first(file, suffix: str, path: Path, key: str) -> tuple[dict | None, str]:
    """The first record and where it is ("FILE:LINE"), or (None, "") for a file without one."""
    if suffix in CSV_DELIMITERS:
        delimiter = CSV_DELIMITERS[suffix]
        reader = csv.reader(file, delimiter=delimiter)
        try:
            header = next(reader, None)
            row = next((row for row in reader if row), None) if header is not None else None
        except csv.Error as err:
            raise KeyedError(f"{key}.paths", f"{path}:{reader.line_num}: not CSV ({err})") from None
        if row is None:
            return None, ""
        if len(row) != len(header):
            raise KeyedError(f"{key}.paths", f"{path}:{reader.line_num}: {len(row)} fields where the header has "
                                             f"{len(header)}; quote fields that hold a {delimiter!r}")
        return dict(zip(header, row, strict=True)), f"{path}:{reader.line_num}"
    for number, record in json_objects(file, path, lambda message: KeyedError(f"{key}.paths", message)):
        return record, f"{path}:{number}"
    return None, ""


def json_objects(lines, path: Path, error, fields: str = ""):
    """(line number, object) for each non-blank line of a JSONL file; `error(message)` is raised for a line
    that is not one JSON object (`fields`: what the message says the object should hold)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise error(f"{path}:{number}: not JSON ({err.msg}, column {err.colno}); "
                        "each line holds one JSON object") from None
        if not isinstance(record, dict):
            raise error(f"{path}:{number}: a JSON {type(record).__name__}, not an object with fields{fields}")
        yield number, record


def _has_class_folders(directory: Path, root: str, key: str) -> None:
    if directory.is_dir() and not any(entry.is_dir() for entry in directory.iterdir()):
        raise KeyedError(f"{key}.root", f"{root} has no class folders; put each class's images in a sub-folder of it")
