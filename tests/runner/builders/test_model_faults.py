"""A model the recipe cannot build is one line naming the recipe key, at validate where it can be
known without running user code, and at build time for what only running it shows."""

import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from conftest import BERT_TINY, TINY_BERT

GOOD = Path(BERT_TINY).read_text()


@pytest.mark.parametrize("override, expected", [
    ("model.config.hidden_size=131", "model.config.hidden_size: BertForMaskedLM cannot be built from this config: "
                                     "The hidden size (131) is not a multiple of the number of attention heads (2)"),
    ('model.config.hidden_size="128"', "model.config.hidden_size: BertConfig expected int, got str"),
    ("model.config.num_hidden_layers=1000000", "model.config.num_hidden_layers: 1000000 is not a layer count"),
    ("model.config.hidden_act=gelu_fancy", "model.config.hidden_act: BertForMaskedLM cannot be built from this config: "
                                           "KeyError: 'gelu_fancy'"),
])
def test_transformers_config_faults_are_found_at_validate(ckrun, override, expected):
    code, out, err = ckrun("validate", BERT_TINY, override)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(f"override '{override}': {expected}"), err


def test_a_config_fault_in_the_file_points_at_its_line(tmp_path, ckrun):
    recipe = tmp_path / "heads.yaml"
    recipe.write_text(GOOD.replace("    hidden_size: 128", "    hidden_size: 100\n    num_attention_heads: 3", 1)
                      .replace("    num_attention_heads: 2\n", "", 1))
    code, _, err = ckrun("validate", recipe)
    line = GOOD.splitlines().index("    hidden_size: 128") + 1
    assert code == 2 and err.startswith(f"{recipe}:{line}:5: model.config.hidden_size: "), err


def test_a_forward_that_fails_on_fake_tensors_is_one_line_without_torchs_log(ckrun):
    """torch logs the failing fake kernel with its traceback before it raises; the check's line says it all.
    Drawn by a seeded run of the hostile-input property, which saw the log only at the first such config
    (the check's verdict is kept): the kept verdicts are cleared here."""
    from ckrun.runner.builders.model_config import _trial_build

    _trial_build.cache_clear()
    code, _, err = ckrun("validate", BERT_TINY, "model.config.max_position_embeddings=0")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "max_position_embeddings: BertForMaskedLM does not run with this config: a forward pass of 8 tokens" in err


def _peak_kib(field: str = "VmHWM") -> int:
    return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(f"{field}:")))


def test_validate_stays_quick_on_the_largest_transformers_recipe(ckrun):
    """It builds the 48-layer model on the meta device. CPU seconds, not wall-clock ones: a busy machine
    stretched this 5 s of work to 10 s at load 3, and a 20 s bound of the wall clock fails by chance."""
    import time

    measures_peak = Path("/proc/self/clear_refs").exists()
    if measures_peak:
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
    started, resident = time.process_time(), _peak_kib("VmRSS") if measures_peak else 0
    assert ckrun("validate", "gpt2_xl")[0] == 0
    assert time.process_time() - started < 20
    if measures_peak:  # nothing allocated: its fp32 weights would take 6.2 GB; imports take a few hundred MB
        assert _peak_kib() - resident < 2 << 20, f"{_peak_kib() - resident:,} KiB"


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module of faulty factories. Its own name (tests/ has a user_models.py too), and
    dropped from sys.modules around the test, so no other test's import of that name is the one found."""
    (tmp_path / "faulty_models.py").write_text(textwrap.dedent("""
        import torch
        answer = 42
        def picky(width=4):
            if width > 2:
                raise ValueError("width must be at most 2,\\nsee the docs")
            return torch.nn.Linear(width, 2)
        def quits():
            raise SystemExit(3)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "faulty_models", raising=False)
    return ["model.source=python", "data.task=image_classification", "data.image_size=8", "train.batch_size=2",
            "train.device=cpu", "train.steps=1", f"output.dir={tmp_path / 'out'}"]


def test_a_factory_that_raises_is_one_line_naming_where(ckrun, user_models):
    code, _, err = ckrun(BERT_TINY, *user_models, "model.name=faulty_models:picky", "model.config={width: 3}")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.strip().endswith("model.config.width: faulty_models:picky raised ValueError: width must be at most 2, "
                                "see the docs (at faulty_models.py:6); fix the factory or its arguments in model.config")


def test_a_factory_that_exits_does_not_end_ckrun_silently(ckrun, user_models):
    code, _, err = ckrun(BERT_TINY, *user_models, "model.name=faulty_models:quits", "model.config={}")
    assert code == 2 and "model.name: faulty_models:quits called sys.exit(3) (at faulty_models.py:9)" in err, err


def test_a_name_that_is_not_callable_is_refused_at_validate(ckrun, user_models):
    code, _, err = ckrun("validate", BERT_TINY, *user_models, "model.name=faulty_models:answer", "model.config={}")
    assert code == 2 and len(err.splitlines()) == 1
    assert "model.name: faulty_models:answer is an int, not a function or class" in err


def test_torchvision_assertions_are_build_errors():
    from ckrun.runner.builders.model import BuildError, build_model
    from ckrun.runner.recipe.recipe import ModelSpec

    spec = ModelSpec(source="torchvision", name="vit_b_16", config={"image_size": 250})
    with pytest.raises(BuildError) as caught:
        build_model(spec, device="meta")
    assert caught.value.key == "model.config" and "indivisible by patch size" in str(caught.value)


class NotATensor:
    pass


@pytest.mark.parametrize("content, expected", [
    ("truncated", "is cut short or not a PyTorch file"), ("pickled object", "holds pickled Python objects, not only tensors"),
])
def test_unreadable_local_weights_are_one_line_without_torch_advice(tmp_path, content, expected):
    from ckrun.runner.builders.model import BuildError, build_model
    from ckrun.runner.recipe.recipe import ModelSpec

    weights = tmp_path / "weights"
    weights.mkdir()
    if content == "truncated":
        torch.save(torch.nn.Linear(2, 2).state_dict(), weights / "model.pt")
        (weights / "model.pt").write_bytes((weights / "model.pt").read_bytes()[:100])
    else:
        torch.save({"weight": NotATensor()}, weights / "model.pt")
    spec = ModelSpec(source="torchvision", name="resnet18", config={"num_classes": 2}, pretrained=str(weights))
    with pytest.raises(BuildError) as caught:
        build_model(spec)
    message = str(caught.value)
    assert caught.value.key == "model.pretrained" and expected in message
    assert "weights_only" not in message and "\n" not in message


def test_tiny_recipes_still_validate_and_build(ckrun):
    assert ckrun("validate", BERT_TINY, *TINY_BERT)[0] == 0


TINY_LLAMA = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
              "vocab_size": 64}


@pytest.mark.parametrize("kv_heads, fits", [(4, True), (2, True), (1, True), (3, False)])
def test_a_shape_rule_only_a_forward_meets_is_found_at_validate(kv_heads, fits):
    """Grouped-query attention builds with any key/value head count; only a forward trips on one
    that does not divide the heads, so validation runs one on the meta device."""
    from ckrun.runner.builders.checks import deep_problems
    from ckrun.runner.recipe.load import recipe_from_text

    config = {**TINY_LLAMA, "num_key_value_heads": kv_heads}
    text = f"model: {{source: transformers, name: LlamaForCausalLM, config: {config}}}\n" \
           "data: {source: synthetic, seq_len: 16}\ntrain: {batch_size: 2, steps: 1}\n"
    problems = [str(problem) for problem in deep_problems(recipe_from_text(text))]
    if fits:
        assert problems == []
        return
    assert "does not run with this config: a forward pass of 8 tokens fails" in problems[0]


@settings(max_examples=25, deadline=None)
@given(positions=st.integers(8, 64), seq_len=st.integers(1, 96), in_eval=st.booleans())
def test_a_sequence_longer_than_the_position_table_is_refused_at_validate(positions, seq_len, in_eval):
    from ckrun.runner.builders.checks import deep_problems
    from ckrun.runner.recipe.load import recipe_from_text

    data = f"data: {{source: synthetic, seq_len: 4}}\neval: {{data: {{source: synthetic, seq_len: {seq_len}}}}}" \
        if in_eval else f"data: {{source: synthetic, seq_len: {seq_len}}}"
    text = "model: {source: transformers, name: GPT2LMHeadModel, config: {n_layer: 1, n_embd: 16, n_head: 2, " \
           f"n_positions: {positions}, vocab_size: 64}}}}\n{data}\ntrain: {{batch_size: 2, steps: 1}}\n"
    problems = [str(problem) for problem in deep_problems(recipe_from_text(text))]
    if seq_len <= positions:
        assert problems == []
        return
    key = "eval.data.seq_len" if in_eval else "data.seq_len"
    assert f"{key}: {seq_len} tokens exceed GPT2LMHeadModel's {positions} positions" in problems[0]
