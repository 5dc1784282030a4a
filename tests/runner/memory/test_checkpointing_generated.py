"""Every checkpointing policy gives the gradients of no plan, bit for bit, on generated models.

The models (`generated_models`) are stacks of drawn layers: RNNs, in-place activations after a
matmul or convolution, BatchNorm, tied weights, buffers the forward updates and reads, dropout.
Each example trains two SGD steps (the second reads the first's buffers and weights) with no plan
and with each policy, and compares losses, gradients, parameters and buffers exactly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from runner.memory.apply import apply_plan
from runner.plan import MemoryPlan
from tests.runner.memory.generated_models import LAYERS, Stack

POLICIES = [{"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "layers", "layers": [1]},
            {"policy": "sqrt"}, {"policy": "selective"}]

layer_lists = st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4)
stacks = st.lists(layer_lists, min_size=2, max_size=4)


def _train(blocks: list[list[str]], checkpointing: dict | None, steps: int = 2):
    torch.manual_seed(0)
    model = Stack(blocks)
    plan = MemoryPlan.model_validate({"checkpointing": checkpointing or {"policy": "none"}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 11, (3, 5))
    torch.manual_seed(1)  # the same dropout masks in every run
    losses = []
    with apply_plan(model, plan, "cpu"):
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, grads, dict(model.named_parameters()), dict(model.named_buffers())


def _differences(expected, actual) -> list[str]:
    (want_losses, *want), (got_losses, *got) = expected, actual
    found = [] if all(map(torch.equal, want_losses, got_losses)) else ["loss"]
    for want_part, got_part in zip(want, got, strict=True):
        found += [key for key in want_part if not torch.equal(want_part[key], got_part[key])]
    return found


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=stacks)
def test_every_policy_is_exact_on_generated_models(blocks):
    expected = _train(blocks, None)
    for policy in POLICIES:
        assert _differences(expected, _train(blocks, policy)) == [], (blocks, policy)


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p["policy"])
def test_every_policy_is_exact_on_each_layer_kind(layer, policy):
    # each kind alone in every block, so a failure names the kind; the generated test mixes them
    blocks = [[layer], ["linear_relu_", layer], [layer]]
    assert _differences(_train(blocks, None), _train(blocks, policy)) == []


def test_cuda_refuses_checkpointing_an_rnn_with_dropout_between_layers():
    # cuDNN draws that dropout from its own state, which a recompute cannot replay: refused, with the way out
    model = torch.nn.Sequential(torch.nn.GRU(8, 8, num_layers=2, dropout=0.1), torch.nn.GRU(8, 8, num_layers=2))
    plan = MemoryPlan.model_validate({"checkpointing": {"policy": "full"}})
    with pytest.raises(ValueError, match=r"^memory.checkpointing: block 0 \(0\) is an GRU with dropout 0.1 .* policy layers"):
        apply_plan(model, plan, "cuda")
    apply_plan(model, plan, "cpu").remove()  # on the CPU that dropout is torch's RNG, which the recompute replays
    layers = MemoryPlan.model_validate({"checkpointing": {"policy": "layers", "layers": [1]}})
    apply_plan(model, layers, "cuda").remove()
