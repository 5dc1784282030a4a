"""Micro-batching changes what BatchNorm computes: for a model with BatchNorm, `tune` keeps the
recipe's micro_batch unless --search-micro-batch, and says so in its space lines and tuned.yaml.
Probes use the deterministic fake child; the model's facts come from the real model child."""

import logging
import os

import yaml

from test_tune_user_code import user_recipe, write_user_model
from tune_helpers import report, use_fake_child


def _tune(ckrun, monkeypatch, tmp_path, batchnorm: bool, *flags):
    use_fake_child(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(tmp_path), os.environ["PYTHONPATH"])))  # the model child
    monkeypatch.syspath_prepend(str(tmp_path))  # the recipe's validation imports the user's module here
    recipe = user_recipe(tmp_path, write_user_model(tmp_path, "bn_net"), {"batchnorm": batchnorm})
    code, out, err = ckrun("tune", recipe, "memory.micro_batch=4", "--max-mem", "100MB", "--output",
                           tmp_path / "tune", "--trials", "4", "--no-train", "--no-screen", *flags)
    assert code == 0, err
    tuned = (tmp_path / "tune" / "tuned.yaml").read_text()
    return [t["plan"]["micro_batch"] for t in report(tmp_path / "tune")["trials"]], tuned


def test_batchnorm_keeps_the_recipes_micro_batch(ckrun, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    micro_batches, tuned = _tune(ckrun, monkeypatch, tmp_path, True)
    assert set(micro_batches) == {4}
    assert "space: micro_batch pinned to the recipe's 4: the model has BatchNorm (3 layers: blocks.0.1" in caplog.text
    assert "--search-micro-batch searches [1, 2, 4, 8]" in caplog.text
    assert "# note: " not in tuned and "#   note:       micro_batch 4: the recipe's, not searched: the model has " \
        "BatchNorm" in tuned
    assert yaml.safe_load(tuned)["memory"]["micro_batch"] == 4


def test_search_micro_batch_searches_it_and_says_what_it_changes(ckrun, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    micro_batches, tuned = _tune(ckrun, monkeypatch, tmp_path, True, "--search-micro-batch")
    assert len(set(micro_batches)) > 1
    assert "micro_batch in [1, 2, 4, 8]" in caplog.text
    assert "searched (--search-micro-batch) although the model has BatchNorm" in caplog.text
    chosen = yaml.safe_load(tuned)["memory"]["micro_batch"]
    if chosen < 8:
        assert f"micro_batch {chosen} of batch 8 (--search-micro-batch): BatchNorm normalises over {chosen}" in tuned


def test_without_batchnorm_micro_batch_is_searched(ckrun, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    micro_batches, _ = _tune(ckrun, monkeypatch, tmp_path, False)
    assert len(set(micro_batches)) > 1 and "micro_batch pinned" not in caplog.text
