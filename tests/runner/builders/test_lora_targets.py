"""model.lora's target lists: `ckrun validate` refuses exactly what the run refuses, in the run's own line, and a
list that matches no module of the model is always refused. Generated over target_modules and modules_to_save
drawn from the model's own module names (linear layers, other layers, containers), near misses and any text."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.runner.recipe.recipe import ModelSpec
from tests.runner.builders.hub_cache import TINY_LLAMA, tiny_llama_recipe


def _module_names() -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    return [name for name, _ in model.named_modules() if name]


NAMES = _module_names()
LEAVES = sorted({name.rpartition(".")[2] for name in NAMES})  # q_proj, embed_tokens, norm, layers, 0, ...
words = st.one_of(st.sampled_from(LEAVES), st.sampled_from(NAMES), st.sampled_from([n[:-1] for n in LEAVES if len(n) > 2]),
                  st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
targets = st.one_of(st.none(), st.just("all-linear"), st.lists(words, min_size=1, max_size=3, unique=True))


def _matches_nothing(wanted: list[str]) -> bool:
    """peft's rule for a list: a module whose name is the entry, or ends in `.entry`."""
    return not any(name == entry or name.endswith(f".{entry}") for entry in wanted for name in NAMES)


def _lora(target_modules, modules_to_save) -> str:
    import json

    return json.dumps({"rank": 2, "target_modules": target_modules, "modules_to_save": modules_to_save})


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target_modules=targets, modules_to_save=st.lists(words, max_size=2, unique=True))
def test_validate_refuses_what_the_run_refuses(target_modules, modules_to_save, ckrun, tmp_path_factory):
    recipe = tmp_path_factory.mktemp("lora") / "lora.yaml"
    out = recipe.parent / "run"
    recipe.write_text(tiny_llama_recipe(f"lora: {_lora(target_modules, modules_to_save)}",
                                        f"output: {{dir: {out}, checkpoint_every: 0}}\n"))
    checked, _, said = ckrun("validate", str(recipe))
    ran, _, run_said = ckrun(str(recipe), "train.steps=1")
    assert checked in (0, 2) and ran in (0, 2), (said, run_said)
    assert (checked == 2) == (ran == 2), (said, run_said)
    if checked == 2:
        assert len(said.splitlines()) == 1 and said.strip().split(": ", 1)[1] == run_said.strip().split(": ", 1)[1]
        assert ": model.lora." in said and "internal error" not in said
        assert not (out / "metrics.jsonl").exists()
    if isinstance(target_modules, list) and _matches_nothing(target_modules):
        assert checked == 2 and "model.lora.target_modules:" in said, said
    elif modules_to_save and _matches_nothing(modules_to_save[:1]) and checked == 2:
        assert "model.lora.modules_to_save" in said or "model.lora.target_modules" in said, said


def test_a_modules_to_save_entry_that_matches_nothing_is_refused_at_its_index(ckrun, tmp_path):
    """peft itself passes over it: the module would stay frozen (or absent) without a word."""
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(tiny_llama_recipe(f"lora: {_lora('all-linear', ['lm_head', 'classifer'])}"))
    code, _, err = ckrun("validate", str(recipe))
    assert code == 2 and "model.lora.modules_to_save.1: 'classifer' is no module of LlamaForCausalLM" in err, err


def test_the_refused_targets_name_the_models_linear_layers():
    from ckrun.runner.builders.model import BuildError, build_model

    spec = ModelSpec(source="transformers", name="LlamaForCausalLM", config=TINY_LLAMA,
                     lora={"target_modules": ["q_prj"]})
    try:
        build_model(spec, "meta", weights=False)
    except BuildError as err:
        assert err.key == "model.lora.target_modules" and "[down_proj, gate_proj, k_proj, lm_head" in err.message
    else:
        raise AssertionError("q_prj matched a layer")
