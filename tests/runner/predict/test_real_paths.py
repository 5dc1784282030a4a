"""On fake tensors transformers keeps its traced-model paths; the estimate must take the real run's.
Llama-family models built a 4D mask and left SDPA's flash kernel on fake tensors only: the estimate
was high by the mask, the repeated key/value heads and the attention weights."""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics

LLAMA = ["model.source=transformers", "data.seq_len=128", "train.batch_size=4", "train.device=cpu",
         "model.config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
         "num_key_value_heads: 2, vocab_size: 128, max_position_embeddings: 128}"]


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_a_grouped_query_causal_lm_estimate_is_the_measured_peak(tmp_path, ckrun, name):
    args = ["bert_tiny", f"model.name={name}", *LLAMA]
    code, out, err = ckrun("estimate", *args, "--device", "cpu", "--json")
    assert code == 0, err
    assert ckrun(*args, "train.steps=2", f"output.dir={tmp_path}")[0] == 0
    measured = read_metrics(tmp_path)[-1]["peak_mem_bytes"]  # step 2: the optimizer state exists, as estimated
    assert json.loads(out)["peak_bytes"] == measured  # was 20% high at this size
