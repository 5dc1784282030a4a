"""`apply_plan` (runner/memory/apply.py) puts every part on one ExitStack: a plan that fails part way,
after the pools were applied (weights cast to bf16, the loss's head split), leaves the model exactly as
it was, and `remove()` undoes a whole plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.plan.memory_plan import MemoryPlan


def _gpt():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16))


def _state(model: nn.Module, rounded: bool = False) -> list:
    """What a plan may change: each module's own attributes and hooks, each parameter's dtype and values
    (`rounded`: through bfloat16, as bf16 weights cast back to float32 hold them)."""
    values = {name: p.detach().to(torch.bfloat16).float() if rounded else p.detach().clone()
              for name, p in model.named_parameters()}
    return [(name, sorted(vars(m)), len(m._forward_hooks), len(m._forward_pre_hooks)) for name, m in model.named_modules()] + \
        [(name, p.dtype, values[name].tolist()) for name, p in model.named_parameters()]


POOLS = st.fixed_dictionaries({
    "weights": st.sampled_from([{"policy": "fp32"}, {"policy": "fp32", "cast_cache": False}, {"policy": "bf16"}]),
    "loss": st.sampled_from([{"policy": "whole"}, {"policy": "chunked", "chunks": 2}]),
    "checkpointing": st.sampled_from([{"policy": "none"}, {"policy": "full"}, {"policy": "every", "every": 2}]),
})


@settings(max_examples=12, deadline=None, derandomize=True)
@given(pools=POOLS)
def test_a_plan_that_fails_finding_its_blocks_leaves_the_model_as_it_was(pools):
    pytest.importorskip("torchao", reason="memory.weights bf16 is torchao's AdamW")
    model = _gpt()
    before = _state(model, rounded=pools["weights"]["policy"] == "bf16")  # the undo casts back: no float32 copy kept
    plan = MemoryPlan.model_validate({**pools, "blocks": "transformer.nowhere", "allow_lossy": True})
    with pytest.raises(ValueError, match="memory.blocks: "):
        apply_plan(model, plan, "cpu")
    assert _state(model) == before


@settings(max_examples=12, deadline=None, derandomize=True)
@given(pools=POOLS)
def test_remove_undoes_every_part_of_an_applied_plan(pools):
    pytest.importorskip("torchao", reason="memory.weights bf16 is torchao's AdamW")
    model, bf16 = _gpt(), pools["weights"]["policy"] == "bf16"
    before = _state(model, rounded=bf16)
    applied = apply_plan(model, MemoryPlan.model_validate({**pools, "allow_lossy": True}), "cpu")
    assert (applied.head is not None) == (pools["loss"]["policy"] == "chunked")
    assert all((p.dtype == torch.bfloat16) == bf16 for p in model.parameters())
    applied.remove()
    applied.remove()  # twice is harmless
    assert _state(model) == before


class _RecurrentBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 4, num_layers=2, dropout=0.1, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_RecurrentBlock() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_refusal_after_the_pools_were_applied_undoes_them():
    """The blocks are checked after the pools' part: an LSTM with dropout between its layers cannot be
    checkpointed on CUDA (its refusal needs no GPU to be said), and the weights already held in bf16 go
    back (before the one ExitStack, this refusal left them in bf16)."""
    pytest.importorskip("torchao", reason="memory.weights bf16 is torchao's AdamW")
    model = _Recurrent()
    plan = MemoryPlan.model_validate({"weights": {"policy": "bf16"}, "allow_lossy": True, "checkpointing": {"policy": "full"}})
    with pytest.raises(ValueError, match="memory.checkpointing: block 0 .* is an LSTM with dropout"):
        apply_plan(model, plan, "cuda")
    assert all(p.dtype == torch.float32 for p in model.parameters())
