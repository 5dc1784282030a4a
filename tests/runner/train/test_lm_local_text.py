"""A GPT-2-style language model on local text, start to end (issue 36 points 4 and 5): a tokenizer
made from the text (`ckrun tokenizer`), training with eval, the export, and the export used as
transformers users use it: `AutoModelForCausalLM` and `AutoTokenizer` load it without a warning, its
config carries the tokenizer's special ids, and `generate` stops at the end token."""

from __future__ import annotations

import json
import logging
import warnings

import pytest

# distinct beginnings: each prompt has one continuation to learn, ended by <|endoftext|>
LINES = ["the cat sat on the mat", "a dog ate the bone", "birds sing in the morning", "ships sail at dawn"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from ckrun.runner.cli import main

    folder = tmp_path_factory.mktemp("lm")
    (folder / "corpus").mkdir()
    (folder / "corpus" / "train.txt").write_text("\n".join(LINES * 40) + "\n")
    (folder / "valid.txt").write_text("\n".join(LINES) + "\n")
    assert main(["tokenizer", str(folder / "corpus" / "*.txt"), "--out", str(folder / "tok"), "--vocab-size", "300",
                 "--min-frequency", "1"]) == 0
    size = json.loads((folder / "tok" / "tokenizer.json").read_text())["added_tokens"]  # ids 0 and 1
    assert [(t["content"], t["id"]) for t in size] == [("<|endoftext|>", 0), ("<pad>", 1)]
    recipe = folder / "lm.yaml"
    recipe.write_text(f"""
model:
  source: transformers
  name: GPT2LMHeadModel
  config: {{vocab_size: 300, n_positions: 32, n_embd: 64, n_layer: 2, n_head: 2}}
data: {{source: text, paths: [{folder}/corpus/*.txt], tokenizer: {folder}/tok, split: lines, seq_len: 32}}
train:
  batch_size: 16
  steps: 150
  optimizer: {{name: adamw, lr: 3.0e-3, weight_decay: 0.0}}
  scheduler: {{name: cosine, warmup_steps: 10}}
  device: cpu
  seed: 0
eval: {{every: 50, data: {{source: text, paths: [{folder}/valid.txt], tokenizer: {folder}/tok, split: lines, seq_len: 32}}}}
output: {{dir: {folder}/run, log_every: 50}}
""")
    assert main([str(recipe)]) == 0
    return folder


def test_the_exported_config_carries_the_tokenizers_special_ids(trained):
    config = json.loads((trained / "run" / "model" / "config.json").read_text())
    generation = json.loads((trained / "run" / "model" / "generation_config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (300, 0, 0, 1)
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, 0, 1)
    inputs = json.loads((trained / "run" / "model" / "inputs.json").read_text())
    assert inputs["task"] == "causal_lm" and inputs["token_ids"]["kind"] == "tokenizer"


def test_transformers_loads_it_without_a_warning_and_generate_stops_at_the_end_token(trained, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(str(trained / "run" / "model"))
        tokenizer = AutoTokenizer.from_pretrained(str(trained / "run" / "model"))
        prompt = tokenizer("the cat", return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    assert said == [], said
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert new[-1] == tokenizer.eos_token_id and len(new) < 20, tokenizer.decode(new)
    assert tokenizer.decode(new, skip_special_tokens=True) == " sat on the mat"


def test_the_readmes_recipe_for_it_validates(trained, tmp_path, monkeypatch, ckrun):
    import re
    import shutil

    from conftest import ROOT

    section = (ROOT / "docs" / "recipes.md").read_text().split("## A language model on your own text", 1)[1].split("\n## ", 1)[0]
    (recipe,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    for part in ("train", "valid"):
        (tmp_path / "corpus" / part).mkdir(parents=True)
        (tmp_path / "corpus" / part / "a.txt").write_text("\n".join(LINES) + "\n")
    shutil.copytree(trained / "tok", tmp_path / "tok")
    (tmp_path / "lm.yaml").write_text(recipe.replace("vocab_size: 8192", "vocab_size: 300"))  # this tokenizer's size
    monkeypatch.chdir(tmp_path)
    code, out, err = ckrun("validate", "lm.yaml")
    assert code == 0 and out.endswith("lm.yaml: OK\n"), err
