"""The solver on a real (tiny) model: its plan fits the cap by the estimator, recomputes only some
blocks, and trains with exactly the gradients of no plan."""

from __future__ import annotations

import pytest
import torch

from ckrun.autotune.search.solver import frontier
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.builders.model import build_model
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.builders.sources import stand_in_batch
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.train.step import call_model, loss_sum


@pytest.fixture(scope="module")
def solved():
    recipe = load_recipe(BERT_TINY, TINY_BERT + ["model.config.num_hidden_layers=4"])
    estimator = Estimator(recipe, "cpu")
    peak = lambda policy: estimator.estimate(MemoryPlan.model_validate({"checkpointing": {"policy": policy}})).peak_bytes  # noqa: E731
    limit = (peak("none") + peak("full")) // 2
    proposals, lines = frontier(estimator, [(8, "fp32")], limit, MemoryPlan(), timed_steps=0)
    return recipe, estimator, limit, proposals, lines


def test_the_plan_fits_the_cap_by_the_estimator(solved):
    recipe, estimator, limit, proposals, lines = solved
    assert len(proposals) == 1, lines
    plan = proposals[0].plan
    assert plan.micro_batch == 8 and plan.checkpointing.policy == "layers"  # some blocks, not all
    assert estimator.estimate(plan, "fp32").peak_bytes == proposals[0].predicted_peak <= limit
    assert "predicted" in lines[0] and "recompute blocks" in lines[0]  # the reason is logged with it


def _gradients(recipe, plan: MemoryPlan | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(recipe.model, "cpu").train()
    batch = stand_in_batch(recipe, model)
    applied = apply_plan(model, plan, "cpu") if plan is not None else None
    torch.manual_seed(1)  # the same dropout masks (bert_tiny has dropout on)
    loss_sum(call_model(model, batch), batch.labels, batch.positions).backward()
    if applied is not None:
        applied.remove()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_the_plan_trains_with_the_gradients_of_no_plan(solved):
    recipe, _, _, proposals, _ = solved
    expected, got = _gradients(recipe, None), _gradients(recipe, proposals[0].plan)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)
