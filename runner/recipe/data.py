"""The recipe's `data:` section: where samples come from (synthetic, text files, records, HF
datasets, image folders). Each source is plain data checked where cheap (paths, tokenizer folders);
a dataset's files, split and columns are checked after the schema (runner/builders/checks.py), and
building batches from it is runner/builders's work.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, Field, field_validator

from ..plan.choices import Choice, members

Task = Literal["masked_lm", "causal_lm", "seq2seq", "sequence_classification", "image_classification"]

BYTE_VOCAB = 258  # UTF-8 bytes as ids 2..257: 0 and 1 stay free for padding and [MASK]

FileVocab = Annotated[int | None, Field(gt=1, description=(
    "Token ids your own model (model.source python) takes; UTF-8 bytes are folded below it. Unset: the "
    "model's config or its `vocab_size` attribute, else the tokenizer's size, else 258 (bytes, plus padding "
    "and mask). transformers models take theirs from model.config.vocab_size."))]


# --- data -----------------------------------------------------------------------------------



def _not_blank(path: str) -> str:
    # '' and '  ' name the working directory: a run's files among the user's own, or data read from there
    if not path.strip():
        raise ValueError("is empty (it would mean the working directory); give the path")
    return path


PathText = Annotated[str, AfterValidator(_not_blank)]
"""A file or directory the recipe names: never empty."""

class DataSection(Choice):
    """What every data section answers, as a memory policy does (runner/plan/policies.py): the recipe's
    checks, the builders and the tuner ask these, never a section's `source` name (a test holds it).
    Adding a source: its class here with these answers, its place in `Data`, and its BatchSource in
    runner/builders/sources.py."""

    discriminator: ClassVar[str] = "source"
    finite: ClassVar[bool] = True
    """It runs out: an epoch is its rows (train.epochs counts them)."""
    held_out: ClassVar[bool] = False
    """It draws held-out samples of its own (later steps of its stream), so eval needs no eval.data."""
    tokenised: ClassVar[bool] = False
    """Its token ids come from its tokenizer (or UTF-8 bytes), the vocabulary's source: data.vocab_size
    is then an own model's vocabulary, which a transformers model takes from its config instead."""
    schema_checked: ClassVar[bool] = False
    """`ckrun validate` reads its files' schemas (splits, columns) without reading rows
    (runner/builders/checks.py)."""
    holds: ClassVar[str]
    """What its samples are, for the line that refuses a task it cannot train."""
    first_lines: ClassVar[str | None] = None
    """What `ckrun validate` reads of its local files before a run would (runner/builders/data_checks.py):
    "files" (that data.paths match files), "records" (and each file's first record), "class_folders"
    (that data.root holds a folder per class); None: nothing."""

    @classmethod
    def tasks(cls) -> tuple[str, ...]:
        """The tasks it trains: the literals of its `task` field (which may be left unset)."""
        annotation = cls.model_fields["task"].annotation
        literal = next((arg for arg in get_args(annotation) if arg is not type(None)), annotation) \
            if get_origin(annotation) in (Union, UnionType) else annotation
        return get_args(literal)

    @property
    def varying_length(self) -> bool:
        """Its batches vary in length (padded to their longest sample), so a plan per length pays."""
        return False


class SyntheticData(DataSection):
    source: Literal["synthetic"] = "synthetic"
    """Random inputs of the right shapes and vocabulary, the same for the same seed and step."""
    finite: ClassVar[bool] = False
    held_out: ClassVar[bool] = True
    holds: ClassVar[str] = "random inputs of any task's shapes"
    task: Task | None = None
    """What the model learns; inferred from the model class when unset."""
    seq_len: int = Field(default=128, gt=0)
    """Tokens per sample (text tasks)."""
    image_size: int | None = Field(default=None, gt=0)
    """Height and width of square images (vision tasks); the model config's, else 224, when unset."""
    channels: int | None = Field(default=None, gt=0)
    """Image channels; the model config's, else 3, when unset."""
    num_classes: int | None = Field(default=None, gt=1)
    """Classes for classification; taken from the model's config when unset."""
    mask_prob: float = Field(default=0.15, gt=0, lt=1)
    """Fraction of tokens masked for masked_lm."""
    vocab_size: int | None = Field(default=None, gt=1)
    """Token ids are drawn below this; taken from the model's config when unset."""
    target_len: int | None = Field(default=None, gt=0)
    """seq2seq: tokens per target (the decoder's length); seq_len when unset."""


class TokenisedFiles(DataSection):
    """Local files of text, tokenised by a local tokenizer or as UTF-8 bytes: text, records, dataset."""

    source: str
    """Which files and how they are read (each source's literal says)."""
    paths: list[PathText] = Field(min_length=1)
    """Files or glob patterns (for `dataset`, folders written by `save_to_disk` too), in the formats
    the source reads."""
    seq_len: int = Field(default=128, gt=0)
    """Tokens per sample: packed text is cut into samples this long (`split: lines`: the longest a line
    keeps); an example's input is cut or padded to it (and the padding masked out)."""
    tokenizer: PathText | None = None
    """A local tokenizer directory; unset: UTF-8 bytes as token ids (no download needed)."""
    vocab_size: FileVocab = None
    tokenised: ClassVar[bool] = True

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, tokenizer: str | None) -> str | None:
        if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
            raise ValueError(f"no local tokenizer directory {tokenizer!r}")
        return tokenizer


class Examples(TokenisedFiles):
    """Files of examples, each an input text and its target: records and dataset."""

    input_field: str = "text"
    """The field (JSONL key, CSV or dataset column) holding the input text; language modelling reads
    only this one."""
    target_field: str = "label"
    """The field holding the target: a label (name, integer id, or a dataset's ClassLabel), or for
    seq2seq the target text."""
    labels: list[str] | None = Field(default=None, min_length=2)
    """Label names in id order (the first is id 0). Unset: a ClassLabel column's names, else integer
    labels (0, 1, ...) are their own ids and any other labels get ids in sorted order; either way the
    mapping is logged."""
    target_len: int | None = Field(default=None, gt=0)
    """seq2seq target tokens per sample, cut or padded like the input; seq_len when unset."""


class TextFilesData(TokenisedFiles):
    source: Literal["text"]
    """Local UTF-8 text files, tokenised and cut into fixed-length samples."""
    holds: ClassVar[str] = "plain text: no labels or target texts"
    first_lines: ClassVar[str | None] = "files"
    task: Literal["masked_lm", "causal_lm"] | None = None
    """What the model learns; inferred from the model class when unset."""
    split: Literal["packed", "lines"] = "packed"
    """`packed`: the text is one stream cut into seq_len samples, so every batch is seq_len long.
    `lines`: each non-empty line is a sample (no packing) and a batch is padded to its longest line,
    padding masked out of attention and the loss: batch lengths vary, and memory.adaptive can pick
    a plan per length."""
    mask_prob: float = Field(default=0.15, gt=0, lt=1)
    """Fraction of tokens masked for masked_lm."""

    @property
    def varying_length(self) -> bool:
        return self.split == "lines"


class RecordsData(Examples):
    source: Literal["records"]
    """Local JSONL or CSV files of examples, one per line or row, each an input text and its target:
    a label (sequence_classification) or a target text (seq2seq). `.jsonl`: one JSON object per line;
    `.csv`: a header row, then one row each. Nothing is downloaded."""
    holds: ClassVar[str] = "examples of an input and a target"
    first_lines: ClassVar[str | None] = "records"
    task: Literal["sequence_classification", "seq2seq"] | None = None
    """What the model learns; inferred from the model class when unset."""


class DatasetData(Examples):
    source: Literal["dataset"]
    """Local data read through Hugging Face `datasets` (`pip install 'ckrun[datasets]'`): Parquet, JSONL or
    CSV files, or a folder written by `save_to_disk`. Nothing is downloaded; the tokens are cached in $XDG_CACHE_HOME/ckrun/datasets."""
    holds: ClassVar[str] = "text columns"
    schema_checked: ClassVar[bool] = True
    split: str | None = None
    """The split of a saved DatasetDict (`train`, `validation`, ...); unset: `train`, or its only split."""
    task: Literal["masked_lm", "causal_lm", "seq2seq", "sequence_classification"] | None = None
    """What the model learns; inferred from the model class when unset."""
    mask_prob: float = Field(default=0.15, gt=0, lt=1)
    """Fraction of tokens masked for masked_lm."""


class ImageFolderData(DataSection):
    source: Literal["image_folder"]
    """A torchvision ImageFolder: ROOT/CLASS_NAME/IMAGE files."""
    holds: ClassVar[str] = "images in class folders"
    first_lines: ClassVar[str | None] = "class_folders"
    root: PathText
    """The folder holding one sub-folder per class."""
    image_size: int = Field(default=224, gt=0)
    """Images are resized and centre-cropped to this size."""
    task: Literal["image_classification"] = "image_classification"
    workers: int | None = Field(default=None, ge=0)
    """Worker processes that decode images ahead of the training step (a torch DataLoader); 0 decodes
    in the training process. Unset: one fewer than the CPU cores, at most 8, and 0 on a machine of
    1 or 2 cores, where a worker would take the core the step runs on (the choice is logged)."""
    prefetch: int = Field(default=2, gt=0)
    """Batches each worker decodes ahead (DataLoader's prefetch_factor); more hides slow disks, costs memory."""

    @field_validator("root")
    @classmethod
    def _root_dir(cls, root: str) -> str:
        if not Path(root).expanduser().is_dir():
            raise ValueError(f"no local directory {root!r}; give a folder with one sub-folder per class")
        return root


Data = Annotated[SyntheticData | TextFilesData | RecordsData | DatasetData | ImageFolderData, Field(discriminator="source")]
SECTIONS: tuple[type[DataSection], ...] = members(Data)


def sources_for(task: str) -> list[str]:
    """The sources of real data (files) that train `task`, in the union's order."""
    return [cls.tag() for cls in SECTIONS if cls.finite and task in cls.tasks()]
