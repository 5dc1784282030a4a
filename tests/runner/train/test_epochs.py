"""`train.epochs` instead of `train.steps`: the run takes ceil(epochs * rows / batch) steps of finite
data, says why, resumes, and the estimate and tune paths take such a recipe; one line otherwise."""

from __future__ import annotations

import json
import logging
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.optim import total_steps
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.measure.probe import probe

EPOCHS = ["train.steps=null", "train.scheduler={name: constant}"]  # batch 8 (TINY_BERT)
CLASSIFIER = [*TINY_BERT, "model.name=BertForSequenceClassification", "model.config.num_labels=2"]


def labelled_jsonl(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"text number {i}", "label": i % 2}) + "\n" for i in range(rows)))
    return path


def text_data(tmp_path: Path, rows: int) -> str:
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(97 + i % 26 for i in range(rows * 32)))  # seq_len 32, one byte a token
    return f"data={{source: text, paths: [{corpus}], seq_len: 32}}"


def steps_of(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out) if "loss" in r]


@pytest.mark.parametrize("kind, epochs, rows, steps", [("text", "2", 20, 5), ("records", "1.5", 30, 6),
                                                      ("dataset", "1", 12, 2)])
def test_epochs_train_the_steps_they_come_to(tmp_path, ckrun, caplog, kind, epochs, rows, steps):
    data = text_data(tmp_path, rows) if kind == "text" else \
        f"data={{source: {kind}, paths: [{labelled_jsonl(tmp_path / 'train.jsonl', rows)}], seq_len: 32}}"
    model = TINY_BERT if kind == "text" else CLASSIFIER
    caplog.set_level(logging.INFO, logger="ckrun")
    code, _, err = ckrun(BERT_TINY, *model, *EPOCHS, f"train.epochs={epochs}", data, f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    plural = "" if epochs == "1" else "s"
    assert f"steps {steps}: {epochs} epoch{plural} of {rows} rows at batch 8" in caplog.messages
    assert steps_of(tmp_path / "run") == list(range(1, steps + 1))
    records = read_metrics(tmp_path / "run")
    assert records[-1]["epoch"] == round(steps * 8 / rows, 4) >= float(epochs)


def test_a_run_in_epochs_resumes_to_the_same_losses(tmp_path, ckrun):
    data = text_data(tmp_path, 20)  # 2 epochs: 5 steps
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert ckrun(BERT_TINY, *TINY_BERT, *EPOCHS, "train.epochs=2", data, f"output.dir={whole}")[0] == 0
    assert ckrun(BERT_TINY, *TINY_BERT, *EPOCHS, "train.epochs=1", data, f"output.dir={part}")[0] == 0  # 3 steps
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *EPOCHS, "train.epochs=2", data, f"output.dir={part}", "--resume")
    assert code == 0, err
    assert steps_of(part) == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in read_metrics(part)] == [r["loss"] for r in read_metrics(whole)]


def test_a_cosine_schedule_decays_over_the_steps_epochs_come_to(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=null", "train.epochs=2", text_data(tmp_path, 20),
                         "train.scheduler={name: cosine, min_lr_ratio: 0.0}", f"output.dir={tmp_path / 'run'}")
    assert code == 0, err
    rates = [r["lr"] for r in read_metrics(tmp_path / "run")]
    assert len(rates) == 5 and rates == sorted(rates, reverse=True) and rates[-1] < 0.2 * rates[0]


@pytest.mark.parametrize("args, key, fragment", [
    (["train.epochs=2"], "train.epochs", "give train.steps or train.epochs, not both"),
    (["train.steps=null"], "train", "give train.steps (optimizer steps) or train.epochs"),
    (["train.steps=null", "train.epochs=2"], "train.epochs", "synthetic data never runs out, so it has no epochs"),
], ids=["both", "neither", "synthetic"])
def test_steps_and_epochs_are_one_or_the_other(tmp_path, ckrun, args, key, fragment):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *args, f"output.dir={tmp_path / 'run'}")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and f" {key}: " in err and fragment in err, err


class Finite:
    def __init__(self, rows: int):
        self.rows = rows


@given(rows=st.integers(1, 10**6), batch=st.integers(1, 4096), tenths=st.integers(1, 500))
def test_the_steps_of_epochs_cover_them_and_no_more(rows, batch, tenths):
    epochs = Fraction(tenths, 10)  # what a user writes: 0.7, 2.5, 13.0
    recipe = load_recipe(BERT_TINY, [*EPOCHS, f"train.epochs={float(epochs)}", f"train.batch_size={batch}",
                                     "data={source: text, paths: [x.txt]}"])
    steps = total_steps(recipe, Finite(rows))
    assert steps >= 1 and steps * batch >= epochs * rows and (steps == 1 or (steps - 1) * batch < epochs * rows)
    assert steps == max(1, math.ceil(epochs * rows / batch))


def test_a_source_without_rows_has_no_epochs():
    recipe = load_recipe(BERT_TINY, [*EPOCHS, "train.epochs=1", "data={source: text, paths: [x.txt]}"])
    with pytest.raises(BuildError, match="has no fixed number of rows, so no epochs; give train.steps"):
        total_steps(recipe, object())


def test_estimate_and_a_probe_take_a_recipe_in_epochs(tmp_path, ckrun):
    data = text_data(tmp_path, 20)
    code, out, err = ckrun("estimate", BERT_TINY, *TINY_BERT, *EPOCHS, "train.epochs=2", data, "--device", "cpu", "--json")
    assert code == 0 and '"peak' in out, err
    # what the tuner's probe child runs: a few steps, whatever the run's length
    measured = probe(load_recipe(BERT_TINY, [*TINY_BERT, *EPOCHS, "train.epochs=0.1", data]), 1, 2)
    assert measured.status == "ok" and len(measured.losses) == 3


@pytest.mark.slow
def test_tune_trains_a_recipe_in_epochs(tmp_path, ckrun):
    run, data = tmp_path / "run", text_data(tmp_path, 20)
    code, _, err = ckrun("tune", BERT_TINY, *TINY_BERT, *EPOCHS, "train.epochs=2", data, f"output.dir={run}",
                         "--max-mem", "4GB", "--output", str(tmp_path / "tune"), "--trials", "1", "--finalists", "0",
                         "--warmup-steps", "1", "--timed-steps", "1")
    assert code == 0, err
    assert steps_of(run) == [1, 2, 3, 4, 5]  # the tuned recipe trained its 2 epochs
    assert "epochs: 2" in (tmp_path / "tune" / "tuned.yaml").read_text()
