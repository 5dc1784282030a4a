"""A tokenizer held against its model (issue 36 point 3): a model vocabulary smaller than the tokenizer's
is one located line and status 2 from `ckrun validate` (it was an IndexError after a training step), a
larger one past padding a warning naming both sizes and what the rows cost, and special ids the config
sets outside the tokenizer an error. The tokenizer's facts are read from its files as transformers reads them."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckrun.runner.builders.make_tokenizer import train_tokenizer
from ckrun.runner.builders.tokenizer_facts import tokenizer_facts

LINES = ["the cat sat on the mat", "a dog ate the bone", "birds sing in the morning", "ships sail at dawn"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train.txt").write_text("\n".join(LINES * 30) + "\n")
    return folder


@pytest.fixture(scope="module")
def tokenizer(corpus):
    facts = train_tokenizer([str(corpus / "*.txt")], corpus / "tok", 300, min_frequency=1)
    return corpus / "tok", facts


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# the corpus merges to 300 tokens at most: a larger size is refused (tests/runner/cli/test_tokenizer.py)
@given(vocab=st.integers(258, 300), extra=st.lists(st.sampled_from(["<mask>", "<sep>", "[X]"]), unique=True))
def test_the_facts_read_from_the_files_are_what_transformers_loads(corpus, tmp_path_factory, vocab, extra):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(corpus / "*.txt")], folder, vocab, min_frequency=1)
    loaded = AutoTokenizer.from_pretrained(str(folder))
    if extra:  # tokens added after training, as users add them: ids past the trained vocabulary
        loaded.add_special_tokens({"additional_special_tokens": extra})
        loaded.save_pretrained(str(folder))
        loaded = AutoTokenizer.from_pretrained(str(folder))
    facts = tokenizer_facts(folder)
    assert facts.size == len(loaded)
    assert facts.special == {name: getattr(loaded, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}


def _recipe(path, tokenizer, config: str) -> str:
    path.write_text(f"model:\n  source: transformers\n  name: GPT2LMHeadModel\n  config: {{{config}}}\n"
                    f"data: {{source: text, paths: [{path.parent}/corpus/*.txt], tokenizer: {tokenizer}, seq_len: 16}}\n"
                    "train: {batch_size: 2, steps: 1, device: cpu}\n")
    return str(path)


SMALL = "n_positions: 32, n_embd: 16, n_layer: 1, n_head: 2"


def test_a_model_vocabulary_smaller_than_the_tokenizers_is_one_located_line(tokenizer, tmp_path, ckrun):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the cat\n")
    folder, facts = tokenizer
    recipe = _recipe(tmp_path / "r.yaml", folder, f"vocab_size: 200, {SMALL}")
    code, _, err = ckrun("validate", recipe)
    lines = [line for line in err.splitlines() if line.startswith(recipe)]  # (torchao's import warnings aside)
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"{recipe}:4:") and f"model.config.vocab_size: the model's vocabulary has 200 ids but the " \
        f"tokenizer {folder} has {facts.size} tokens" in err and f"set model.config.vocab_size to {facts.size}" in err
    code, _, err = ckrun(recipe, f"output.dir={tmp_path / 'run'}")  # the run says the same, before any step
    assert code == 2 and "index past the embedding" in err and "IndexError" not in err


@pytest.mark.parametrize("size, warned", [(50257, True), (384, False), (300, False)])
def test_a_larger_vocabulary_is_named_with_both_sizes_and_its_cost_unless_it_is_padding(tokenizer, tmp_path, ckrun,
                                                                                         caplog, size, warned):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the cat\n")
    folder, facts = tokenizer
    caplog.set_level(logging.WARNING)
    code, out, err = ckrun("validate", _recipe(tmp_path / "r.yaml", folder, f"vocab_size: {size}, {SMALL}"))
    assert code == 0 and out.endswith("OK\n"), err
    warnings = [r.getMessage() for r in caplog.records if "vocabulary" in r.getMessage()]
    assert bool(warnings) == warned, warnings
    if warned:
        assert f"has {size} ids but the tokenizer {folder} has {facts.size} tokens: {size - facts.size} rows are never " \
               "used" in warnings[0] and "MB of fp32 weights, gradients and AdamW state" in warnings[0]


def test_a_special_id_the_config_sets_outside_the_tokenizer_is_refused(tokenizer, tmp_path, ckrun, caplog):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the cat\n")
    folder, facts = tokenizer
    code, _, err = ckrun("validate", _recipe(tmp_path / "r.yaml", folder, f"vocab_size: 300, eos_token_id: 50256, {SMALL}"))
    assert code == 2 and f"model.config.eos_token_id: 50256 is not a token of the tokenizer ({facts.size} tokens" in err
    assert f"set it to {facts.special['eos']}, the tokenizer's eos token" in err
    caplog.set_level(logging.WARNING)
    code, _, err = ckrun("validate", _recipe(tmp_path / "r.yaml", folder, f"vocab_size: 300, eos_token_id: 5, {SMALL}"))
    assert code == 0 and any("eos_token_id: 5, but the tokenizer's eos token is 0" in r.getMessage()
                             for r in caplog.records), err


def test_a_python_models_own_vocabulary_is_held_to_the_tokenizer_when_built(tokenizer, tmp_path, ckrun, monkeypatch):
    """A model that says its size only as an attribute: the run refuses it in one line, not an IndexError."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the cat sat\n" * 20)
    (tmp_path / "small_lm.py").write_text(
        "import torch\n\nclass LM(torch.nn.Module):\n    vocab_size = 100\n\n    def __init__(self):\n"
        "        super().__init__()\n        self.embed, self.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100)\n\n"
        "    def forward(self, input_ids):\n        return self.head(self.embed(input_ids))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder, facts = tokenizer
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{source: python, name: 'small_lm:LM'}}\ndata: {{source: text, task: causal_lm, "
                      f"paths: [{tmp_path}/corpus/*.txt], tokenizer: {folder}, seq_len: 8}}\n"
                      f"train: {{batch_size: 2, steps: 1, device: cpu}}\noutput: {{dir: {tmp_path / 'run'}}}\n")
    code, _, err = ckrun(str(recipe))
    assert code == 2 and f"data.tokenizer: the model's vocabulary has 100 ids but the tokenizer {folder} has " \
                         f"{facts.size} tokens" in err, err


@settings(max_examples=200, deadline=None)
@given(tokens=st.integers(2, 70_000), model=st.integers(2, 70_000), eos=st.integers(0, 70_000), sets_eos=st.booleans(),
       held_out=st.booleans())
def test_every_size_and_id_pair_gets_its_verdict(tokens, model, eos, sets_eos, held_out):
    """An error exactly when the model is smaller than the tokenizer (or sets an id outside it), a
    warning exactly when it is larger than the tokenizer rounded up to a multiple of 128, said once
    when eval.data reads the same tokenizer as data."""
    from types import SimpleNamespace
    from unittest.mock import patch

    from ckrun.runner.builders import vocab
    from ckrun.runner.builders.tokenizer_facts import TokenizerFacts

    given_config = {"eos_token_id": eos} if sets_eos else {}
    data = SimpleNamespace(tokenizer="tok", vocab_size=None)
    recipe = SimpleNamespace(data=data, eval=SimpleNamespace(data=data) if held_out else None,
                             model=SimpleNamespace(config=given_config))
    facts = TokenizerFacts(tokens, {"eos": 0})
    warned = []
    with patch.object(vocab, "tokenizer_facts", lambda _: facts), \
            patch.object(vocab.log, "warning", lambda *args: warned.append(args)):
        found = vocab.vocab_problems(recipe, {"size": model, "width": 64, "tied": True, "special": {}})
    keys = [problem.key for problem in found]
    assert ("model.config.vocab_size" in keys) == (model < tokens)
    assert ("model.config.eos_token_id" in keys) == (sets_eos and eos >= tokens)
    too_large = model > -(-tokens // 128) * 128
    assert sum("rows are never used" in args[0] for args in warned) == too_large
    assert sum("generation would" in args[0] for args in warned) == (sets_eos and 0 < eos < tokens)
