"""Tiny language-model recipes that train in well under a second a step, for the pools' knobs: the
same weights and batches under any plan (same seed), so losses and weights compare exactly."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.train.trainer import Trainer

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao (the lowbit extra) is not installed")

LLAMA = ("{source: transformers, name: LlamaForCausalLM, config: {vocab_size: 256, hidden_size: 32, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64, max_position_embeddings: 64}}")
# GPT-2 ties its output projection to the input embedding and has dropout on
GPT2 = ("{source: transformers, name: GPT2LMHeadModel, config: {vocab_size: 256, n_embd: 32, n_layer: 2, n_head: 2, "
        "n_positions: 64}}")
# weights large and activations small: the gradients and weight casts decide the peak
WIDE = ("{source: transformers, name: LlamaForCausalLM, config: {vocab_size: 64, hidden_size: 128, num_hidden_layers: 3, "
        "num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 384, max_position_embeddings: 16}}")


def recipe(memory: str = "{}", model: str = LLAMA, precision: str = "fp32", seq_len: int = 16, batch_size: int = 4,
           **train):
    """A recipe of `model` on synthetic text; `train`: keys of the train section to set."""
    spec = {"batch_size": batch_size, "steps": 4, "device": "cpu", "grad_clip": None, "seed": 3,
            "optimizer": {"name": "adamw", "lr": 0.003}, **train}
    return recipe_from_text(f"model: {model}\ndata: {{source: synthetic, seq_len: {seq_len}}}\ntrain: {json.dumps(spec)}\n"
                            f"precision: {precision}\nmemory: {memory}\n")


def train(recipe_, steps: int = 3) -> tuple[list[float], list[torch.Tensor], Trainer]:
    """(every step's loss, the weights after the steps, the trainer)."""
    trainer = Trainer(recipe_)
    losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return losses, [p.detach().clone() for p in trainer.model.parameters()], trainer


def identical(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(first, second, strict=False))
