"""The recipe's `data:` section: where samples come from (synthetic, text files, records, HF
datasets, image folders). Each source is plain data checked where cheap (paths, tokenizer folders);
a dataset's files, split and columns are checked after the schema (runner/builders/checks.py), and
building batches from it is runner/builders's work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from .choices import Strict

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

class SyntheticData(Strict):
    source: Literal["synthetic"] = "synthetic"
    """Random inputs of the right shapes and vocabulary, the same for the same seed and step."""
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


class TextFilesData(Strict):
    source: Literal["text"]
    """Local UTF-8 text files, tokenised and cut into fixed-length samples."""
    paths: list[PathText] = Field(min_length=1)
    """Files or glob patterns."""
    task: Task | None = None
    """What the model learns; inferred from the model class when unset."""
    seq_len: int = Field(default=128, gt=0)
    """Tokens per sample (`split: lines`: the most; longer lines are cut)."""
    split: Literal["packed", "lines"] = "packed"
    """`packed`: the text is one stream cut into seq_len samples, so every batch is seq_len long.
    `lines`: each non-empty line is a sample (no packing) and a batch is padded to its longest line,
    padding masked out of attention and the loss: batch lengths vary, and memory.adaptive can pick
    a plan per length."""
    tokenizer: PathText | None = None
    """A local tokenizer directory; unset: UTF-8 bytes as token ids (no download needed)."""
    vocab_size: FileVocab = None
    mask_prob: float = Field(default=0.15, gt=0, lt=1)
    """Fraction of tokens masked for masked_lm."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, tokenizer: str | None) -> str | None:
        if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
            raise ValueError(f"no local tokenizer directory {tokenizer!r}")
        return tokenizer


class RecordsData(Strict):
    source: Literal["records"]
    """Local JSONL or CSV files of examples, one per line or row, each an input text and its target:
    a label (sequence_classification) or a target text (seq2seq). Nothing is downloaded."""
    paths: list[PathText] = Field(min_length=1)
    """Files or glob patterns: `.jsonl` (one JSON object per line) or `.csv` (a header row, then one row each)."""
    input_field: str = "text"
    """The field (JSONL key or CSV column) holding the input text."""
    target_field: str = "label"
    """The field holding the target: a label name or integer id, or for seq2seq the target text."""
    labels: list[str] | None = Field(default=None, min_length=2)
    """Label names in id order (the first is id 0). Unset: integer labels (0, 1, ...) are their own ids,
    any other labels get ids in sorted order; either way the mapping is logged."""
    task: Literal["sequence_classification", "seq2seq"] | None = None
    """What the model learns; inferred from the model class when unset."""
    seq_len: int = Field(default=128, gt=0)
    """Input tokens per sample: longer inputs are cut, shorter ones padded (and masked out)."""
    target_len: int | None = Field(default=None, gt=0)
    """seq2seq target tokens per sample, cut or padded like the input; seq_len when unset."""
    tokenizer: PathText | None = None
    """A local tokenizer directory; unset: UTF-8 bytes as token ids (no download needed)."""
    vocab_size: FileVocab = None

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, tokenizer: str | None) -> str | None:
        return TextFilesData._tokenizer_dir(tokenizer)


class DatasetData(Strict):
    source: Literal["dataset"]
    """Local data read through Hugging Face `datasets` (`pip install 'ckrun[datasets]'`): Parquet, JSONL or
    CSV files, or a folder written by `save_to_disk`. Nothing is downloaded; the tokens are cached in $XDG_CACHE_HOME/ckrun/datasets."""
    paths: list[PathText] = Field(min_length=1)
    """Files or glob patterns (`.parquet`, `.jsonl`/`.json`, `.csv`/`.tsv`), or folders saved by `save_to_disk`."""
    split: str | None = None
    """The split of a saved DatasetDict (`train`, `validation`, ...); unset: `train`, or its only split."""
    task: Literal["masked_lm", "causal_lm", "seq2seq", "sequence_classification"] | None = None
    """What the model learns; inferred from the model class when unset."""
    input_field: str = "text"
    """The column holding the input text; language modelling reads only this one, packed into seq_len samples."""
    target_field: str = "label"
    """The column holding the target: a label (name, integer id or ClassLabel), or for seq2seq the target text."""
    labels: list[str] | None = Field(default=None, min_length=2)
    """Label names in id order, as for `records`. Unset: a ClassLabel column's names, else integer labels are
    their own ids and other labels get ids in sorted order; the mapping is logged."""
    seq_len: int = Field(default=128, gt=0)
    """Tokens per sample: inputs are cut or padded (classification, seq2seq), or text is packed (language modelling)."""
    target_len: int | None = Field(default=None, gt=0)
    """seq2seq target tokens per sample; seq_len when unset."""
    tokenizer: PathText | None = None
    """A local tokenizer directory; unset: UTF-8 bytes as token ids (no download needed)."""
    vocab_size: FileVocab = None
    mask_prob: float = Field(default=0.15, gt=0, lt=1)
    """Fraction of tokens masked for masked_lm."""

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_dir(cls, tokenizer: str | None) -> str | None:
        return TextFilesData._tokenizer_dir(tokenizer)


class ImageFolderData(Strict):
    source: Literal["image_folder"]
    """A torchvision ImageFolder: ROOT/CLASS_NAME/IMAGE files."""
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
