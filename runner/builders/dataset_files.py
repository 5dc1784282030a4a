"""Finding the files of `data.source: dataset` and checking them cheaply, for validation and building.

Validation runs these before anything is built: that `datasets` is installed, that each path is a
data file or a folder saved by `save_to_disk`, that a Parquet file's schema can be read, and that
the named columns and split are there, from a schema, header or first line (never the whole data).
Nothing here imports torch.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from pathlib import Path

READERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv"}


def require_datasets():
    """The `datasets` module, offline and quiet; a ValueError saying how to install it when it is missing."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # belt and braces: the local builders never download
    try:
        import datasets
    except ImportError:
        raise ValueError("data.source: dataset reads data through the datasets package, which is not installed; "
                         "pip install 'ckrun[datasets]'") from None
    datasets.config.HF_HUB_OFFLINE = True  # read at call time, so it holds when datasets was imported first
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def find_paths(patterns: list[str]) -> list[Path]:
    """The files and saved-dataset folders the patterns match, sorted; a ValueError naming what is wrong."""
    found: set[Path] = set()
    for pattern in patterns:
        matches = [Path(m) for m in glob.glob(str(Path(pattern).expanduser()))]
        if not matches:
            raise ValueError(f"nothing matches {pattern!r}; give Parquet, JSONL or CSV files, or a folder saved by save_to_disk")
        found.update(matches)
    for path in sorted(found):
        if path.is_dir() and not saved_kind(path):
            raise ValueError(f"{path} is a folder but not one written by save_to_disk (it has no state.json or "
                             f"dataset_dict.json); name the files in it instead, such as {path}/*.parquet")
        if path.is_file() and path.suffix.lower() not in READERS:
            raise ValueError(f"{path}: datasets are read from .parquet, .jsonl, .json, .csv or .tsv files or save_to_disk "
                             f"folders, not {path.suffix or 'a file without a suffix'}; convert or rename it")
    return sorted(found)


def saved_kind(folder: Path) -> str | None:
    if (folder / "dataset_dict.json").is_file():
        return "dict"
    return "dataset" if (folder / "state.json").is_file() else None


def check_paths(patterns: list[str]) -> None:
    """Validation's checks: `datasets` is installed, the paths are data, Parquet files have a readable schema."""
    require_datasets()
    for path in find_paths(patterns):
        if path.is_file() and path.stat().st_size == 0:
            raise ValueError(f"{path} is empty; give a file with one example per row")
        if path.is_file() and READERS[path.suffix.lower()] == "parquet":
            cheap_columns(path, None)


def check_split(patterns: list[str], split: str | None) -> None:
    """That the split exists in every saved DatasetDict (or can be chosen), and that one is there if set."""
    folders = [p for p in find_paths(patterns) if p.is_dir() and saved_kind(p) == "dict"]
    if split is not None and not folders:
        raise ValueError(f"split {split!r} picks a split of a saved DatasetDict, and none is named here; remove data.split")
    for folder in folders:
        split_folder(folder, split)


def split_folder(folder: Path, split: str | None) -> tuple[Path, str]:
    """The folder of the chosen split of a saved DatasetDict, and its name; a ValueError when it is unclear."""
    try:
        splits = list(json.loads((folder / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{folder}/dataset_dict.json cannot be read; save the dataset again with save_to_disk") from None
    chosen = split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
    if chosen not in splits:
        raise ValueError(f"{folder} holds the splits {', '.join(splits)}"
                         f"{f', not {split!r}' if split else ' and none is train'}; set data.split to one of them")
    return folder / chosen, chosen


def check_column(patterns: list[str], split: str | None, name: str) -> None:
    """That every file whose columns are cheap to read has the column `name`."""
    for path in find_paths(patterns):
        columns = cheap_columns(path, split)
        if columns is not None and name not in columns:
            raise ValueError(f"{path}: no column {name!r} (it has {', '.join(columns[:8]) or 'none'}); "
                             "name the column that holds it")


def cheap_columns(path: Path, split: str | None) -> list[str] | None:
    """Column names from a schema, a header or a first line, without reading the data; None when unknown."""
    if path.is_dir():
        try:
            folder = split_folder(path, split)[0] if saved_kind(path) == "dict" else path
            return list(json.loads((folder / "dataset_info.json").read_text())["features"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # reading it reports the problem precisely
    kind = READERS[path.suffix.lower()]
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as err:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError... for a broken file
            raise ValueError(f"{path}: not a Parquet file pyarrow can read ({reason(err)}); write it again") from None
    try:
        with path.open(encoding="utf-8", errors="replace") as file:
            first = next((line for line in file if line.strip()), "")
    except OSError:
        return None
    if kind == "csv":
        return next(csv.reader([first], delimiter="\t" if path.suffix.lower() == ".tsv" else ","), None)
    try:
        record = json.loads(first)
    except ValueError:
        return None
    return list(record) if isinstance(record, dict) else None


def reason(err: BaseException) -> str:
    """The first line of the innermost cause: `datasets` wraps the reader's error in its own."""
    while (err.__cause__ or err.__context__) is not None and not str(err).strip():
        err = err.__cause__ or err.__context__
    inner = err.__cause__ or err.__context__
    if inner is not None and str(inner).strip():
        err = inner
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:200]
