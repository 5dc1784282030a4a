"""Library model checks that passed are kept in the user's cache (runner/builders/check_cache.py): a second
validate imports nothing heavy and says the same; a failure is never kept; a damaged table is rebuilt;
the key follows everything a pass depends on. Each test has its own empty cache (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import children
from conftest import BERT_TINY, ROOT
from ckrun.runner.disk import user_cache
from ckrun.runner.builders import check_cache
from ckrun.runner.recipe.load import load_recipe


def table() -> dict:
    path = Path(os.environ["XDG_CACHE_HOME"]) / "ckrun" / check_cache.TABLE
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_second_validate_imports_neither_torch_nor_transformers(ckrun):
    assert ckrun("validate", BERT_TINY)[0] == 0
    code = ("import sys\nfrom ckrun.runner.cli import main\nstatus = main(['validate', 'bert_tiny'])\n"
            "print(status, sorted(m for m in ('torch', 'transformers', 'torchvision') if m in sys.modules))")
    done = children.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.splitlines()[-1] == "0 []", done.stderr[-2000:]
    assert "bert_tiny.yaml: OK" in done.stdout


# what a pass of bert_tiny keeps: its position table, and its vocabulary for data.tokenizer's check
KEPT = {"max_positions": 128, "vocab": {"size": 8192, "width": 128, "tied": True, "special": {"pad": 0}}}


def test_a_kept_pass_still_holds_the_sequence_to_the_position_table(ckrun):
    assert ckrun("validate", BERT_TINY)[0] == 0
    assert list(table().values()) == [KEPT]  # bert_tiny's max_position_embeddings, and its vocabulary
    code, _, err = ckrun("validate", BERT_TINY, "data.seq_len=129")
    assert code == 2 and "129 tokens exceed BertForMaskedLM's 128 positions" in err, err


def test_a_config_that_fails_is_checked_afresh_every_time(ckrun):
    for _ in range(2):
        code, _, err = ckrun("validate", BERT_TINY, "model.config.hidden_size=129")  # 2 heads do not divide it
        assert code == 2 and "model.config.hidden_size" in err and "not a multiple" in err, err
    assert table() == {}


def test_a_damaged_table_is_rebuilt(ckrun):
    path = Path(os.environ["XDG_CACHE_HOME"]) / "ckrun" / check_cache.TABLE
    path.parent.mkdir(parents=True, exist_ok=True)
    for damage in ('{"a": ', '["not", "a", "dict"]', '{"k": true}', '{"k": {"max_positions": "128", "vocab": null}}',
                   '{"k": {"max_positions": 128, "vocab": null, "more": 1}}', '{"k": {"max_positions": 128}}',
                   '{"k": {"max_positions": 128, "vocab": {"size": "8192"}}}'):
        path.write_text(damage)
        assert ckrun("validate", BERT_TINY)[0] == 0
        assert list(table().values()) == [KEPT], damage  # written again, whole


def test_the_key_follows_everything_a_pass_depends_on(monkeypatch):
    spec = load_recipe(BERT_TINY).model
    key = check_cache._key(spec)
    assert key == check_cache._key(spec.model_copy())
    assert check_cache._key(spec.model_copy(update={"pretrained": "/elsewhere"})) == key  # checked every time
    assert check_cache._key(spec.model_copy(update={"name": "BertModel"})) != key
    assert check_cache._key(spec.model_copy(update={"config": {**spec.config, "hidden_size": 64}})) != key
    assert check_cache._key(spec.model_copy(update={"source": "python", "name": "m:f"})) is None  # user code
    real = user_cache.metadata.version
    for package in check_cache._PACKAGES:
        with monkeypatch.context() as patch:
            patch.setattr(user_cache.metadata, "version", lambda name, p=package: "0.0.0" if name == p else real(name))
            assert check_cache._key(spec) != key, package
    monkeypatch.setattr(check_cache, "_CHECK_CODE", (*check_cache._CHECK_CODE[:-1], "__init__.py"))
    assert check_cache._key(spec) != key  # ckrun's own check code is part of it
