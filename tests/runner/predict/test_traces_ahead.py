"""`Composer.traces_ahead`: the traces pricing a list of plans in order will make, named before any is made (a
search hands them to its second pricer, autotune/probes/beside.py): each is the trace `next_trace` names once the
plans before it are priced, and a trace an earlier plan makes is not named again. Counted: trace keys."""

from __future__ import annotations

import pytest

from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.compose import Composer, trace_cost
from ckrun.runner.predict.estimate import EstimateUnavailable
from ckrun.runner.predict.hardware import resolve_device
from ckrun.runner.predict.parts import PartsEstimator
from ckrun.runner.recipe.load import load_recipe
from conftest import BERT_TINY, TINY_BERT

OVERRIDES = [*TINY_BERT, "model.config.num_hidden_layers=4", "train.device=auto"]
OFFLOADED = {"checkpointing": {"policy": "every", "every": 2}, "offload": {"policy": "all"}}


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(BERT_TINY, OVERRIDES)


def _plan(recipe, fields: dict, micro_batch: int = 4) -> MemoryPlan:
    return MemoryPlan.model_validate({"blocks": recipe.memory.blocks, "micro_batch": micro_batch, **fields})


def _composer(recipe) -> Composer:
    return Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")))


def test_the_traces_named_ahead_are_those_pricing_the_plans_in_that_order_makes(recipe):
    composer = _composer(recipe)
    composer.estimate(_plan(recipe, OFFLOADED), "bf16")  # the parts key's first trace: what each block is given
    plans = [_plan(recipe, {"checkpointing": {"policy": name}}) for name in ("full", "none", "selective")]
    plans.append(_plan(recipe, {"checkpointing": {"policy": "every", "every": 2}}))
    ahead = composer.traces_ahead([(plan, "bf16") for plan in plans])
    for plan, named in zip(plans, ahead, strict=True):
        assert composer.next_trace(plan, "bf16") == named
        composer.estimate(plan, "bf16")
    # full's trace keeps a block beside its recomputed ones: none and every:2 need nothing more (the update is traced)
    assert [None if named is None else named[0] for named in ahead] == ["step", None, "step", None]


def test_a_parts_key_not_traced_yet_names_only_its_first_trace(recipe):
    """Its first trace learns what each block is given, which may tell the signatures apart anew: what the plans
    after it of that key need is not named."""
    composer = _composer(recipe)
    plans = [_plan(recipe, {"checkpointing": {"policy": "selective"}}, 2), _plan(recipe, OFFLOADED, 2)]
    ahead = composer.traces_ahead([(plan, "bf16") for plan in plans])
    assert ahead[0] == composer.next_trace(plans[0], "bf16") and ahead[0][0] == "step" and ahead[1] is None
    assert composer.traces == 0  # nothing was traced to name them


def test_a_plan_the_fake_step_cannot_price_is_named_no_trace(recipe, monkeypatch):
    """Its optimizer's warm-up fails on fake tensors (an op without a fake kernel): naming traces ahead says
    nothing of it, and pricing it says why (the search orders plans by this before pricing any)."""
    composer = _composer(recipe)

    def unavailable(plan, watch=None):
        raise EstimateUnavailable("the warm-up step: an op without a fake kernel")

    monkeypatch.setattr(composer.estimator, "_optimizing", unavailable)
    plans = [_plan(recipe, {"checkpointing": {"policy": "full"}}), _plan(recipe, OFFLOADED)]
    assert composer.traces_ahead([(plan, "bf16") for plan in plans]) == [None, None]
    with pytest.raises(EstimateUnavailable):
        composer.estimate(plans[0], "bf16")


def test_a_trace_costs_its_real_blocks_an_update_two_and_none_nothing():
    assert trace_cost(None) == 0
    assert trace_cost(("step", ("step",), None, "bf16", frozenset({0, 1, 2}))) == 3
    assert trace_cost(("update", ("update",), None, "bf16", frozenset(), 2)) == 2
