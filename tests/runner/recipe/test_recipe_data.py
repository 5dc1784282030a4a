"""Data sections answer for themselves, as the policies do: which tasks each trains, whether it runs
out, whether it draws held-out samples, where its vocabulary comes from. The recipe's checks ask
those answers (never a source's name), so every pairing of a section and a model's task is accepted
exactly when the section says it trains that task, and refused in one line that names a source
that does."""

from __future__ import annotations

import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conftest import BERT_TINY
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.problems import InputError
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.recipe.data import SECTIONS, Task, TokenisedFiles, sources_for

MODELS = {"masked_lm": "BertForMaskedLM", "causal_lm": "GPT2LMHeadModel", "seq2seq": "T5ForConditionalGeneration",
          "sequence_classification": "BertForSequenceClassification", "image_classification": "ViTForImageClassification"}


def _section(cls, tmp_path) -> dict:
    """The smallest valid section of `cls`, written as a recipe's data: (files that exist)."""
    (tmp_path / "images" / "cat").mkdir(parents=True, exist_ok=True)
    data = {"source": cls.tag()}
    if "paths" in cls.model_fields:
        data["paths"] = [str(tmp_path / "x.txt")]
    if "root" in cls.model_fields:
        data["root"] = str(tmp_path / "images")
    return data


def test_every_task_is_trained_by_a_section_and_the_answers_are_declared():
    assert set(typing.get_args(Task)) == {task for cls in SECTIONS for task in cls.tasks()}
    for cls in SECTIONS:
        assert isinstance(cls.holds, str) and cls.holds
        assert cls.tokenised == issubclass(cls, TokenisedFiles)  # the one base of the tokenised-text sections
        assert cls.held_out != cls.finite  # a stream that never runs out is the one that draws more of itself


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(SECTIONS), task=st.sampled_from(list(MODELS)))
def test_a_section_accepts_a_models_task_exactly_when_it_trains_it(tmp_path_factory, which, task):
    tmp_path = tmp_path_factory.mktemp("data")
    data = _section(which, tmp_path)
    overrides = [f"model={{source: transformers, name: {MODELS[task]}}}", f"data={data}", "train.device=cpu"]
    if task not in which.tasks():
        with pytest.raises(InputError) as refused:
            load_recipe(BERT_TINY, overrides)
        [problem] = refused.value.problems
        assert problem.key == "data.source" and f"source {' or '.join(sources_for(task))}" in problem.message
        assert f"learns {task}" in problem.message
    else:
        assert load_recipe(BERT_TINY, overrides).data.tasks() == which.tasks()


def test_eval_without_held_out_files_needs_a_section_that_draws_them(tmp_path):
    for cls in SECTIONS:
        data = {**_section(cls, tmp_path), "task": cls.tasks()[0]}
        recipe = {"model": {"source": "python", "name": "x:y"}, "data": data, "train": {"batch_size": 2, "steps": 1},
                  "eval": {"every": 1}}
        if cls.held_out:
            Recipe.model_validate(recipe)
            continue
        with pytest.raises(ValidationError, match=f"data.source {cls.tag()} has no held-out stream"):
            Recipe.model_validate(recipe)


def test_epochs_need_a_section_that_runs_out(tmp_path):
    for cls in SECTIONS:
        data = {**_section(cls, tmp_path), "task": cls.tasks()[0]}
        recipe = {"model": {"source": "python", "name": "x:y"}, "data": data, "train": {"batch_size": 2, "epochs": 1}}
        if cls.finite:
            Recipe.model_validate(recipe)
            continue
        with pytest.raises(ValidationError, match=f"{cls.tag()} data never runs out"):
            Recipe.model_validate(recipe)
