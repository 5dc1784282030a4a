"""Mixtral, Qwen2-MoE and OLMoE recipes through the real CLI, in fp32 and bf16: validate, estimate
(on fake tensors, saying what it assumed of the routing) and train 3 steps; the log names the experts'
kernel."""

from __future__ import annotations

import json

import pytest

from conftest import read_metrics
from tests.runner.memory.moe_models import FAMILIES, moe_config


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_recipes_validate_estimate_and_train(tmp_path, ckrun, caplog, family, precision):
    caplog.set_level("INFO", logger="ckrun")
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(f"model: {{source: transformers, name: {FAMILIES[family][0]}, "
                      f"config: {json.dumps(moe_config(family, experts=8))}}}\n"
                      "data: {source: synthetic, seq_len: 16}\n"
                      f"train: {{batch_size: 4, steps: 3, device: cpu}}\nprecision: {precision}\n"
                      f"output: {{dir: {tmp_path / 'run'}}}\n")
    code, out, err = ckrun("validate", recipe)
    assert code == 0 and out.strip().endswith(": OK"), err
    code, out, err = ckrun("estimate", recipe, "--device", "cpu", "memory.checkpointing={policy: full}")
    assert code == 0, err
    assert "its bytes do not depend on the routing" in out and "approximate" not in out, out
    code, _, err = ckrun(recipe)
    assert code == 0, err
    assert [m["step"] for m in read_metrics(tmp_path / "run") if "loss" in m] == [1, 2, 3]
    assert "experts: grouped_mm (transformers' grouped kernel" in caplog.text
