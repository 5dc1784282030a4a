"""A rank's step composed from parts (runner/predict/rank_parts.py) equals the whole rank's fake step: over
tiny Llamas of 2-6 blocks and of 12 (the shallow ones all real, the deep one with relays), 2-8 fake ranks,
every strategy (ddp, fsdp, hsdp, tp) and plans drawn from the activation and pool knobs, a composed estimate
has the whole step's peak to the byte (the CUDA allocator's reserve and the live tensors), its breakdown,
and its time (to rounding: the collectives placed as they ran); the plans are drawn in any order against
one predictor, so traces made for one plan serve later ones. Counted, not timed: the traces and their real
blocks do not grow with depth."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings, strategies as st

from ckrun.runner.problems import InputError
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict.hardware import DeviceFacts
from ckrun.runner.predict.per_rank import RankPredictor
from ckrun.runner.predict.rank_parts import NEIGHBOURS
from tests.runner.memory.tiny_lm import HAS_TORCHAO

FACTS = DeviceFacts(name="test gpu", matmul_tflops={"fp32": 1.0, "tf32": 1.0, "bf16": 4.0, "fp16": 4.0},
                    memory_gbs=100.0, peer_gbs=50.0, capability=(9, 0), memory_bytes=80 * 10**9)
CHECKPOINTING = ["{policy: none}", "{policy: full}", "{policy: every, every: 2}", "{policy: sqrt}",
                 "{policy: selective}"]
SHARDED_CHECKPOINTING = [c for c in CHECKPOINTING if "sqrt" not in c]  # sqrt's recompute bypasses FSDP's gathering
POOLS = ["", "loss: {policy: chunked, chunks: 2}", "weights: {policy: fp32, cast_cache: false}"] + \
    (["weights: {policy: bf16}\n  allow_lossy: true"] if HAS_TORCHAO else [])


def llama(layers: int, strategy: str, checkpointing: str, micro_batch: int, keep: bool, pools: str):
    sharding = "\n  sharding: {reshard_after_forward: false}" if keep and "ddp" not in strategy else ""
    pooled = "\n  " + pools if pools else ""
    return recipe_from_text(f"""
model:
  source: transformers
  name: LlamaForCausalLM
  config: {{vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: {layers},
           num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 32, tie_word_embeddings: false}}
data: {{source: synthetic, seq_len: 16}}
train: {{batch_size: 16, steps: 2, device: auto}}
precision: bf16
distributed: {strategy}
memory:
  micro_batch: {micro_batch}
  checkpointing: {checkpointing}{sharding}{pooled}
""")


@st.composite
def cases(draw) -> tuple[int, int, list]:
    """(ranks, blocks, recipes): a world, a depth, and plans of one layout family on it."""
    world = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.sampled_from([2, 3, 4, 6, 12]))  # 12: a sharded model's relays (its windows cover 10)
    strategies = ["{strategy: ddp}", "{strategy: fsdp}", "{strategy: tp, tensor: 2}"] + \
        ([f"{{strategy: hsdp, shard: {world // 2}}}"] if world >= 4 else [])
    plans = draw(st.lists(st.tuples(st.sampled_from(strategies), st.sampled_from(CHECKPOINTING),
                                    st.sampled_from([1, 2]), st.booleans(), st.sampled_from(POOLS)),
                          min_size=2, max_size=3))
    try:
        return world, layers, [llama(layers, *plan) for plan in plans]
    except InputError:  # a combination the recipe refuses (sqrt segments under FSDP)
        assume(False)


def answers(world: int, recipes: list, compose: bool) -> list:
    with RankPredictor(world, "cuda", FACTS, compose=compose) as ranks:
        return [ranks.estimate(recipe) for recipe in recipes]


def check(world: int, recipes: list) -> None:
    composed, whole = answers(world, recipes, True), answers(world, recipes, False)
    for recipe, mine, reference in zip(recipes, composed, whole, strict=True):
        assert not [note for note in mine.notes if "not composed" in note], recipe.distributed
        assert (mine.peak_bytes, mine.live_peak_bytes, mine.breakdown) == \
            (reference.peak_bytes, reference.live_peak_bytes, reference.breakdown)
        assert mine.time.seconds == pytest.approx(reference.time.seconds, rel=1e-9)  # the collectives placed too


NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)  # a failing draw is printed whole; shrinking it takes minutes


@settings(max_examples=2, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_a_composed_rank_step_is_the_whole_rank_step(case):
    world, _, recipes = case
    check(world, recipes)


@pytest.mark.slow  # a few minutes of CPU: two predictors per example, each a step per plan
@settings(max_examples=12, deadline=None, phases=NO_SHRINK, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases())
def test_a_composed_rank_step_is_the_whole_rank_step_over_many_draws(case):
    world, _, recipes = case
    check(world, recipes)


@pytest.mark.parametrize("strategy, checkpointing", [
    ("{strategy: fsdp}", SHARDED_CHECKPOINTING[:2]),
    pytest.param("{strategy: fsdp}", SHARDED_CHECKPOINTING, marks=pytest.mark.slow),
    pytest.param("{strategy: hsdp, shard: 2}", SHARDED_CHECKPOINTING, marks=pytest.mark.slow)])
def test_a_sharded_model_with_relays_composes_exactly(strategy, checkpointing):
    """The strategies whose blocks reach their neighbours (FSDP2's prefetch and reduce-scatter), eleven blocks
    (one a relay in every trace: runner/predict/rank_parts.py sets its FSDP2 hooks aside), checkpointing
    policies in turn on one predictor, kept and resharded."""
    check(4, [llama(11, strategy, policy, 1, keep, "") for policy, keep in
              zip(checkpointing, [True, False] * 2, strict=False)])


def test_the_traces_do_not_grow_with_depth():
    """Eleven blocks and nineteen: the same traces, and as many real blocks in each (the first and last
    blocks' windows, and a middle one's)."""
    counts = []
    for layers in (11, 19):
        with RankPredictor(4, "cuda", FACTS) as ranks:
            ranks.estimate(llama(layers, "{strategy: fsdp}", "{policy: full}", 1, False, ""))
            composer = next(iter(ranks.composers.values()))
            traces = list({id(t): t for t, _ in composer.represented.values()}.values())
            counts.append((composer.traces, sorted(len(trace.real) for trace in traces)))
    assert counts[0] == counts[1]
    assert all(real <= 2 * (2 * NEIGHBOURS + 1) for real in counts[0][1])


def test_a_plan_that_does_not_compose_is_the_whole_rank_step_said_in_a_note(monkeypatch):
    """Where the composer refuses a plan (here told to), the rank's answer is its whole step, and says why."""
    from ckrun.runner.predict.rank_parts import RankComposer

    recipes = [llama(3, "{strategy: fsdp}", "{policy: full}", 1, False, "")]
    whole = answers(4, recipes, False)[0]
    monkeypatch.setattr(RankComposer, "_not_composed", lambda self, plan: "a reason of the test's")
    refused = answers(4, recipes, True)[0]
    assert (refused.peak_bytes, refused.breakdown) == (whole.peak_bytes, whole.breakdown)
    assert "the whole-model fake step (not composed from parts: a reason of the test's)" in refused.notes
