"""Batches for a step, addressed by step number so that resume and micro-batching see the same data.

`BatchSource` is what every data source provides (the registry of sources, one per recipe
`data.source`, is runner/builders/sources.py). `global_batch(step)` is a pure function of (seed,
step): synthetic data draws it from a generator seeded by both, local data takes a seeded
permutation. Micro-batches are slices of the global batch, so any micro-batch size trains on
exactly the same samples.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from ..problems import first_line
from ..recipe.recipe import SyntheticData, Task, TextFilesData
from ..recipe.data import BYTE_VOCAB
from .data_checks import matching_files
from .resolve import BuildError

IGNORE = -100  # label of positions that do not count towards the loss
MASK_ID = 1  # token that replaces masked positions in masked_lm


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    by_keyword: bool  # transformers models take keyword inputs; torchvision/python take one tensor
    positions: torch.Tensor | None = None
    """[batch, k] indices of the only positions that carry labels (masked_lm), so the loss can
    skip the rest; a fixed k per row keeps shapes static (fake tensors, torch.compile)."""

    def slice(self, start: int, stop: int) -> Batch:
        positions = None if self.positions is None else self.positions[start:stop]
        return Batch({k: v[start:stop] for k, v in self.inputs.items()}, self.labels[start:stop], self.by_keyword, positions)

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch({k: move(v) for k, v in self.inputs.items()}, move(self.labels), self.by_keyword, move(self.positions))

    def tensors(self) -> list[torch.Tensor]:
        return [*self.inputs.values(), self.labels, *([] if self.positions is None else [self.positions])]


@dataclass(frozen=True)
class Shape:
    """What the model expects, read from its config so data always fits the model."""

    task: Task
    by_keyword: bool
    vocab_size: int = 0
    num_classes: int = 0
    image_size: int = 224
    channels: int = 3
    decoder_start: int = 0  # seq2seq: the token the decoder starts from (T5's pad, BART's </s>)


def _generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 7 + salt)


def shape_tokens(tokens: torch.Tensor, shape: Shape, gen: torch.Generator, mask_prob: float, mask_id: int = MASK_ID,
                 target_len: int | None = None) -> Batch:
    """Turn a [batch, seq] block of token ids into the task's inputs and labels (random targets,
    `target_len` long, for seq2seq and classification: only synthetic data comes here with those tasks)."""
    ids = tokens.clone()
    attention = torch.ones_like(ids)
    if shape.task == "masked_lm":
        # the same number of masked tokens in every row, so the loss's shapes never depend on data
        count = max(1, round(mask_prob * ids.shape[1]))
        positions = torch.rand(ids.shape, generator=gen).argsort(dim=1)[:, :count].sort(dim=1).values
        labels = torch.full_like(ids, IGNORE).scatter_(1, positions, ids.gather(1, positions))
        ids.scatter_(1, positions, mask_id)
        return Batch({"input_ids": ids, "attention_mask": attention}, labels, shape.by_keyword, positions)
    elif shape.task == "causal_lm":
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    elif shape.task == "seq2seq":
        labels = torch.randint(2, shape.vocab_size, (ids.shape[0], target_len or ids.shape[1]), generator=gen)
        decoder = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
        inputs = {"input_ids": ids, "attention_mask": attention, "decoder_input_ids": decoder}
        return Batch(inputs, labels, shape.by_keyword)
    else:  # sequence_classification
        labels = torch.randint(0, shape.num_classes, (ids.shape[0],), generator=gen)
    if not shape.by_keyword:
        return Batch({"input_ids": ids}, labels, False)
    return Batch({"input_ids": ids, "attention_mask": attention}, labels, True)


def epoch_rows(count: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Sample rows of the global batch at `step`: each epoch walks its own seeded permutation."""
    first = step * batch_size
    return [int(_permutation(count, seed, i // count)[i % count]) for i in range(first, first + batch_size)]


@functools.lru_cache(maxsize=4)
def _permutation(count: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(count, generator=_generator(seed, epoch, 2))


class BatchSource(ABC):
    """What a data source gives the loop, the evaluator and the estimator. One subclass per recipe
    `data.source` literal, registered in runner/builders/sources.py; its recipe section is a model in
    runner/recipe/data.py.

    A source reads and prepares its data once, in `build`, and reports what is wrong with it as a
    BuildError at the recipe key to fix. After that, `global_batch(step)` must be a pure function of
    the seed and the step: the same step always gives the same batch, so `--resume`, micro-batching
    and every rank see the same samples (file data: a seeded order per epoch, `epoch_rows`).
    """

    rows: int | None = None
    """Samples in one epoch, what train.epochs counts and the evaluator covers; None: never ends."""
    label_ids: dict[str, int] | None = None
    """Label name -> id, when the source chose them (records, datasets): held-out data takes the
    same ids, and the exported config's id2label says them."""

    @classmethod
    def build(cls, data, shape: Shape, batch_size: int, seed: int, *, label_ids: dict[str, int] | None = None,
              pin_memory: bool = False) -> BatchSource:
        """The source of a recipe's data section. `label_ids`: the training data's, when this is
        held-out data; `pin_memory`: batches go to a GPU (a source with workers pins them)."""
        return cls(data, shape, batch_size, seed)

    @abstractmethod
    def global_batch(self, step: int) -> Batch:
        """The whole batch of optimizer step `step` (0-based), on the CPU."""

    def close(self) -> None:
        """Stop what runs beside training (worker processes), now; may be called again, and the
        source may be asked for batches afterwards (it restarts them)."""
        return None  # most sources run nothing beside training

    @classmethod
    def token_vocab(cls, data) -> int:
        """Token ids the data's text comes as (a tokenizer's size, or UTF-8 bytes), for a model that
        does not say its vocabulary; 0: the source has no tokens of its own."""
        return 0

    @classmethod
    def stand_in(cls, data, shape: Shape, batch_size: int, seed: int) -> Batch:
        """A batch of the shapes `global_batch` gives, read from no file: the estimator prices a step
        from shapes alone. Synthetic tokens or images of the section's lengths."""
        synthetic = SyntheticData(task=shape.task, seq_len=getattr(data, "seq_len", 128), image_size=shape.image_size,
                                  channels=shape.channels, mask_prob=getattr(data, "mask_prob", 0.15),
                                  target_len=getattr(data, "target_len", None))  # seq2seq targets of records, datasets
        return SyntheticSource(synthetic, shape, batch_size, seed).global_batch(0)


class TextSource(BatchSource):
    """A source of text, whose token ids are its tokenizer's (`data.tokenizer`), or UTF-8 bytes."""

    @classmethod
    def token_vocab(cls, data) -> int:
        return len(load_tokenizer(data.tokenizer)) if data.tokenizer else BYTE_VOCAB


class SyntheticSource(BatchSource):
    def __init__(self, data: SyntheticData, shape: Shape, batch_size: int, seed: int):
        self.data, self.shape, self.batch_size, self.seed = data, shape, batch_size, seed

    def global_batch(self, step: int) -> Batch:
        gen = _generator(self.seed, step)
        if self.shape.task == "image_classification":
            size, channels = self.shape.image_size, self.shape.channels
            images = torch.randn(self.batch_size, channels, size, size, generator=gen)
            labels = torch.randint(0, self.shape.num_classes, (self.batch_size,), generator=gen)
            key = "pixel_values" if self.shape.by_keyword else "images"
            return Batch({key: images}, labels, self.shape.by_keyword)
        tokens = markov_tokens(self.batch_size, self.data.seq_len, self.shape.vocab_size, self.seed, gen)
        return shape_tokens(tokens, self.shape, gen, self.data.mask_prob, target_len=self.data.target_len)


def markov_tokens(batch: int, length: int, vocab: int, seed: int, gen: torch.Generator) -> torch.Tensor:
    """Token sequences a model can learn: each token has 4 possible successors (fixed by the seed),
    drawn Zipf-like as word frequencies are, so even a few steps learn the frequent tokens.

    Uniform random tokens would be unlearnable (the loss would sit at ln(vocab) forever), and a
    loss that goes down is how a user sees that training works.
    """
    successors = _successor_table(vocab, seed)
    choices = torch.randint(0, 4, (batch, length), generator=gen)
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(2, vocab, (batch,), generator=gen)
    for position in range(1, length):
        tokens[:, position] = successors[tokens[:, position - 1], choices[:, position]]
    return tokens


@functools.lru_cache(maxsize=2)
def _successor_table(vocab: int, seed: int) -> torch.Tensor:
    cumulative = torch.cumsum(1.0 / torch.arange(1, vocab - 1, dtype=torch.float64), 0)
    draws = torch.rand(vocab, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    # inverse-CDF sampling of Zipf(1) over ids 2..vocab-1; a vocab x vocab table would not fit
    return 2 + torch.searchsorted(cumulative, draws * cumulative[-1]).clamp(max=vocab - 3)


class TextFilesSource(TextSource):
    """Local text, tokenised once, cut into seq_len samples, visited in a seeded order per epoch."""

    def __init__(self, data: TextFilesData, shape: Shape, batch_size: int, seed: int):
        self.data, self.shape, self.batch_size, self.seed = data, shape, batch_size, seed
        self.tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer else None
        self.mask_id = self._mask_id()
        if data.split == "lines":
            self.samples = self._lines(self._files())
            return
        stream = self._tokens(self._files())
        count = len(stream) // data.seq_len
        if count < 1:
            raise BuildError("data.paths", f"the text files hold {len(stream)} tokens, fewer than one sample of {data.seq_len}")
        self.samples = stream[: count * data.seq_len].view(count, data.seq_len)

    def _files(self) -> list[Path]:
        return matching_files(self.data.paths, "data")

    def _tokens(self, files: list[Path]) -> torch.Tensor:
        texts = [_read_text(f) for f in files]
        if not "".join(texts).strip():
            raise BuildError("data.paths", f"the text files hold no text ({', '.join(str(f) for f in files[:3])}"
                             f"{' ...' if len(files) > 3 else ''}); give files with text in them")
        if self.tokenizer is not None:  # each file a document, ended by the end token (GPT-2's <|endoftext|>)
            return torch.cat([self._tokens_of(text) for text in texts if text.strip()])
        text = "\n".join(texts)
        raw = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
        return (raw + 2) % self.shape.vocab_size  # ids 0 and 1 stay free for padding and [MASK]

    def _mask_id(self) -> int:
        """The tokenizer's own [MASK] id; without a tokenizer, id 1, which byte ids never take."""
        if self.tokenizer is None:
            return MASK_ID
        mask_id = getattr(self.tokenizer, "mask_token_id", None)
        if mask_id is None and self.shape.task == "masked_lm":
            raise BuildError("data.tokenizer", f"{self.data.tokenizer} has no mask token, which masked_lm needs; give a "
                             "tokenizer with a mask_token (BERT's [MASK]) or set data.task: causal_lm")
        return MASK_ID if mask_id is None else int(mask_id)

    @property
    def rows(self) -> int:
        """Samples in one epoch (finite sources have this; synthetic data has none)."""
        return len(self.samples)

    def _lines(self, files: list[Path]) -> list[torch.Tensor]:
        """`split: lines`: one sample per non-empty line, cut at seq_len."""
        lines = [line for f in files for line in _read_text(f).splitlines() if line.strip()]
        if not lines:
            raise BuildError("data.paths", "the text files hold no non-empty line, which split: lines needs")
        return [self._tokens_of(line)[: self.data.seq_len] for line in lines]

    def _tokens_of(self, text: str) -> torch.Tensor:
        """A document's (or, split: lines, a line's) ids; with a tokenizer that has an end token, ended by
        it, as GPT-2's training text was, so that a causal LM learns where text ends and `generate` stops."""
        if self.tokenizer is not None:
            ids = self.tokenizer(text)["input_ids"]
            end = getattr(self.tokenizer, "eos_token_id", None)
            if self.shape.task == "causal_lm" and end is not None and (not ids or ids[-1] != end):
                ids = [*ids, end]
            return torch.tensor(ids, dtype=torch.long)
        return (torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long() + 2) % self.shape.vocab_size

    def global_batch(self, step: int) -> Batch:
        rows = epoch_rows(len(self.samples), step, self.batch_size, self.seed)
        generator = _generator(self.seed, step, 1)
        if self.data.split == "lines":
            return padded_batch([self.samples[r] for r in rows], self.shape, generator, self.data.mask_prob, self.mask_id)
        return shape_tokens(self.samples[rows], self.shape, generator, self.data.mask_prob, self.mask_id)


def padded_batch(samples: list[torch.Tensor], shape: Shape, gen: torch.Generator, mask_prob: float, mask_id: int) -> Batch:
    """Samples of several lengths padded (id 0) to the longest: padding is masked out of attention,
    and no label sits on it or (causal LM) predicts it."""
    length = max(len(sample) for sample in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    real = torch.zeros(len(samples), length, dtype=torch.bool)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample)], real[row, : len(sample)] = sample, True
    batch = shape_tokens(tokens, shape, gen, mask_prob, mask_id)
    if "attention_mask" in batch.inputs:
        batch.inputs["attention_mask"] = real.long()
    labelled = real if shape.task != "causal_lm" else torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    batch.labels = batch.labels.masked_fill(~labelled, IGNORE)
    return batch


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise BuildError("data.paths", f"cannot read {path}: {err.strerror or err}") from None


def load_tokenizer(directory: str, key: str = "data"):
    """The local tokenizer, or a BuildError: transformers' own errors are paragraphs that suggest a download."""
    from transformers import AutoTokenizer

    if not any(Path(directory).expanduser().glob("*")):
        raise BuildError(f"{key}.tokenizer", f"{directory} is empty; give a directory saved by tokenizer.save_pretrained")
    try:
        return AutoTokenizer.from_pretrained(str(Path(directory).expanduser()), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BuildError(f"{key}.tokenizer", f"{directory} holds no tokenizer transformers can load ({first_line(err, 160)}); "
                         "give a directory saved by tokenizer.save_pretrained") from None
