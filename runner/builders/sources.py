"""The data sources, one per recipe `data.source` literal, and what asks them: the run's batch
source (`build_data`), the model's input shapes (`describe_inputs`) and the estimator's stand-in
batch. What a source must provide is `BatchSource` (runner/builders/data.py).

Adding a source: its section in runner/recipe/data.py (a model with `source: Literal["name"]`,
joined to the `Data` union), its `BatchSource` subclass, and one line in SOURCES;
tests/runner/builders/test_source_registry.py checks the two lists agree and that the source keeps
the interface.
"""

from __future__ import annotations

import torch

from ..recipe.recipe import Recipe, infer_task
from .data import Batch, BatchSource, Shape, SyntheticSource, TextFilesSource
from .image_loader import ImageFolderSource
from .hf_dataset import DatasetSource
from .records import RecordsSource
from .resolve import BuildError
from .vocab import check_built_vocab

SOURCES: dict[str, type[BatchSource]] = {
    "synthetic": SyntheticSource,
    "text": TextFilesSource,
    "records": RecordsSource,
    "dataset": DatasetSource,
    "image_folder": ImageFolderSource,
}


def source_class(data) -> type[BatchSource]:
    """The source registered for a data section (validation admits only registered literals)."""
    return SOURCES[data.source]


def describe_inputs(recipe: Recipe, model: torch.nn.Module) -> Shape:
    """What the model expects, read from the data section and the model's config, so data always fits the model."""
    data, spec = recipe.data, recipe.model
    task = data.task or infer_task(spec)
    if task is None:  # validation refuses a python model without data.task; other models imply one
        raise BuildError("data.task", f"cannot tell what {spec.name} learns; set data.task (masked_lm, causal_lm, "
                         "seq2seq, sequence_classification or image_classification)")
    config = getattr(model, "config", None)
    vocab = getattr(data, "vocab_size", None) or getattr(config, "vocab_size", None) or getattr(model, "vocab_size", 0) \
        or source_class(data).token_vocab(data)
    classes = getattr(data, "num_classes", None) or getattr(config, "num_labels", None) or spec.config.get("num_classes", 1000)
    image = getattr(data, "image_size", None) or getattr(config, "image_size", 224)
    channels = getattr(data, "channels", None) or getattr(config, "num_channels", 3)
    if task != "image_classification" and not vocab:
        raise BuildError("data.vocab_size", f"{spec.name} has no vocab_size (no config or attribute of that name); "
                                            "set data.vocab_size to the token ids its embedding takes")
    if task != "image_classification":
        check_built_vocab(data, int(vocab))  # a tokenizer past the embedding: one line, not an IndexError
    start = getattr(config, "decoder_start_token_id", None) or 0
    return Shape(task, spec.source == "transformers", int(vocab), int(classes), int(image), int(channels), int(start))


def build_data(recipe: Recipe, model: torch.nn.Module, label_ids: dict[str, int] | None = None) -> BatchSource:
    """The recipe's batch source; `label_ids`: the training data's label ids, for held-out records."""
    shape = describe_inputs(recipe, model)
    pinned = any(p.is_cuda for p in model.parameters())
    train = recipe.train
    source = source_class(recipe.data).build(recipe.data, shape, train.batch_size, train.seed, label_ids=label_ids,
                                             pin_memory=pinned)
    if label_ids is None:
        _name_labels(model, source.label_ids)
    return source


def stand_in_batch(recipe: Recipe, model: torch.nn.Module) -> Batch:
    """A batch of the recipe's shapes that reads no local data (contents do not change memory)."""
    shape = describe_inputs(recipe, model)
    return source_class(recipe.data).stand_in(recipe.data, shape, recipe.train.batch_size, recipe.train.seed)


def _name_labels(model: torch.nn.Module, label_ids: dict[str, int] | None) -> None:
    """Label names into a transformers config, so the exported model's id2label says what each id means."""
    config = getattr(model, "config", None)
    if not label_ids or config is None or not hasattr(config, "id2label") or len(label_ids) != config.num_labels:
        return
    if sorted(label_ids.values()) == list(range(len(label_ids))):
        config.id2label = {i: name for name, i in label_ids.items()}
        config.label2id = dict(label_ids)

