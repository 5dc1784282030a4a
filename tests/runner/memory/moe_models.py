"""Tiny mixture-of-experts models of transformers' three MoE families, built through ckrun's own builder
(so the experts' kernel is the one ckrun picks, or the one `kernel` names)."""

from __future__ import annotations

import torch

from ckrun.runner.builders.model import build_model
from ckrun.runner.recipe.recipe import ModelSpec

FAMILIES = {
    "mixtral": ("MixtralForCausalLM", lambda experts, width: {"num_local_experts": experts, "intermediate_size": width}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda experts, width: {
        "num_experts": experts, "intermediate_size": 32, "moe_intermediate_size": width,
        "shared_expert_intermediate_size": 16}),
    "olmoe": ("OlmoeForCausalLM", lambda experts, width: {"num_experts": experts, "intermediate_size": width}),
}
VOCAB = 64


def moe_config(family: str, layers: int = 2, experts: int = 4, top_k: int = 2, kernel: str | None = None,
               width: int = 16) -> dict:
    """`width`: each expert's intermediate size."""
    config = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": top_k, "max_position_embeddings": 64,
              **FAMILIES[family][1](experts, width)}
    if family == "olmoe":
        config.update(pad_token_id=0, eos_token_id=1, bos_token_id=None)  # its defaults point past a tiny vocabulary
    return config | ({"experts_implementation": kernel} if kernel else {})


def moe_spec(family: str, **sizes) -> ModelSpec:
    return ModelSpec(source="transformers", name=FAMILIES[family][0], config=moe_config(family, **sizes))


def moe_model(family: str, seed: int = 0, **sizes) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(moe_spec(family, **sizes), "cpu").train()
