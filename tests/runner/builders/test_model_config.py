"""validate's build-and-forward check of a transformers config: it refuses what transformers rejects,
never a model whose forward merely reads tensor values (DeBERTa-v2 and BART call `.item()`)."""

from __future__ import annotations

import pytest
import transformers

from ckrun.runner.builders.model_config import check_transformers_config

DEBERTA = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128,
               max_position_embeddings=64)
BART = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize("name, config", [("DebertaV2ForMaskedLM", DEBERTA), ("BartForConditionalGeneration", BART),
                                          ("DebertaV2ForSequenceClassification", DEBERTA)])
def test_models_whose_forward_reads_values_validate(name, config):
    check_transformers_config(getattr(transformers, name), config)  # raised "Tensor.item() ... meta tensors"


def test_the_cli_validates_them(tmp_path, ckrun):
    recipe = tmp_path / "bart.yaml"
    recipe.write_text("model: {source: transformers, name: BartForConditionalGeneration, config: "
                      + str(BART).replace("'", "") + "}\ndata: {source: synthetic, seq_len: 32}\n"
                      "train: {batch_size: 2, steps: 1}\noutput: {dir: runs}\n")
    assert ckrun("validate", recipe) == (0, f"{recipe}: OK\n", "")


@pytest.mark.parametrize("value", [[], {}, [1, 2], 3.5, "no-such-dtype"])
def test_a_config_value_transformers_takes_but_cannot_write_out_is_named(value):
    # BertConfig(dtype=[]) is made, then to_dict() raises IndexError: every save and fingerprint calls it
    from ckrun.runner.problems import KeyedError

    given = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, dtype=value)
    try:
        check_transformers_config(transformers.BertForMaskedLM, given)
    except KeyedError as err:
        assert "dtype" in " ".join(err.lines())
    else:  # what transformers writes out without complaint is fine
        transformers.BertConfig(**given).to_dict()
