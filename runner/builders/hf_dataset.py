"""Local datasets the way people hold them, read through Hugging Face `datasets`.

`data.source: dataset` takes Parquet, JSONL and CSV files and folders written by `save_to_disk`,
offline (nothing is downloaded). Language modelling packs the input column's texts into seq_len
samples, as transformers' run_clm/run_mlm examples do; classification and seq2seq take a target
column and go through the `records` source's label handling, so label ids are picked (and logged)
the same way. The tokens are computed once and cached (see token_cache); a step's batch is a pure
function of (seed, step), as for every source, so resume and micro-batching stay exact.

What validation can check cheaply (the files exist, a folder is a saved dataset, a Parquet file's
schema, the named columns and split) it checks before any training; the rest is one line naming
the file and the row when the data is read.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import torch

from ..recipe.recipe import DatasetData
from .data import BatchSource, Shape, TextFilesSource, TextSource, load_tokenizer
from .dataset_files import READERS, cheap_columns, find_paths, reason, require_datasets, saved_kind, split_folder
from .records import RecordsSource, encode_examples, to_example
from .resolve import BuildError
from .token_cache import TokenCache, files_fingerprint, folder_digest

log = logging.getLogger(__name__)

LABELLED = ("seq2seq", "sequence_classification")
LANGUAGE_MODELLING = ("masked_lm", "causal_lm")
BATCH_ROWS = 1000  # rows read and tokenised at a time


# --- building: read, tokenise once, serve batches by step ----------------------------------------


class LabelledRows(RecordsSource):
    """Inputs and targets (labels or target texts) padded to fixed lengths, batched as records are."""

    def __init__(self, encoded: dict, shape: Shape, batch_size: int, seed: int, tokenizer):
        self.use(encoded, shape, batch_size, seed, tokenizer)


class PackedTexts(TextFilesSource):
    """The input column's texts end to end, cut into seq_len samples, batched as text files are."""

    def __init__(self, data: DatasetData, shape: Shape, batch_size: int, seed: int, tokenizer):
        self.data, self.shape, self.batch_size, self.seed = data, shape, batch_size, seed
        self.tokenizer = tokenizer
        self.mask_id = self._mask_id()  # a tokenizer without [MASK] is refused before any reading
        self.samples = torch.empty(0, data.seq_len, dtype=torch.long)


class DatasetSource(TextSource):
    """`data.source: dataset`: built as packed text (language modelling) or labelled rows (classification,
    seq2seq), whose batches are served as text files' and records' are."""

    @classmethod
    def build(cls, data, shape, batch_size, seed, *, label_ids=None, pin_memory=False) -> BatchSource:
        return dataset_source(data, shape, batch_size, seed, label_ids)


def dataset_source(data: DatasetData, shape: Shape, batch_size: int, seed: int, label_ids: dict[str, int] | None = None):
    """The batch source of a `data.source: dataset` section; `label_ids`: the training data's, for held-out data."""
    key = "data"  # held-out data's problems are moved to eval.data by the evaluator
    if shape.task not in (*LABELLED, *LANGUAGE_MODELLING):
        raise BuildError(f"{key}.source", f"source: dataset holds text, but the model learns {shape.task}; "
                                          "use source: image_folder for images")
    try:
        require_datasets()
        paths = find_paths(data.paths)
    except ValueError as err:
        raise BuildError(f"{key}.paths", str(err)) from None
    tokenizer = load_tokenizer(data.tokenizer, key) if data.tokenizer else None
    packed = None if shape.task in LABELLED else PackedTexts(data, shape, batch_size, seed, tokenizer)
    cache = TokenCache(paths, _cache_parts(data, shape, paths, label_ids))
    tokens = cache.load()
    if tokens is None:
        started = time.perf_counter()
        tokens = _tokenise(data, shape, tokenizer, paths, key, label_ids)
        log.info("data: read and tokenised %s in %.1f s", ", ".join(map(str, paths))[:200], time.perf_counter() - started)
        cache.save(tokens)
    elif label_ids is None and tokens.get("label_ids"):
        log.info("labels -> ids (as when cached): %s", ", ".join(f"{n}={i}" for n, i in sorted(tokens["label_ids"].items(), key=lambda x: x[1])))
    _check_vocab(tokens, shape, data, key)
    if packed is None:
        source = LabelledRows(tokens, shape, batch_size, seed, tokenizer)
        log.info("data: %d examples", len(source.inputs))
        return source
    packed.samples = tokens["samples"]
    log.info("data: %d samples of %d tokens", len(packed.samples), data.seq_len)
    return packed


def _check_vocab(tokens: dict, shape: Shape, data: DatasetData, key: str) -> None:
    """Token ids the model's embedding has rows for: another model's tokenizer would fail deep in the forward."""
    ids = [tokens[name] for name in ("samples", "inputs") if name in tokens]
    if shape.task == "seq2seq":
        ids.append(tokens["targets"])
    largest = max((int(t.max()) for t in ids if t.numel()), default=0)
    if largest >= shape.vocab_size:
        raise BuildError(f"{key}.tokenizer", f"{data.tokenizer} gives token ids up to {largest}, but the model's vocab_size "
                                             f"is {shape.vocab_size}; use the model's own tokenizer or set its vocab_size to "
                                             f"{largest + 1} or more")


def _cache_parts(data: DatasetData, shape: Shape, paths: list[Path], label_ids: dict[str, int] | None) -> dict:
    """Everything the tokens depend on (and nothing else: mask_prob and the seed act per batch)."""
    parts = {"format": 1, "files": files_fingerprint(paths), "split": data.split, "tokenizer": folder_digest(data.tokenizer),
             "vocab": shape.vocab_size, "task": shape.task, "seq_len": data.seq_len, "input": data.input_field}
    if shape.task in LABELLED:
        parts.update(target=data.target_field, target_len=data.target_len, labels=data.labels,
                     classes=shape.num_classes, given=label_ids)
    return parts


def _tokenise(data: DatasetData, shape: Shape, tokenizer, paths: list[Path], key: str, label_ids) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckrun-datasets-") as scratch:  # datasets' arrow copies of the files
        opened = (_open(path, data, key, scratch) for path in paths)
        if shape.task in LABELLED:
            examples, class_names = [], None
            for where, dataset in opened:
                names = _check_columns(dataset, where, data, shape.task, key)
                class_names = class_names or names
                examples += _examples(dataset, where, data, key, names)
            return encode_examples(examples, data, shape, tokenizer, key, label_ids, class_names)
        stream: list[int] = []
        for where, dataset in opened:
            _check_columns(dataset, where, data, shape.task, key)
            stream += _token_stream(dataset, where, data, tokenizer, shape.vocab_size, key)
    count = len(stream) // data.seq_len
    if count < 1:
        named = ", ".join(map(str, paths[:3])) + (" ..." if len(paths) > 3 else "")
        raise BuildError(f"{key}.seq_len", f"{named}: {len(stream)} tokens in all, fewer than one sample of "
                                           f"{data.seq_len}; give more text or a smaller {key}.seq_len")
    return {"samples": torch.tensor(stream[: count * data.seq_len], dtype=torch.long).view(count, data.seq_len)}


KIND_NAMES = {"parquet": "Parquet", "json": "JSON lines", "csv": "CSV"}


def _open(path: Path, data: DatasetData, key: str, scratch: str):
    """(where, datasets.Dataset) for one file or saved folder; a BuildError naming it when it cannot be read."""
    datasets = require_datasets()
    if path.is_dir():
        where, folder = str(path), path
        if saved_kind(path) == "dict":
            try:
                folder, split = split_folder(path, data.split)
            except ValueError as err:
                raise BuildError(f"{key}.split", str(err)) from None
            where = f"{path}:{split}"
        reading = lambda: datasets.load_from_disk(str(folder))  # noqa: E731
        kind = "a dataset saved by save_to_disk"
    else:
        where, kind = str(path), KIND_NAMES[READERS[path.suffix.lower()]]
        reader = {"Parquet": datasets.Dataset.from_parquet, "JSON lines": datasets.Dataset.from_json,
                  "CSV": datasets.Dataset.from_csv}[kind]
        options = _csv_options(path) if kind == "CSV" else {}
        reading = lambda: reader(str(path), cache_dir=scratch, **options)  # noqa: E731
        if path.stat().st_size == 0:
            raise BuildError(f"{key}.paths", f"{path} is empty; give a file with one example per row")
    try:
        dataset = reading()
    except Exception as err:  # noqa: BLE001 - pyarrow, pandas and datasets each raise their own kinds
        if "corresponds to no data" not in str(err):  # datasets' words for a file of no rows (a header only)
            raise BuildError(f"{key}.paths", f"cannot read {path} as {kind}: {reason(err)}") from None
        dataset = []
    if len(dataset) == 0:
        raise BuildError(f"{key}.paths", f"{where} holds no rows; give data with one example per row")
    return where, dataset


def _csv_options(path: Path) -> dict:
    """CSV cells are text, as in the records source: pandas would read a column of digits as numbers
    (labels "0"/"1" still become integer ids) and an empty cell as NaN."""
    import datasets

    header = cheap_columns(path, None) or []
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"sep": "\t" if path.suffix.lower() == ".tsv" else ",", "keep_default_na": False,
            **({"features": features} if len(features) == len(header) > 0 else {})}


def _kind(feature) -> str:
    """What a column holds, in words: text, integer, class label, or its arrow type."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return "class label"
    dtype = getattr(feature, "dtype", None)
    if dtype in ("string", "large_string"):
        return "text"
    if isinstance(dtype, str) and dtype.startswith(("int", "uint")):
        return "integer"
    return str(dtype or type(feature).__name__)


def _check_columns(dataset, where: str, data: DatasetData, task: str, key: str) -> list[str] | None:
    """That the input (and target) columns are there and hold the right kind; a ClassLabel's names."""
    wanted = [("input_field", data.input_field)] + ([("target_field", data.target_field)] if task in LABELLED else [])
    for setting, column in wanted:
        if column not in dataset.column_names:
            raise BuildError(f"{key}.{setting}", f"{where}: no column {column!r} (it has "
                                                 f"{', '.join(dataset.column_names[:8])}); fix the data or set {key}.{setting}")
        kind = _kind(dataset.features[column])
        allowed = ("text",) if setting == "input_field" or task == "seq2seq" else ("text", "integer", "class label")
        if kind not in allowed:
            holds = "the input text" if setting == "input_field" else "the targets"
            raise BuildError(f"{key}.{setting}", f"{where}: column {column!r} holds {kind} values, not "
                                                 f"{' or '.join(allowed)}; set {key}.{setting} to the column with {holds}")
    feature = dataset.features[data.target_field] if task in LABELLED else None
    return list(feature.names) if feature is not None and _kind(feature) == "class label" else None


def _batches(dataset, columns: list[str]):
    """(first row, {column: values}) of BATCH_ROWS rows at a time: a large dataset is never one list."""
    start = 0
    for batch in dataset.select_columns(list(dict.fromkeys(columns))).iter(batch_size=BATCH_ROWS):
        yield start, batch
        start += len(batch[columns[0]])


def _examples(dataset, where: str, data: DatasetData, key: str, class_names: list[str] | None) -> list:
    examples = []
    for start, batch in _batches(dataset, [data.input_field, data.target_field]):
        for offset, (text, target) in enumerate(zip(batch[data.input_field], batch[data.target_field], strict=True)):
            if class_names is not None and isinstance(target, int) and 0 <= target < len(class_names):
                target = class_names[target]  # a ClassLabel's id -> its name (-1, "no label", stays and is refused)
            record = {data.input_field: text, data.target_field: target}
            examples.append(to_example(f"{where}[{start + offset}]", record, data, key))
    return examples


def _token_stream(dataset, where: str, data: DatasetData, tokenizer, vocab: int, key: str) -> list[int]:
    """Every row's tokens, each text ended by the tokenizer's end token (a newline without a tokenizer)."""
    end = None if tokenizer is None else next((t for t in (tokenizer.eos_token_id, tokenizer.sep_token_id) if t is not None), None)
    stream: list[int] = []
    for start, batch in _batches(dataset, [data.input_field]):
        texts = batch[data.input_field]
        missing = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
        if missing is not None:
            raise BuildError(f"{key}.paths", f"{where}[{start + missing}]: column {data.input_field!r} is null, "
                                             "not text; fill in or drop the row")
        if tokenizer is None:
            rows = [[(byte + 2) % vocab for byte in (text + "\n").encode("utf-8")] for text in texts]  # 0, 1: pad, [MASK]
        else:
            rows = tokenizer(texts)["input_ids"]
        for row in rows:
            stream += row
            if end is not None and (not row or row[-1] != end):
                stream.append(end)
    return stream
