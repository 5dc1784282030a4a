"""`data.source: dataset`: save_to_disk folders and Parquet files train through the CLI, their tokens
are cached in the user's cache folder and re-made when the data changes, resume stays exact, and any odd or
broken data is one line and exit 2."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.data import Shape
from ckrun.runner.builders.hf_dataset import dataset_source
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.recipe.recipe import DatasetData

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

CLASSIFIER = [*TINY_BERT, "model.name=BertForSequenceClassification", "model.config.num_labels=2"]
GPT = ["model={source: transformers, name: GPT2LMHeadModel, config: {n_embd: 32, n_layer: 1, n_head: 2, "
       "vocab_size: 64, n_positions: 16}}", "data.seq_len=16", "train.batch_size=4", "train.device=cpu"]
WORDS = {"pos": ["apple", "sunny", "happy"], "neg": ["zebra", "storm", "awful"]}


def reviews(count: int = 48, seed: int = 0):
    """Texts whose words give their label away, the label a ClassLabel as on the Hub."""
    rng = random.Random(seed)
    rows = [{"text": " ".join(rng.choices(WORDS[label], k=4)), "label": label}
            for label in (rng.choice(sorted(WORDS)) for _ in range(count))]
    return datasets.Dataset.from_list(rows).class_encode_column("label")


def word_tokenizer(directory: Path) -> Path:
    """A local tokenizer built here (nothing downloaded) with an end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "<eos>", *WORDS["pos"], *WORDS["neg"]]
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="<eos>").save_pretrained(str(directory))
    return directory


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if "loss" in r]


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet"])
def test_a_saved_dataset_and_a_parquet_file_train_a_classifier(tmp_path, ckrun, caplog, kind):
    caplog.set_level(logging.INFO, logger="ckrun")
    if kind == "save_to_disk":
        datasets.DatasetDict(train=reviews(), validation=reviews(8, seed=1)).save_to_disk(str(tmp_path / "reviews"))
        data = f"{{source: dataset, paths: [{tmp_path / 'reviews'}], seq_len: 32}}"
        held_out = f"{{source: dataset, paths: [{tmp_path / 'reviews'}], split: validation, seq_len: 32}}"
    else:
        reviews().to_parquet(str(tmp_path / "train.parquet"))
        data = held_out = f"{{source: dataset, paths: [{tmp_path / 'train.parquet'}], seq_len: 32}}"
    code, _, err = ckrun(BERT_TINY, *CLASSIFIER, f"data={data}", f"eval={{batches: 1, data: {held_out}}}",
                         "train.steps=3", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert "labels -> ids (the dataset's ClassLabel names): neg=0, pos=1" in caplog.messages
    assert len(losses(tmp_path / "run")) == 3
    assert [r["eval"]["samples"] for r in read_metrics(tmp_path / "run") if "eval" in r] == [8]
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"}  # the export says what each id means


def test_tokens_are_cached_in_the_user_cache_and_remade_when_the_data_changes(tmp_path, ckrun, caplog, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    caplog.set_level(logging.INFO, logger="ckrun")
    parquet = tmp_path / "data" / "text.parquet"
    parquet.parent.mkdir()
    reviews().to_parquet(str(parquet))
    tokenizer = word_tokenizer(tmp_path / "tok")
    run = [BERT_TINY, *GPT, f"data={{source: dataset, paths: [{parquet}], tokenizer: {tokenizer}, seq_len: 16}}", "train.steps=2"]

    def train(name: str) -> list[str]:
        caplog.clear()
        code, _, err = ckrun(*run, f"output.dir={tmp_path / name}")
        assert code == 0, err
        return [m for m in caplog.messages if m.startswith("data: tok")]

    [first] = train("first")
    assert first.startswith(f"data: tokens cached at {tmp_path / 'user-cache' / 'ckrun' / 'datasets'}/text.parquet-")
    assert train("second") == [first.replace("tokens cached at", "tokens from the cache") +
                               " (the data, tokenizer and settings are unchanged)"]
    assert losses(tmp_path / "second") == losses(tmp_path / "first")  # the cached tokens are the same tokens
    reviews(seed=2).to_parquet(str(parquet))
    [third] = train("third")
    assert third.startswith("data: tokens cached at") and third != first  # the change made a new key
    assert losses(tmp_path / "third") != losses(tmp_path / "first")
    assert sorted(p.name for p in parquet.parent.iterdir()) == ["text.parquet"]  # the data folder is left alone


def test_an_unwritable_cache_folder_costs_only_the_cache(tmp_path, ckrun, caplog, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    (tmp_path / "user-cache").write_text("")  # a file where the folder should be: nothing can be written there
    caplog.set_level(logging.INFO, logger="ckrun")
    (tmp_path / "data").mkdir()
    reviews().to_json(str(tmp_path / "data" / "train.jsonl"))
    data = f"data={{source: dataset, paths: ['{tmp_path}/data/*.jsonl'], seq_len: 16}}"
    code, _, err = ckrun(BERT_TINY, *GPT, data, "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    assert any(m.startswith("data: cannot write the token cache at ") and "the next run tokenises again" in m
               for m in caplog.messages)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.jsonl"]


def test_resume_from_a_cached_dataset_is_exact(tmp_path, ckrun):
    reviews().to_parquet(str(tmp_path / "train.parquet"))
    common = [BERT_TINY, *CLASSIFIER, f"data={{source: dataset, paths: [{tmp_path / 'train.parquet'}], seq_len: 32}}",
              "train.batch_size=4", "train.scheduler={name: constant}"]  # cosine rates would depend on train.steps
    assert ckrun(*common, "train.steps=16", f"output.dir={tmp_path / 'straight'}")[0] == 0  # 48 rows: 4 epochs
    assert ckrun(*common, "train.steps=5", f"output.dir={tmp_path / 'halves'}")[0] == 0
    code, _, err = ckrun(*common, "train.steps=16", f"output.dir={tmp_path / 'halves'}", "--resume")
    assert code == 0, err
    assert losses(tmp_path / "halves") == losses(tmp_path / "straight")  # bit-identical


def test_without_the_datasets_package_validation_says_how_to_install_it(tmp_path, ckrun, monkeypatch):
    reviews().to_parquet(str(tmp_path / "train.parquet"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    code, _, err = ckrun("validate", BERT_TINY, f"data={{source: dataset, paths: [{tmp_path / 'train.parquet'}], seq_len: 32}}")
    assert code == 2
    [message] = err.splitlines()
    assert message.endswith("data.paths: data.source: dataset reads data through the datasets package, "
                            "which is not installed; pip install 'ckrun[datasets]'")


BROKEN = {  # file name, content, the key and the words of the one line, whether `ckrun validate` sees it
    "not a saved dataset": ("folder/notes.txt", "hi", "data.paths", "is a folder but not one written by save_to_disk", True),
    "cut-short parquet": ("train.parquet", b"PAR1\x00\x01", "data.paths", "not a Parquet file pyarrow can read", True),
    "missing column": ("train.jsonl", '{"txt": "a", "label": 1}\n', "data.input_field", "no column 'text' (it has txt, label)", True),
    "empty file": ("train.csv", "", "data.paths", "is empty", True),
    "float labels": ("train.jsonl", '{"text": "a", "label": 1.5}\n', "data.target_field", "column 'label' holds float64 values", False),
    "no rows": ("train.csv", "text,label\n", "data.paths", "holds no rows", False),
    "malformed JSON": ("train.jsonl", '{"text": "a", "label": 1}\n{"text": \n', "data.paths", "cannot read", False),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_data_is_one_line_naming_it(tmp_path, ckrun, case):
    name, content, key, words, at_validate = BROKEN[case]
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    given_path = path.parent if case == "not a saved dataset" else path
    data = f"data={{source: dataset, paths: [{given_path}], seq_len: 32}}"
    code, _, err = ckrun(BERT_TINY, *CLASSIFIER, data, "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 2
    [message] = err.splitlines()
    assert f" {key}: " in message and str(given_path) in message and words in message, message
    assert (ckrun("validate", BERT_TINY, *CLASSIFIER, data)[0] == 2) == at_validate  # caught before training when cheap


def test_a_missing_split_is_found_by_validate(tmp_path, ckrun):
    datasets.DatasetDict(train=reviews(4)).save_to_disk(str(tmp_path / "reviews"))
    code, _, err = ckrun("validate", BERT_TINY, f"data={{source: dataset, paths: [{tmp_path / 'reviews'}], split: test, seq_len: 32}}")
    assert code == 2
    [message] = err.splitlines()
    assert message.endswith(f"data.split: {tmp_path / 'reviews'} holds the splits train, not 'test'; set data.split to one of them")


VALUES = st.one_of(st.text(max_size=6), st.integers(-2, 3), st.floats(allow_nan=False, width=32), st.booleans(),
                   st.none(), st.lists(st.integers(0, 3), max_size=2))
GOOD = st.fixed_dictionaries({"text": st.text("ab xy", min_size=1, max_size=8).filter(str.strip),
                              "label": st.one_of(st.sampled_from(["a", "b"]), st.integers(0, 2))})
ODD = st.dictionaries(st.sampled_from(["text", "label", "other"]), VALUES, min_size=1)
ROWS = st.one_of(st.lists(GOOD, min_size=1, max_size=5), st.lists(st.one_of(GOOD, ODD), max_size=5))


def write_table(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".csv":
        columns = list(dict.fromkeys(k for row in rows for k in row))
        path.write_text("\n".join([",".join(columns), *(",".join(str(row.get(c, "")) for c in columns) for row in rows)]))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed kinds in a column: Parquet cannot hold them
            table = pa.Table.from_pylist([{k: json.dumps(v) for k, v in row.items()} for row in rows])
        pq.write_table(table, path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=ROWS, suffix=st.sampled_from([".jsonl", ".csv", ".parquet"]),
       task=st.sampled_from(["sequence_classification", "seq2seq", "causal_lm", "masked_lm"]))
def test_any_table_trains_or_is_one_line_naming_it(tmp_path_factory, monkeypatch, rows, suffix, task):
    folder = tmp_path_factory.mktemp("odd")
    monkeypatch.setenv("XDG_CACHE_HOME", str(folder / "user-cache"))
    path = folder / f"data{suffix}"
    write_table(path, rows)
    try:
        data = DatasetData(source="dataset", paths=[str(path)], task=task, seq_len=4)
        source = dataset_source(data, Shape(task, True, vocab_size=64, num_classes=3), 2, 0)
    except BuildError as err:
        message = str(err)
        assert err.key in ("data.paths", "data.input_field", "data.target_field", "data.seq_len", "model.config"), err.key
    except ValidationError as err:  # validation's checks: each error's cause is one line
        for error in err.errors():
            message = str(error["ctx"]["error"])
            assert error["loc"] in (("paths",), ("input_field",), ("target_field",)), error
            assert "\n" not in message and str(path) in message, message
        return
    else:
        batch = source.global_batch(3)
        assert batch.inputs["input_ids"].shape == (2, 4)
        if task == "sequence_classification":
            assert 0 <= batch.labels.min() and batch.labels.max() < 3
        return
    assert "\n" not in message and str(path) in message, message


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path, ckrun):
    reviews().to_parquet(str(tmp_path / "train.parquet"))
    tokenizer = word_tokenizer(tmp_path / "tok")  # ids up to 8
    tiny = GPT[0].replace("vocab_size: 64", "vocab_size: 5")
    data = f"data={{source: dataset, paths: [{tmp_path / 'train.parquet'}], tokenizer: {tokenizer}, seq_len: 16}}"
    code, _, err = ckrun(BERT_TINY, tiny, *GPT[1:], data, "train.steps=1", f"output.dir={tmp_path / 'run'}")
    assert code == 2
    [message] = err.splitlines()
    # validate's check (runner/builders/vocab.py) finds it first, at the model's vocab_size
    assert f"model.config.vocab_size: the model's vocabulary has 5 ids but the tokenizer {tokenizer} has 9 tokens" in message
