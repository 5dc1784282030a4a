"""Every malformed recipe or override: exactly one line naming file:line:col (or the override)
and the key, exit status 2, no traceback."""

import sys
from pathlib import Path

import pytest

import children
from conftest import BERT_TINY

GOOD = Path(BERT_TINY).read_text()

# (what is wrong, replace this text in bert_tiny.yaml, with this, expected fragment of the one line)
FILE_CASES = [
    ("unknown key", "  steps: 30", "  stepz: 30", ":29:3: train.stepz: unknown key (did you mean steps?)"),
    ("misspelled section", "train:\n", "trian:\n", ":27:1: trian: unknown key (did you mean train?)"),
    ("wrong type", "  steps: 30", "  steps: thirty", ":29:3: train.steps: input should be a valid integer"),
    ("bad size", "memory:\n", "memory:\n  max_mem: 40XB\n", "memory.max_mem: '40XB' is not a size"),
    ("micro-batch does not divide", "memory:\n", "memory:\n  micro_batch: 5\n", "memory.micro_batch: memory.micro_batch 5 does not divide"),
    ("missing model directory", "  name: BertForMaskedLM\n", "  name: BertForMaskedLM\n  pretrained: /no/such/dir\n",
     "model.pretrained: no local directory '/no/such/dir'"),
    ("unknown torchvision model", "  source: transformers\n  name: BertForMaskedLM", "  source: torchvision\n  name: resnet5",
     "model.name: no torchvision model named 'resnet5' (did you mean resnet50?)"),
    ("failing import path", "  source: transformers\n  name: BertForMaskedLM", "  source: python\n  name: no_such_pkg.models:net",
     "model.name: cannot import 'no_such_pkg.models'"),
    ("import path without attribute", "  source: transformers\n  name: BertForMaskedLM", "  source: python\n  name: json:nope",
     "model.name: module 'json' has no 'nope'"),
    ("unknown transformers class", "BertForMaskedLM", "BertForMaskedLN", "(did you mean BertForMaskedLM?)"),
    ("typo in transformers config", "    hidden_size: 128", "    hiden_size: 128", "model.config.hiden_size: BertConfig has no setting 'hiden_size' (did you mean hidden_size?)"),
    ("precision typo", "precision: fp32", "precision: bf61", "precision: 'bf61' is not one of fp32, bf16, fp16 (did you mean bf16?)"),
    ("duplicate key", "  steps: 30", "  steps: 30\n  steps: 40", "train.steps: duplicate key (first set at line 29)"),
    ("python tag", "  seed: 0", "  seed: !!python/object/apply:os.getpid []", "tag 'tag:yaml.org,2002:python/object/apply:os.getpid' is not allowed"),
    ("unknown checkpoint policy", "{policy: none}", "{policy: ful}", "memory.checkpointing: unknown policy 'ful' (did you mean full?)"),
    ("every zero", "{policy: none}", "{policy: every, every: 0}", "memory.checkpointing.every: input should be greater than 0"),
    ("negative learning rate", "lr: 1e-3", "lr: -1e-3", "train.optimizer.lr: input should be greater than 0"),
    ("unknown optimizer", "name: adamw", "name: adamx", "train.optimizer: unknown name 'adamx' (did you mean adamw?)"),
    ("text data without paths", "  source: synthetic ", "  source: text ", "data.paths: required key is missing"),
    ("YAML syntax error", "  seed: 0", "  seed: [0", "invalid YAML"),
]

OVERRIDE_CASES = [
    (["train.steps=ten"], "override 'train.steps=ten': train.steps: input should be a valid integer"),
    (["train.batch_size=0"], "override 'train.batch_size=0': train.batch_size: input should be greater than 0"),
    (["memory.micro_batch=3"], "override 'memory.micro_batch=3': memory.micro_batch: memory.micro_batch 3 does not divide train.batch_size 16"),
    (["model.config.num_hiden_layers=2"], "model.config.num_hiden_layers: BertConfig has no setting 'num_hiden_layers' (did you mean num_hidden_layers?)"),
    (["train.steps"], "override 'train.steps': an override looks like dotted.key=value"),
    (["memory.checkpointing.policy=layers"], "override 'memory.checkpointing.policy=layers': memory.checkpointing.layers: required key is missing"),
    # values that validate as numbers but that training cannot compute with
    (["train.optimizer.lr=.inf"], "train.optimizer.lr: inf is not finite"),
    (["train.optimizer.lr=1e400"], "train.optimizer.lr: inf is not finite (YAML reads numbers past 1.8e308 as inf)"),
    (["train.optimizer.lr=.nan"], "train.optimizer.lr: nan is not a number training can use"),
    (["train.optimizer.lr=1e300"], "train.optimizer.lr: 1e+300 is beyond float32's range"),
    (["model.config.layer_norm_eps=.nan"], "model.config.layer_norm_eps: nan is not a number training can use"),
    (["train.seed=100000000000000000000000"], "train.seed: this integer is beyond int64's range"),
    (["memory.max_mem=0"], "memory.max_mem: the cap must be positive but got 0"),
    (["memory.max_mem=-1"], "memory.max_mem: a size cannot be negative"),
    (["train.optimizer.betas=[1, 0.5]"], "train.optimizer.betas.0: input should be less than 1"),
    # a list or mapping where a word is expected, in fields that select a variant or not
    (["memory.checkpointing.policy=2"], "memory.checkpointing: policy must be one of none, full, every, layers, sqrt, selective (got 2)"),
    (["model.source=[1]"], "model.source: [1] is not one of transformers, torchvision, python"),
    (["model.name={a: 1}"], "model.name: input should be a valid string (got {'a': 1})"),
    (["train.optimizer.name=[adamw]"], "train.optimizer: name must be one of adamw, sgd, adamw_8bit, "),
]


@pytest.mark.parametrize("name, old, new, expected", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_recipe_file_gives_one_located_line(tmp_path, ckrun, name, old, new, expected):
    assert old in GOOD, f"test case {name!r} no longer matches bert_tiny.yaml"
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace(old, new, 1))
    code, out, err = ckrun("validate", recipe)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{recipe}:") and expected in lines[0], lines[0]


@pytest.mark.parametrize("overrides, expected", OVERRIDE_CASES, ids=[c[0][0] for c in OVERRIDE_CASES])
def test_bad_override_names_the_override(ckrun, overrides, expected):
    code, out, err = ckrun("validate", BERT_TINY, *overrides)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and expected in err, err


def test_every_problem_in_a_file_is_reported_at_once(tmp_path, ckrun):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("  steps: 30", "  stepz: 30").replace("precision: fp32", "precision: fp64")
                      .replace("lr: 1e-3", "lr: 0"))
    code, _, err = ckrun("validate", recipe)
    keys = [line.split(": ")[1] for line in err.splitlines()]
    assert code == 2 and keys == ["train.stepz", "train.optimizer.lr", "precision"]  # "steps missing" is implied by stepz


def test_missing_recipe_file_lists_library(ckrun):
    code, _, err = ckrun("validate", "bert_tinny")
    assert code == 2 and "did you mean bert_tiny?" in err and len(err.splitlines()) == 1


def test_bad_input_through_the_installed_console_script(tmp_path):
    import shutil
    import sysconfig

    # the script pip installed for this interpreter: in its environment's scripts directory, which
    # is on PATH only when the environment is activated (`.venv/bin/python -m pytest` does not)
    script = shutil.which("ckrun", path=sysconfig.get_path("scripts")) or shutil.which("ckrun")
    assert script, "no ckrun console script: install the project (pip install -e .) into this environment"
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("  steps: 30", "  stepz: 30"))
    done = children.run([script, str(recipe)])
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().endswith("train.stepz: unknown key (did you mean steps?)")


# Found only when the model, data or plan is built, yet still placed at the key's line in the file
# (what is wrong, replace this text in bert_tiny.yaml, with this, key, fragment of the one line)
BUILD_CASES = [
    ("checkpointing a block out of range", "{policy: none}", "{policy: layers, layers: [30]}",
     ":38:", "memory.checkpointing.layers: block 30 is out of range"),
    ("offload on a CPU", "memory:\n", "memory:\n  offload: {policy: all}\n", ":38:", "memory.offload"),
    ("heads that do not divide the width", "num_attention_heads: 2", "num_attention_heads: 3", ":15:5:",
     "model.config.hidden_size: BertForMaskedLM cannot be built from this config"),
    ("a factory that raises", "  source: transformers\n  name: BertForMaskedLM",
     "  source: python\n  name: faulty_models:raises", ":12:3:", "model.name: faulty_models:raises raised "
     "ValueError: width must be even (at faulty_models.py:2)"),
    ("a factory that returns no module", "  source: transformers\n  name: BertForMaskedLM",
     "  source: python\n  name: faulty_models:returns_a_list", ":12:3:", "model.name"),
]
BUILD_OVERRIDES = ["data.seq_len=32", "train.batch_size=4", "train.steps=1", "data.task=masked_lm", "data.vocab_size=64"]


@pytest.mark.parametrize("name, old, new, where, expected", BUILD_CASES, ids=[c[0] for c in BUILD_CASES])
def test_problems_found_while_building_name_the_recipe_line(tmp_path, ckrun, monkeypatch, name, old, new, where, expected):
    assert old in GOOD, f"test case {name!r} no longer matches bert_tiny.yaml"
    (tmp_path / "faulty_models.py").write_text(
        "def raises(**config):\n    raise ValueError('width must be even')\n\n\n"
        "def returns_a_list(**config):\n    return [1, 2]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faulty_models", raising=False)  # another test's, from its own tmp_path
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace(old, new, 1))
    code, out, err = ckrun(recipe, *BUILD_OVERRIDES, "train.device=cpu", f"output.dir={tmp_path / 'run'}")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"{recipe}{where}") and expected in lines[0], lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_asked_for_without_a_gpu_names_the_line(tmp_path, ckrun):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("  seed: 0", "  seed: 0\n  device: cuda", 1))
    code, _, err = ckrun(recipe, f"output.dir={tmp_path / 'run'}")
    assert code == 2 and err.startswith(f"{recipe}:34:3: train.device: cuda asked for but no CUDA GPU is visible")


def test_estimate_places_plan_errors_too(tmp_path, ckrun):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("{policy: none}", "{policy: layers, layers: [30]}", 1))
    code, _, err = ckrun("estimate", recipe, "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{recipe}:38:") and "memory.checkpointing.layers: block 30 is out of range" in err


def test_show_blocks_places_build_errors_too(tmp_path, ckrun, monkeypatch):
    (tmp_path / "faulty_models.py").write_text("def returns_a_list(**config):\n    return [1, 2]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faulty_models", raising=False)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("  source: transformers\n  name: BertForMaskedLM",
                                   "  source: python\n  name: faulty_models:returns_a_list", 1))
    code, _, err = ckrun("show", recipe, "--blocks", "model.config={}", "data.task=masked_lm")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{recipe}:12:3: model.name: faulty_models:returns_a_list returned list"), err


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut short", "pickled"], ids=["empty", "truncated", "pickled code"])
def test_pretrained_weights_that_are_not_tensors_are_one_line(tmp_path, ckrun, content):
    import torch

    weights = tmp_path / "weights"
    weights.mkdir()
    if content == "pickled":
        torch.save({"fc": torch.nn.Linear(2, 2)}, weights / "model.pt")  # a module object: pickled code
    else:
        (weights / "model.pt").write_bytes(content)
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace("  source: transformers\n  name: BertForMaskedLM",
                                   f"  source: torchvision\n  name: resnet18\n  pretrained: {weights}", 1))
    code, _, err = ckrun(recipe, "model.config={}", "train.device=cpu", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"{recipe}:13:3: model.pretrained: {weights}/model.pt ") and "weights_only" not in err
