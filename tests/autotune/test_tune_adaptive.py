"""Adaptive plans in the tuner: for text of varying length the space has a checkpointing for short
batches; every point is a valid recipe or one the schema refuses for its reason, and the starting
points use one plan for every length."""

from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from tune_helpers import valid_points

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")


def _space(tmp_path, *overrides):
    corpus = tmp_path / "lines.txt"
    corpus.write_text("short\n" * 10 + "a longer line of text\n")
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "data.source=text", f"data.paths=[{corpus}]", "data.split=lines",
                                     "model.config.num_hidden_layers=4", *overrides])
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), CPU)


def test_short_batches_get_their_own_checkpointing(tmp_path):
    recipe, space = _space(tmp_path)
    assert space.choices["short_checkpointing"][0] == "same" and "sqrt" not in space.choices["short_checkpointing"]
    buckets = set()
    for params, plan in valid_points(space, recipe):
        assert len(plan.adaptive) == (params["short_checkpointing"] != "same")
        buckets.update((b.max_len, b.checkpointing.policy) for b in plan.adaptive)
    assert {max_len for max_len, _ in buckets} == {recipe.data.seq_len // 2}
    assert all(p["short_checkpointing"] == "same" for p in space.starting_points(recipe))


def test_packed_text_and_pinned_buckets_are_not_searched(tmp_path):
    _, pinned = _space(tmp_path, "memory.adaptive=[{max_len: 4, checkpointing: {policy: none}}]")
    assert "short_checkpointing" not in pinned.choices
    assert pinned.candidate(pinned.all_params()[0]).plan.adaptive[0].max_len == 4
    recipe = load_recipe(BERT_TINY, TINY_BERT)
    synthetic = build_space(recipe, ModelFacts.from_json(model_facts(recipe)), CPU)
    assert "short_checkpointing" not in synthetic.choices and "short_len" not in synthetic.fixed
