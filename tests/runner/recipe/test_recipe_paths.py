"""A path the recipe names is never empty: '' and '  ' mean the working directory, where a run wrote its
checkpoints, model and metrics among the user's files (and logged `/metrics.jsonl`)."""

from __future__ import annotations

import pytest

from conftest import BERT_TINY, TINY_BERT


@pytest.mark.parametrize("override, key", [
    ("output.dir=''", "output.dir"), ("output.dir='   '", "output.dir"), ("model.pretrained=''", "model.pretrained"),
    ("data={source: text, paths: ['']}", "data.paths.0"), ("data={source: image_folder, root: ' '}", "data.root"),
    ("data={source: text, paths: [a.txt], tokenizer: ''}", "data.tokenizer"),
    ("eval={data: {source: text, paths: [' ']}}", "eval.data.paths.0"),
])
def test_an_empty_path_is_refused_in_one_line(ckrun, override, key):
    code, out, err = ckrun("validate", BERT_TINY, override)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{key}: is empty (it would mean the working directory)" in err


def test_a_run_with_an_empty_output_dir_writes_nothing(tmp_path, ckrun, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", "output.dir=''")
    assert code == 2 and "output.dir: is empty" in err
    assert list(tmp_path.iterdir()) == []
