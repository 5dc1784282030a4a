"""`tune --predict --nproc N` predicts many plans of one recipe: `RankPredictor` keeps what no plan changes
(the fake process group, a mesh per strategy, per layout the split fake model with its warmed-up
optimizer) and must answer exactly as a predictor built afresh for each plan (`ckrun estimate --nproc`'s
path), in any order of plans. Counted, not timed: builds per layout, groups, meshes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict import per_rank as per_rank_module
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import DeviceFacts
from ckrun.runner.predict.per_rank import RankPredictor, layout_key, per_rank, rank_share

FACTS = DeviceFacts(name="test gpu", matmul_tflops={"fp32": 1.0, "tf32": 1.0, "bf16": 4.0, "fp16": 4.0},
                    memory_gbs=100.0, peer_gbs=50.0, capability=(9, 0), memory_bytes=80 * 10**9)
LLAMA = """
model:
  source: transformers
  name: LlamaForCausalLM
  config: {vocab_size: 128, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 4, max_position_embeddings: 32, tie_word_embeddings: false}
data: {source: synthetic, seq_len: 16}
train: {batch_size: 8, steps: 2, device: auto}
precision: bf16
"""
STRATEGIES = ["{strategy: ddp}", "{strategy: fsdp}", "{strategy: hsdp, shard: 2}", "{strategy: tp, tensor: 2}"]
CHECKPOINTING = ["{policy: none}", "{policy: full}", "{policy: every, every: 2}"]


POOLS = ["", "weights: {policy: bf16}", "optimizer_state: {policy: 8bit}", "loss: {policy: chunked, chunks: 2}",
         "weights: {policy: bf16}\n  optimizer_state: {policy: 8bit}\n  loss: {policy: chunked, chunks: 2}"]
"""Pool knobs (issue 40.3) that change what a kept layout holds: bf16 weights are sharded as bf16, and the
chunked loss keeps FSDP2's root gathered."""


def recipe(strategy: str, checkpointing: str = "{policy: none}", micro_batch: int = 2, keep: bool = False,
           pools: str = ""):
    sharding = "\n  sharding: {reshard_after_forward: false}" if keep and "ddp" not in strategy else ""
    pooled = f"\n  {pools}\n  allow_lossy: true" if pools else ""
    return recipe_from_text(LLAMA + f"distributed: {strategy}\nmemory:\n  micro_batch: {micro_batch}\n"
                                    f"  checkpointing: {checkpointing}{sharding}{pooled}\n")


def answer(estimate) -> tuple:
    return estimate.peak_bytes, estimate.breakdown, estimate.notes, round(estimate.time.seconds, 12)


class Counted:
    """Estimators built and fake process groups brought up, counted through the module's own names."""

    def __init__(self, monkeypatch):
        self.estimators, self.groups = 0, 0
        init, group = Estimator.__init__, per_rank_module.fake_process_group

        def counted_init(estimator, *args, **kwargs):
            self.estimators += 1
            init(estimator, *args, **kwargs)

        def counted_group(*args, **kwargs):
            self.groups += 1
            return group(*args, **kwargs)

        monkeypatch.setattr(Estimator, "__init__", counted_init)
        monkeypatch.setattr(per_rank_module, "fake_process_group", counted_group)


def test_each_layout_is_built_once_across_its_plans(monkeypatch):
    counted = Counted(monkeypatch)
    plans = [recipe(strategy, checkpointing, micro, keep) for strategy in STRATEGIES[:3]
             for checkpointing, micro, keep in [(CHECKPOINTING[0], 2, False), (CHECKPOINTING[1], 1, True),
                                                (CHECKPOINTING[0], 2, True)]]
    with RankPredictor(4, "cuda", FACTS) as ranks:
        answers = [answer(ranks.estimate(plan)) for plan in plans]
        layouts = {layout_key(rank_share(plan, 4)) for plan in plans}
        assert len(layouts) == 3  # keep is set on the kept model per plan, not built anew
        assert counted.estimators == 3 and len(ranks.estimators) == 3
        assert counted.groups == 1 and set(ranks.meshes) == {"fsdp", "hsdp:2"}
    # the last plan (hsdp keeping its gathered blocks) ran on a model that had run 8 plans before it
    assert answers[-1] == answer(per_rank(4)(plans[-1], "cuda", FACTS).estimate())


@pytest.mark.slow  # about a minute of CPU: a fresh predictor per plan
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(STRATEGIES), st.sampled_from(CHECKPOINTING), st.sampled_from([1, 2]),
                          st.booleans(), st.sampled_from(POOLS)), min_size=2, max_size=4))
def test_a_kept_predictor_answers_as_a_fresh_one_in_any_order(plans):
    """Whatever ran on a kept model before (another plan, the other reshard_after_forward), a plan's peak,
    breakdown, notes and time are those of a predictor built for it alone."""
    recipes = [recipe(*plan) for plan in plans]
    with RankPredictor(4, "cuda", FACTS) as ranks:
        kept = [answer(ranks.estimate(r)) for r in recipes]
    fresh = [answer(per_rank(4)(r, "cuda", FACTS).estimate()) for r in recipes]
    assert kept == fresh


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchao") is None, reason="needs torchao")
def test_the_pool_knobs_on_a_kept_fsdp_layout_answer_as_a_fresh_predictor():
    """bf16 weights are their own layout (FSDP2 shards them as bf16), the chunked loss keeps the root gathered on
    the kept model, and neither leaves a trace on the plans after it."""
    recipes = [recipe(STRATEGIES[1], pools=pools) for pools in POOLS[1:]] + [recipe(STRATEGIES[1])]
    with RankPredictor(4, "cpu") as ranks:
        kept = [ranks.estimate(r) for r in recipes]
        assert len(ranks.estimators) == 2  # fp32 and bf16 weights
    fresh = [per_rank(4)(r, "cpu").estimate() for r in recipes]
    assert [(e.peak_bytes, e.breakdown) for e in kept] == [(e.peak_bytes, e.breakdown) for e in fresh]


def test_a_failed_plan_drops_its_layout(monkeypatch):
    with RankPredictor(4, "cuda", FACTS) as ranks:
        ranks.estimate(recipe(STRATEGIES[1]))
        key = layout_key(rank_share(recipe(STRATEGIES[1]), 4))

        def fails(*args, **kwargs):
            raise RuntimeError("half-way")

        monkeypatch.setattr(ranks.estimators[key], "fake_step", fails)  # whole or composed, a step runs it
        with pytest.raises(RuntimeError):
            ranks.estimate(recipe(STRATEGIES[1], CHECKPOINTING[1]))
        assert key not in ranks.estimators and key not in ranks.composers


def test_cpu_offload_for_a_gpu_is_refused_as_unpredictable_not_as_a_cpu_run(monkeypatch):
    """Issue 35: every `,cpu` plan of `tune --predict --nproc 8 --gpu h100` was 'unavailable' because the
    check asked this machine (no GPU) instead of the named one; the refusal now says what is missing,
    before anything is built."""
    from ckrun.runner.predict.estimate import EstimateUnavailable

    counted = Counted(monkeypatch)
    offloaded = recipe_from_text(LLAMA + "distributed: {strategy: fsdp}\nmemory: {sharding: {offload: cpu}}\n")
    with RankPredictor(4, "cuda", FACTS) as ranks, pytest.raises(EstimateUnavailable) as refused:
        ranks.estimate(offloaded)
    assert "not predicted" in str(refused.value) and "trains on the CPU" not in str(refused.value)
    assert counted.estimators == 0
