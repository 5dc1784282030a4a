"""Mixture-of-experts models (Mixtral, Qwen2-MoE, OLMoE) under every checkpointing policy the tuner may
choose give the losses, gradients and weights of no plan, bit for bit, in fp32 and bf16, with the
experts run by transformers' grouped kernel (ckrun's choice where it runs) and by its eager loop.

A recompute must route every token to the experts its forward chose: the router's input is the same,
so its top-k is, and both kernels then do the same work in the same order.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.runner.builders.experts import EAGER, GROUPED, experts_modules, implementation
from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.blocks import find_blocks
from ckrun.runner.plan.memory_plan import MemoryPlan
from tests.runner.memory.moe_models import FAMILIES, VOCAB, moe_model
from tests.runner.memory.test_checkpointing_generated import _differences  # what differs: losses, then tensors

POLICIES = [{"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "layers", "layers": [1]},
            {"policy": "sqrt"}, {"policy": "selective"}]


def _train(family: str, precision: str, checkpointing: dict | None, steps: int = 2, **sizes):
    model = moe_model(family, **sizes)
    plan = MemoryPlan.model_validate({"checkpointing": checkpointing or {"policy": "none"}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")
    losses = []
    with apply_plan(model, plan, "cpu"):
        for _ in range(steps):
            with autocast:
                logits = model(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, grads, dict(model.named_parameters())


@pytest.mark.parametrize("kernel", [GROUPED, EAGER])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_full_every_and_selective_are_exact(family, precision, kernel):
    expected = _train(family, precision, None, kernel=kernel)
    for policy in [{"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "selective"}]:
        assert _differences(expected, _train(family, precision, policy, kernel=kernel)) == [], policy


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(FAMILIES)), precision=st.sampled_from(["fp32", "bf16"]),
       kernel=st.sampled_from([None, EAGER]), layers=st.integers(2, 3), experts=st.sampled_from([2, 4, 8]),
       top_k=st.integers(1, 2))
def test_every_policy_is_exact_on_generated_moe_models(family, precision, kernel, layers, experts, top_k):
    sizes = {"kernel": kernel, "layers": layers, "experts": experts, "top_k": top_k}
    expected = _train(family, precision, None, **sizes)
    for policy in POLICIES:
        assert _differences(expected, _train(family, precision, policy, **sizes)) == [], policy


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decoder_layers_are_the_blocks(family):
    model = moe_model(family, layers=3)
    blocks = find_blocks(model)
    assert blocks.container_name == "model.layers" and len(blocks) == 3
    assert all(any(m in experts_modules(b.module) for m in experts_modules(model)) for b in blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_ckrun_runs_the_grouped_kernel_where_it_runs_and_eager_experts_where_not(family, caplog):
    caplog.set_level("INFO", logger="ckrun")
    assert {implementation(m) for m in experts_modules(moe_model(family))} == {GROUPED}
    assert "experts: grouped_mm (transformers' grouped kernel" in caplog.text
    # fp32 rows of 30 floats are 120 bytes: torch's grouped kernel refuses strides that are not multiples of 16
    model = moe_model(family, width=30)
    assert {implementation(m) for m in experts_modules(model)} == {EAGER}
    assert "experts: eager (transformers' grouped kernel needs 16-byte strides" in caplog.text
    ids = torch.randint(0, VOCAB, (2, 8))
    model(input_ids=ids).logits.sum().backward()  # and it trains
