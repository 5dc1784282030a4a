"""The data source registry is complete (every recipe `data.source` literal has a source, and no
source is registered for a literal the schema does not take), and every registered source keeps the
interface runner/builders/data.py's BatchSource writes down: a step's batch is a pure function of the
seed and the step, the estimator's stand-in has its shapes, rows count an epoch, close() may repeat."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from PIL import Image
from pydantic import Field

from ckrun.runner.builders.data import Batch, BatchSource, Shape
from ckrun.runner.builders.sources import SOURCES
from ckrun.runner.plan.choices import Strict
from ckrun.runner.recipe.data import Data, DatasetData, ImageFolderData, RecordsData, SyntheticData, TextFilesData


def schema_literals(data=Data) -> set[str]:
    """The `source` literals of a data union (Annotated[A | B | ..., discriminator])."""
    return {literal for member in typing.get_args(typing.get_args(data)[0])
            for literal in typing.get_args(member.model_fields["source"].annotation)}


def synthetic(tmp_path: Path):
    return SyntheticData(task="masked_lm", seq_len=16), Shape("masked_lm", True, vocab_size=64)


def text(tmp_path: Path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return TextFilesData(source="text", paths=[str(tmp_path / "a.txt")], seq_len=16), Shape("causal_lm", True, vocab_size=258)


def records(tmp_path: Path):
    lines = [json.dumps({"text": f"review {i} " * (i % 5 + 1), "label": ["neg", "pos"][i % 2]}) for i in range(10)]
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    data = RecordsData(source="records", paths=[str(tmp_path / "r.jsonl")], seq_len=16)
    return data, Shape("sequence_classification", True, vocab_size=258, num_classes=2)


def dataset(tmp_path: Path):
    pytest.importorskip("datasets")
    lines = [json.dumps({"text": f"source {i} " * (i % 4 + 1), "label": f"target {i}"}) for i in range(10)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    data = DatasetData(source="dataset", paths=[str(tmp_path / "d.jsonl")], task="seq2seq", seq_len=16, target_len=8)
    return data, Shape("seq2seq", True, vocab_size=258)


def image_folder(tmp_path: Path):
    for c, name in enumerate(["ant", "bee"]):
        (tmp_path / "img" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (10 + i, 12), (40 * c, 20 * i, 90)).save(tmp_path / "img" / name / f"{i}.png")
    data = ImageFolderData(source="image_folder", root=str(tmp_path / "img"), image_size=8, workers=0)
    return data, Shape("image_classification", False, num_classes=2, image_size=8)


EXAMPLES = {"synthetic": synthetic, "text": text, "records": records, "dataset": dataset, "image_folder": image_folder}


def test_every_data_source_of_the_schema_is_registered_and_no_other():
    assert schema_literals() == set(SOURCES)
    assert set(EXAMPLES) == set(SOURCES), "give a new source an example here, so the interface is checked for it"
    assert all(issubclass(source, BatchSource) for source in SOURCES.values())


def test_the_check_sees_a_source_the_schema_adds():
    class Extra(Strict):
        source: typing.Literal["extra"]

    members = (*typing.get_args(typing.get_args(Data)[0]), Extra)
    wider = typing.Annotated[typing.Union[members], Field(discriminator="source")]  # noqa: UP007 - built from a tuple
    assert schema_literals(wider) - set(SOURCES) == {"extra"}


def shapes(batch: Batch) -> dict[str, tuple]:
    return {**{k: tuple(v.shape) for k, v in batch.inputs.items()}, "labels": tuple(batch.labels.shape)}


def same(a: Batch, b: Batch) -> bool:
    return shapes(a) == shapes(b) and all(torch.equal(a.inputs[k], b.inputs[k]) for k in a.inputs) \
        and torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_source_keeps_the_interface(tmp_path, name):
    data, shape = EXAMPLES[name](tmp_path)
    build = lambda: SOURCES[name].build(data, shape, 4, seed=7)  # noqa: E731
    first, again = build(), build()
    try:
        assert isinstance(first, BatchSource)
        assert same(first.global_batch(3), again.global_batch(3)) and same(first.global_batch(0), again.global_batch(0))
        assert not same(first.global_batch(0), first.global_batch(1)) or first.rows == 4  # the step picks the batch
        assert (first.rows is None) == (not data.finite) and (first.rows is None or first.rows > 0)
        assert shapes(SOURCES[name].stand_in(data, shape, 4, seed=7)) == shapes(first.global_batch(0))
        assert SOURCES[name].token_vocab(data) == (258 if data.tokenised else 0)  # the bytes, without a tokenizer
    finally:
        first.close()
        first.close()  # close() may repeat
        again.close()
