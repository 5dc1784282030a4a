"""Before the first step a run says where it runs and what that means; a recipe meant for a GPU that
finds only a CPU says so in one line and runs on; `--device` picks the device."""

from __future__ import annotations

import logging

import torch

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.run.start_line import start_lines

CPU = torch.device("cpu")


def _messages_before_step_1(caplog) -> list[str]:
    messages = caplog.messages
    return messages[:next(i for i, m in enumerate(messages) if m.startswith("step 1/"))]


def test_a_bf16_recipe_on_a_cpu_says_so_before_step_1_and_runs_on(tmp_path, ckrun, caplog):
    caplog.set_level("INFO", logger="ckrun")
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "precision=bf16", "train.steps=2", "memory.max_mem=2GB",
                         f"output.dir={tmp_path}")
    assert code == 0, err
    before = _messages_before_step_1(caplog)
    assert any(m.startswith("device: cpu (") and "peak memory is the live tensor bytes ckrun's tracker counts in "
               "RAM; memory.max_mem 2.0 GB caps that RAM" in m for m in before), before
    [meant] = [m for m in before if "meant for a GPU" in m]
    assert meant.startswith("this recipe is meant for a GPU (bf16) but runs on the CPU") and "--device" in meant


def test_an_fp32_tiny_recipe_on_a_cpu_is_not_warned_about(tmp_path, ckrun, caplog):
    caplog.set_level("INFO", logger="ckrun")
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={tmp_path}")[0] == 0
    assert not any("meant for a GPU" in m for m in caplog.messages)
    assert not any(m.startswith("predicted:") for m in caplog.messages)  # no time model wired in: no time said


def test_a_large_model_and_a_predicted_time_are_named():
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "train.steps=1000"])
    lines = start_lines(recipe, CPU, predicted_step_s=2.5, parameters=335_000_000)
    assert "predicted: 2.5 s a step, 41m40s for 1000 steps" in lines
    assert any(line.startswith("this recipe is meant for a GPU (335M parameters)") for line in lines)


def test_device_picks_where_to_train(tmp_path, ckrun, caplog):
    caplog.set_level("INFO", logger="ckrun")
    recipe = [BERT_TINY, *[o for o in TINY_BERT if not o.startswith("train.device")], "train.steps=1"]
    assert ckrun(*recipe, "train.device=cuda", "--device", "cpu", f"output.dir={tmp_path}")[0] == 0
    assert any(m.startswith("training BertForMaskedLM on cpu") for m in caplog.messages)
    if not torch.cuda.is_available():
        code, _, err = ckrun(*recipe, "--device", "cuda", f"output.dir={tmp_path / 'gpu'}")
        assert code == 2 and "train.device: cuda asked for but no CUDA GPU is visible" in err, err


def test_a_large_model_announces_its_predicted_step_time_before_step_one(ckrun, tmp_path, caplog):
    """10M parameters and up: `ckrun run` prices the recipe's fake step on this device (the time
    model) and says what a step and the run should take; a small model's run says nothing of time."""
    large = ["model.config.hidden_size=256", "model.config.vocab_size=40000", "model.config.num_hidden_layers=4",
             "model.config.intermediate_size=512", "data.seq_len=16", "train.batch_size=2", "train.device=cpu"]
    with caplog.at_level(logging.INFO):
        code, _, _ = ckrun(BERT_TINY, *large, "train.steps=1", f"output.dir={tmp_path / 'large'}")
    assert code == 0 and "predicted: " in caplog.text and " a step, " in caplog.text and "for 1 steps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        code, _, _ = ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={tmp_path / 'small'}")
    assert code == 0 and "device: cpu" in caplog.text and "predicted: " not in caplog.text
