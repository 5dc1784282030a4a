"""`ckrun tune` plans a LoRA recipe like any other: recipes/llama_1b_lora.yaml, shrunk, predicted for an L4."""

from __future__ import annotations

import yaml

from conftest import ROOT
from ckrun.runner.cli import main
from tune_helpers import report

LLAMA_LORA = str(ROOT / "recipes" / "llama_1b_lora.yaml")
# 2 blocks of width 64 at 64 tokens, batch 16: the recipe's LoRA section (all-linear, rank 16, a bf16 base) as it is
SHRINK = ["model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.intermediate_size=128",
          "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.vocab_size=512",
          "model.config.max_position_embeddings=64", "data.seq_len=64", "train.batch_size=16", "train.steps=2"]


def test_tune_predicts_a_plan_for_a_lora_recipe_on_an_l4_and_keeps_the_adapter_section(tmp_path):
    out = tmp_path / "tune"
    code = main(["tune", LLAMA_LORA, *SHRINK, f"output.dir={tmp_path / 'run'}", "--max-mem", "1GB", "--predict",
                 "--gpu", "l4", "--output", str(out), "--trials", "4", "--search-precision"])
    assert code == 0
    found = report(out)
    winner = found["trials"][found["winner"]]
    assert winner["predicted"] and winner["measured_peak"] <= found["limit_bytes"]
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["model"]["lora"]["base_dtype"] == "bf16" and tuned["model"]["lora"]["target_modules"] == "all-linear"
    assert tuned["precision"] == "bf16"  # --search-precision set aside: the base is held in bf16
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
