"""What validate says OK to, the run does not refuse (issue 32 item 9): for the faults validate can see
without building (data paths that match nothing, records without the recipe's fields, an image folder
without class folders, a python factory returning no module, a language model with no vocabulary),
validate refuses at the same key as the run's build, and passes what the build passes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.builders.checks import load_checked
from ckrun.runner.builders.records import read_examples
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.problems import InputError
from ckrun.runner.recipe.recipe import RecordsData

FIELDS = ["text", "label", "other"]


def _keys(call) -> list[str]:
    try:
        call()
    except InputError as err:
        return [problem.key for problem in err.problems]
    return []


def _build_key(data: RecordsData) -> list[str]:
    try:
        read_examples(data)
    except BuildError as err:
        return [err.key]
    return []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(present=st.lists(st.sampled_from(FIELDS), unique=True), input_field=st.sampled_from(FIELDS),
       target_field=st.sampled_from(FIELDS), kind=st.sampled_from(["jsonl", "csv", "none", "glob"]))
def test_validate_refuses_records_exactly_where_the_run_would(tmp_path, present, input_field, target_field, kind):
    path = tmp_path / f"examples.{'csv' if kind == 'csv' else 'jsonl'}"
    record = {name: f"{name} value" for name in present}
    if kind == "csv":
        with path.open("w", newline="") as out:
            csv.writer(out).writerows([list(record), list(record.values())])
    else:
        path.write_text(json.dumps(record) + "\n")
    pattern = str(tmp_path / "nothing-*.jsonl") if kind == "none" else str(tmp_path / "examples.*") if kind == "glob" else str(path)
    data = {"source": "records", "paths": [pattern], "seq_len": 32, "input_field": input_field, "target_field": target_field}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(Path(BERT_TINY).read_text())
    validate = _keys(lambda: load_checked(recipe, [*TINY_BERT, "model.name=BertForSequenceClassification",
                                                   f"data={json.dumps(data)}"]))
    run = _build_key(RecordsData.model_validate(data))
    assert validate == run, (validate, run)


@pytest.mark.parametrize("data, key, message", [
    ({"source": "text", "paths": ["{tmp}/*.md"], "seq_len": 32}, "data.paths", "no files match"),
    ({"source": "text", "paths": ["{tmp}"], "seq_len": 32}, "data.paths", "no files match"),  # a folder
    ({"source": "image_folder", "root": "{tmp}"}, "data.root", "has no class folders"),
])
def test_validate_refuses_data_files_the_run_cannot_read(tmp_path, data, key, message):
    data = json.loads(json.dumps(data).replace("{tmp}", str(tmp_path / "empty")))
    (tmp_path / "empty").mkdir()
    model = ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 2}"] \
        if data["source"] == "image_folder" else []
    with pytest.raises(InputError) as caught:
        load_checked(BERT_TINY, [*TINY_BERT, *model, f"data={json.dumps(data)}"])
    [problem] = caught.value.problems
    assert problem.key == key and message in problem.message


def test_a_dataset_target_column_is_checked_for_the_models_task(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "d.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')
    data = {"source": "dataset", "paths": [str(tmp_path / "d.jsonl")], "seq_len": 32, "target_field": "nosuch"}
    with pytest.raises(InputError) as caught:  # the task comes from the model class, not data.task
        load_checked(BERT_TINY, [*TINY_BERT, "model.name=BertForSequenceClassification", f"data={json.dumps(data)}"])
    assert [p.key for p in caught.value.problems] == ["data.target_field"]


OWN = '''import torch

class Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input_ids):
        return self.lin(input_ids.float().unsqueeze(-1).expand(-1, -1, 4))

def nothing():
    return None

def bag():
    return Bag()
'''


@pytest.mark.parametrize("factory, task, key, message", [
    ("nothing", "image_classification", "model.name", "own_checked_models:nothing returned NoneType, not a "
                                                      "torch.nn.Module; return the model it builds"),
    ("bag", "causal_lm", "data.vocab_size", "has no vocab_size (no config or attribute of that name); set "
                                            "data.vocab_size"),
])
def test_an_own_model_the_run_would_refuse_is_refused_by_validate(tmp_path, monkeypatch, ckrun, factory, task, key,
                                                                   message):
    (tmp_path / "own_checked_models.py").write_text(OWN)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: python, name: 'own_checked_models:{factory}'}}\n"
                      f"data: {{source: synthetic, task: {task}, seq_len: 8}}\ntrain: {{batch_size: 2, steps: 1}}\n")
    with pytest.raises(InputError) as caught:
        load_checked(recipe, build_own=True)  # as `ckrun validate` checks
    [problem] = caught.value.problems
    assert problem.key == key and message in problem.message, problem
    code, _, err = ckrun("validate", recipe)
    lines = [line for line in err.splitlines() if not line[:1].isupper() or line.startswith("ckrun")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{recipe}:") and f" {key}: " in lines[0], err
    recipe.write_text(recipe.read_text().replace("seq_len: 8", "seq_len: 8, vocab_size: 16"))
    if factory == "bag":
        load_checked(recipe, build_own=True)  # with its vocabulary named it passes
