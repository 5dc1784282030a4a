"""Your own model works on the first try: docs/recipes.md's module and recipes, run as written, on
records (classification) and plain text (a language model), with no vocab_size anywhere; what
the recipe must still say (data.task) comes from `ckrun validate`, every problem in one go."""

from __future__ import annotations

import json
import random
import re
import sys

import pytest

from conftest import ROOT, read_metrics

SECTION = (ROOT / "docs" / "recipes.md").read_text().split("## Your own model, step by step", 1)[1].split("`ckrun validate classify", 1)[0]
BLOCKS = re.findall(r"```(python|yaml)\n(.*?)```", SECTION, re.S)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A folder as docs/recipes.md sets it up: my_models.py, the two recipes, data/ with records and text."""
    (tmp_path / "data").mkdir()
    for kind, text in BLOCKS:
        name = "my_models.py" if kind == "python" else text.splitlines()[0].split(":")[0].lstrip("# ")
        (tmp_path / name).write_text(text)
    rng = random.Random(0)
    for name, rows in (("train", 40), ("valid", 12)):
        with (tmp_path / "data" / f"{name}.jsonl").open("w") as out:
            for _ in range(rows):
                label = rng.choice(["pos", "neg"])
                words = ["fine", "great", "good"] if label == "pos" else ["dull", "poor", "bad"]
                out.write(json.dumps({"text": "a " + " ".join(rng.choices(words, k=4)) + " film", "label": label}) + "\n")
    (tmp_path / "data" / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 60)
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_models", None)  # other tests have modules of that name too
    yield tmp_path
    sys.modules.pop("my_models", None)


def test_the_readme_has_the_module_and_both_recipes():
    assert [kind for kind, _ in BLOCKS] == ["python", "yaml", "yaml"]


def test_the_classifier_trains_on_records_as_written(project, ckrun):
    code, _, err = ckrun("classify.yaml", "output.dir=run")
    assert code == 0, err
    records = read_metrics(project / "run")
    assert len([r for r in records if "loss" in r]) == 8  # 3 epochs of 40 rows at batch 16
    assert [r["eval"]["samples"] for r in records if "eval" in r] == [12, 12]  # the whole held-out set
    assert (project / "run" / "model" / "model.safetensors").is_file()
    # what using it outside ckrun needs (issue 36 point 4): the label map and how text became ids
    inputs = json.loads((project / "run" / "model" / "inputs.json").read_text())
    assert inputs["labels"] == {"0": "neg", "1": "pos"} and inputs["task"] == "sequence_classification"
    assert inputs["token_ids"]["kind"] == "utf-8 bytes" and inputs["token_ids"]["pad_id"] == 0
    exported = (project / "run" / "model" / "recipe.yaml").read_text()
    assert "labels:\n  - neg\n  - pos\n" in exported and "labels: null" not in exported


def test_the_language_model_trains_on_text_as_written(project, ckrun):
    code, _, err = ckrun("lm.yaml", "train.steps=3", "output.dir=run")  # 3 of its 200 steps, warming up
    assert code == 0, err
    assert [r["step"] for r in read_metrics(project / "run")] == [1, 2, 3]


def test_what_the_recipe_must_say_comes_from_validate_all_at_once(project, ckrun):
    code, _, err = ckrun("validate", "classify.yaml", "data.task=null", "eval.data.vocab_size=300",
                         "model={source: transformers, name: BertForSequenceClassification}")
    assert code == 2, err
    assert "data.task" not in err  # a transformers class says what it learns
    code, _, err = ckrun("validate", "classify.yaml", "data.task=null")
    assert code == 2 and err.count("\n") == 1 and "data.task: my_models:classifier is your own model, so ckrun " \
                                                  "cannot tell what it learns; set data.task" in err, err
    code, _, err = ckrun("validate", "lm.yaml", "model={source: transformers, name: GPT2LMHeadModel, config: "
                         "{n_layer: 1, n_embd: 32, n_head: 2}}", "data.vocab_size=300", "eval={every: 2, data: "
                         "{source: text, paths: [data/corpus.txt], vocab_size: 300}}")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err  # both in one go, not one per run
    assert all("vocab_size: a transformers model takes its vocabulary from model.config.vocab_size" in line
               for line in lines)


def test_an_embedding_too_small_for_the_data_says_what_to_size(project, ckrun):
    code, _, err = ckrun("lm.yaml", "train.steps=1", "model.config={vocab_size: 100}", "output.dir=run")
    assert code == 2 and "past its embedding: give the embedding the data's vocabulary (258 ids for UTF-8 bytes" in err
    code, _, err = ckrun("lm.yaml", "train.steps=1", "model.config={vocab_size: 100}", "data.vocab_size=100",
                         "output.dir=run2")
    assert code == 0, err  # byte ids folded below the model's 100
