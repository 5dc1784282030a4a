"""Examples with real targets from local JSONL or CSV files: an input text and a label or a target text.

Every file is read once, when the run is built. A problem in one (bytes that are not UTF-8, a
line that is not JSON, a missing field, a label of the wrong kind, no records at all) is one
line naming the file and the line. Labels get ids in a stable order that is logged: the
recipe's `labels` list, else integer labels as their own ids, else the names sorted. The global
batch of a step is a pure function of (seed, step), as for every source, so resume and
micro-batching stay exact.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..recipe.recipe import RecordsData
from .data_checks import CSV_DELIMITERS, JSONL_SUFFIXES, field_list, json_objects, matching_files
from .data import IGNORE, Batch, Shape, TextSource, epoch_rows, load_tokenizer
from .resolve import BuildError

log = logging.getLogger(__name__)

_INTEGER = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class Example:
    where: str  # "FILE:LINE", for messages about this example
    input: str
    target: str  # a label name (integers as their digits) or a target text


def read_examples(data: RecordsData, key: str = "data") -> list[Example]:
    """Every example of every file the paths match, in file order; a BuildError naming file and line."""
    examples = []
    for path in matching_files(data.paths, key):
        found = list(_read_file(path, data, key))
        if not found:
            raise BuildError(f"{key}.paths", f"{path} holds no records; give a file with one example per line or row")
        examples += found
    return examples


def _read_file(path: Path, data: RecordsData, key: str):
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _jsonl_examples(path, data, key)
    if suffix in CSV_DELIMITERS:
        return _csv_examples(path, data, key, CSV_DELIMITERS[suffix])
    raise BuildError(f"{key}.paths", f"{path}: records are read from .jsonl (one JSON object per line) or .csv "
                                     f"(a header row) files, not {suffix or 'a file without suffix'}; rename or convert it")


def _text(path: Path, key: str) -> str:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise BuildError(f"{key}.paths", f"cannot read {path}: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise BuildError(f"{key}.paths", f"{path}:{line}: bytes that are not UTF-8; save the file as UTF-8") from None


def _jsonl_examples(path: Path, data: RecordsData, key: str):
    fields = f" {data.input_field!r} and {data.target_field!r}"
    for number, record in json_objects(_text(path, key).split("\n"), path,
                                       lambda message: BuildError(f"{key}.paths", message), fields):
        yield to_example(f"{path}:{number}", record, data, key)


def _csv_examples(path: Path, data: RecordsData, key: str, delimiter: str):
    reader = csv.reader(io.StringIO(_text(path, key), newline=""), delimiter=delimiter)
    try:
        header = next(reader, None)
        if header is None:
            return
        for row in reader:
            if not row:
                continue  # a blank line
            if len(row) != len(header):
                raise BuildError(f"{key}.paths", f"{path}:{reader.line_num}: {len(row)} fields where the header has "
                                                 f"{len(header)}; quote fields that hold a {delimiter!r}")
            yield to_example(f"{path}:{reader.line_num}", dict(zip(header, row, strict=True)), data, key)
    except csv.Error as err:
        raise BuildError(f"{key}.paths", f"{path}:{reader.line_num}: not CSV ({err})") from None


def to_example(where: str, record: dict, data: RecordsData, key: str) -> Example:
    """One record's input and target, checked: a BuildError naming `where` and the field otherwise."""
    values = []
    for name, setting in ((data.input_field, "input_field"), (data.target_field, "target_field")):
        if name not in record:
            raise BuildError(f"{key}.{setting}", f"{where}: no field {name!r} (it has {field_list(record)}); "
                                                 f"fix the file or set {key}.{setting}")
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, str | int) or (setting == "input_field" and not isinstance(value, str)):
            kind = "a string" if setting == "input_field" or data.task == "seq2seq" else "a string or an integer"
            raise BuildError(f"{key}.paths", f"{where}: field {name!r} holds {json.dumps(value)[:40]}, not {kind}")
        if isinstance(value, str) and not value.strip():
            raise BuildError(f"{key}.paths", f"{where}: field {name!r} is empty; give every example an input and a target")
        if isinstance(value, str):
            _check_text(where, name, value, key)
        values.append(str(value))
    return Example(where, *values)


def _check_text(where: str, name: str, value: str, key: str) -> None:
    """JSON's \\u escapes can spell half of a UTF-16 pair (\\ud800) alone: not a character, and no encoder
    (the byte tokenizer, a tokenizer, the exported config) can write it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BuildError(f"{key}.paths", f"{where}: field {name!r} holds a lone surrogate "
                                         f"({value[err.start]!r} at character {err.start}), which is not text; "
                                         "fix the escape (a \\ud83d needs its \\ude00 pair)") from None


def pick_label_ids(examples: list[Example], data: RecordsData, classes: int, key: str = "data",
                   given: dict[str, int] | None = None, class_names: list[str] | None = None) -> dict[str, int]:
    """Label name -> id: `given` (the training data's, for held-out data), the recipe's `labels`, the
    data's own `class_names` (a ClassLabel column), integer labels as themselves, or the sorted names;
    every example's label checked against it."""
    names = sorted({e.target for e in examples})
    if given is not None:
        ids, source = given, "the training data's labels"
    elif data.labels is not None:
        ids, source = {name: i for i, name in enumerate(data.labels)}, f"{key}.labels"
    elif class_names is not None:
        ids, source = {name: i for i, name in enumerate(class_names)}, "the dataset's ClassLabel names"
    elif all(_INTEGER.fullmatch(name) for name in names):
        ids, source = {name: int(name) for name in names}, "integer labels"
    else:
        ids, source = {name: i for i, name in enumerate(names)}, "sorted label names"
    for example in examples:
        if example.target not in ids:
            known = ", ".join(list(ids)[:10])
            raise BuildError(f"{key}.paths", f"{example.where}: label {example.target!r} is not one of {source} ({known})")
    needed = max(ids.values()) + 1
    beyond = next((e for e in examples if ids[e.target] >= classes), None)
    if beyond is not None:
        raise BuildError("model.config", f"{beyond.where}: label {beyond.target!r} is id {ids[beyond.target]}, but the "
                                         f"model has {classes} classes; set its class count (num_labels for transformers) to {needed}")
    if given is None:
        log.info("labels -> ids (%s): %s", source, ", ".join(f"{name}={i}" for name, i in sorted(ids.items(), key=lambda x: x[1])))
    return ids


class RecordsSource(TextSource):
    """Inputs (and seq2seq targets) tokenised once, padded to fixed lengths; targets from the file."""

    @classmethod
    def build(cls, data, shape, batch_size, seed, *, label_ids=None, pin_memory=False) -> RecordsSource:
        return cls(data, shape, batch_size, seed, label_ids)

    def __init__(self, data: RecordsData, shape: Shape, batch_size: int, seed: int, label_ids: dict[str, int] | None = None):
        key = "data"  # held-out data's problems are moved to eval.data by the evaluator
        examples = read_examples(data, key)
        tokenizer = load_tokenizer(data.tokenizer, key) if data.tokenizer else None
        self.use(encode_examples(examples, data, shape, tokenizer, key, label_ids), shape, batch_size, seed, tokenizer)
        log.info("%s: %d examples from %s", key, len(examples), ", ".join(sorted({e.where.rsplit(':', 1)[0] for e in examples}))[:200])

    def use(self, encoded: dict, shape: Shape, batch_size: int, seed: int, tokenizer) -> None:
        """Serve batches of `encoded` (what encode_examples returns, perhaps from a cache)."""
        self.shape, self.batch_size, self.seed = shape, batch_size, seed
        self.pad_id = getattr(tokenizer, "pad_token_id", None) or 0
        self.inputs, self.attention, self.targets = encoded["inputs"], encoded["attention"], encoded["targets"]
        self.label_ids = encoded["label_ids"]

    @staticmethod
    def _padded(sequences: list[list[int]], length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[count, length] ids, cut or padded with `pad`, and the mask of the real tokens."""
        out, mask = torch.full((len(sequences), length), pad, dtype=torch.long), torch.zeros(len(sequences), length, dtype=torch.long)
        for row, ids in enumerate(sequences):
            ids = ids[:length]
            out[row, : len(ids)], mask[row, : len(ids)] = torch.tensor(ids, dtype=torch.long), 1
        return out, mask

    @property
    def rows(self) -> int:
        return len(self.inputs)

    def global_batch(self, step: int) -> Batch:
        rows = epoch_rows(len(self.inputs), step, self.batch_size, self.seed)
        ids, labels = self.inputs[rows], self.targets[rows]
        if not self.shape.by_keyword:
            return Batch({"input_ids": ids}, labels, False)
        inputs = {"input_ids": ids, "attention_mask": self.attention[rows]}
        if self.shape.task == "seq2seq":  # teacher forcing: the decoder sees the target shifted right
            shifted = torch.cat([torch.full_like(labels[:, :1], self.shape.decoder_start), labels[:, :-1]], dim=1)
            inputs["decoder_input_ids"] = shifted.masked_fill(shifted == IGNORE, self.pad_id)
        return Batch(inputs, labels, True)


def encode_examples(examples: list[Example], data: RecordsData, shape: Shape, tokenizer, key: str = "data",
                    label_ids: dict[str, int] | None = None, class_names: list[str] | None = None) -> dict:
    """Inputs padded to seq_len with their mask, and targets: padded target ids (seq2seq) or label ids."""
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    encode = _encoder(tokenizer, shape.vocab_size)
    inputs, attention = RecordsSource._padded([encode(e.input) for e in examples], data.seq_len, pad_id)
    if shape.task == "seq2seq":
        targets = RecordsSource._padded([encode(e.target) for e in examples], data.target_len or data.seq_len, IGNORE)[0]
        return {"inputs": inputs, "attention": attention, "targets": targets, "label_ids": None}
    ids = pick_label_ids(examples, data, shape.num_classes, key, label_ids, class_names)
    targets = torch.tensor([ids[e.target] for e in examples])
    return {"inputs": inputs, "attention": attention, "targets": targets, "label_ids": ids}


def _encoder(tokenizer, vocab: int):
    if tokenizer is not None:
        return lambda text: tokenizer(text, add_special_tokens=True)["input_ids"]
    return lambda text: [(byte + 2) % vocab for byte in text.encode("utf-8")]  # 0 and 1 stay padding and [MASK]
