"""Every checkpointing policy gives the gradients of no plan, bit for bit, on generated models.

The models (`generated_models`) are stacks of drawn layers: RNNs, in-place activations after a
matmul or convolution, BatchNorm, tied weights, buffers the forward updates and reads, dropout.
Each example trains two SGD steps (the second reads the first's buffers and weights) with no plan
and with each policy, and compares losses, gradients, parameters and buffers exactly. Between the
blocks the model's loop may draw random numbers, run modules of its own, skip a block or call one
twice (`BETWEEN`): sqrt's segments span that code, and stay exact.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.plan.memory_plan import MemoryPlan
from tests.runner.memory.generated_models import BETWEEN, LAYERS, Stack

POLICIES = [{"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "layers", "layers": [1]},
            {"policy": "sqrt"}, {"policy": "selective"}, {"policy": "selective", "products_kept_every": 2}]

layer_lists = st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4)
stacks = st.lists(st.tuples(layer_lists, st.sampled_from(BETWEEN)), min_size=2, max_size=6)


def _train(blocks: list[list[str]], checkpointing: dict | None, steps: int = 2, between: list[str] | None = None):
    torch.manual_seed(0)
    model = Stack(blocks, between=between)
    plan = MemoryPlan.model_validate({"checkpointing": checkpointing or {"policy": "none"}, "blocks": "blocks"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 11, (3, 5))
    torch.manual_seed(1)  # the same dropout masks in every run
    losses = []
    with apply_plan(model, plan, "cpu"):
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            grads = {name: p.grad if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, grads, dict(model.named_parameters()), dict(model.named_buffers())


def _differences(expected, actual) -> list[str]:
    (want_losses, *want), (got_losses, *got) = expected, actual
    found = [] if all(map(torch.equal, want_losses, got_losses)) else ["loss"]
    for want_part, got_part in zip(want, got, strict=True):
        found += [key for key in want_part if not _same(want_part[key], got_part[key])]
    return found


def _same(want: torch.Tensor | None, got: torch.Tensor | None) -> bool:
    return want is got if want is None or got is None else torch.equal(want, got)  # no gradient: a skipped block


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=stacks)
def test_every_policy_is_exact_on_generated_models(drawn):
    blocks, between = [layers for layers, _ in drawn], [kind for _, kind in drawn]
    expected = _train(blocks, None, between=between)
    for policy in POLICIES:
        assert _differences(expected, _train(blocks, policy, between=between)) == [], (drawn, policy)


@pytest.mark.parametrize("kind", BETWEEN[1:])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p["policy"])
def test_every_policy_is_exact_whatever_runs_between_blocks(kind, policy):
    # 9 blocks: sqrt's 3 segments of 3, the kind after every block, so it lands inside a segment
    blocks, between = [["dropout", "linear_relu_"]] * 9, [kind] * 9
    assert _differences(_train(blocks, None, between=between), _train(blocks, policy, between=between)) == []


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p["policy"])
def test_every_policy_is_exact_on_each_layer_kind(layer, policy):
    # each kind alone in every block, so a failure names the kind; the generated test mixes them
    blocks = [[layer], ["linear_relu_", layer], [layer]]
    assert _differences(_train(blocks, None), _train(blocks, policy)) == []


def test_selective_learns_again_for_an_input_of_other_strides():
    # a shared block called on its own output: nn.GRU projects a strided input with mm and a contiguous one
    # with addmm, so what it learnt on the first call named another op on the second (wrong gradients)
    blocks, between = [["gru"], ["gru", "linear_relu_"]], ["none", "repeat"]
    selective = {"policy": "selective"}
    assert _differences(_train(blocks, None, between=between), _train(blocks, selective, between=between)) == []


def test_cuda_refuses_checkpointing_an_rnn_with_dropout_between_layers():
    # cuDNN draws that dropout from its own state, which a recompute cannot replay: refused, with the way out
    model = torch.nn.Sequential(torch.nn.GRU(8, 8, num_layers=2, dropout=0.1), torch.nn.GRU(8, 8, num_layers=2))
    plan = MemoryPlan.model_validate({"checkpointing": {"policy": "full"}})
    with pytest.raises(ValueError, match=r"^memory.checkpointing: block 0 \(0\) is an GRU with dropout 0.1 .* policy layers"):
        apply_plan(model, plan, "cuda")
    apply_plan(model, plan, "cpu").remove()  # on the CPU that dropout is torch's RNG, which the recompute replays
    layers = MemoryPlan.model_validate({"checkpointing": {"policy": "layers", "layers": [1]}})
    apply_plan(model, layers, "cuda").remove()
