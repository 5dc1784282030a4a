"""`ckrun tune --predict` finds memory.optimizer_offload master where only it fits: bench/published/
llama2_7b_full.yaml cut to 2 blocks (667 M parameters: 2.7 GB of float32 weights, 1.3 GB as the device's
bf16 copies) under a 4 GB cap, with --allow-lossy opening every lossy knob beside it."""

from __future__ import annotations

import logging

import pytest
import yaml

from conftest import ROOT
from ckrun.runner.cli import main
from tune_helpers import report


@pytest.mark.slow  # a 667 M-parameter model on fake tensors, predicted per plan: minutes on 2 cores
def test_a_predicted_tune_starts_from_the_masters_on_the_host_and_finds_a_plan(tmp_path, caplog):
    recipe = ROOT / "bench" / "published" / "llama2_7b_full.yaml"
    with caplog.at_level(logging.INFO, logger="ckrun.autotune"):
        code = main(["tune", str(recipe), "model.config.num_hidden_layers=2", f"output.dir={tmp_path / 'run'}",
                     "--predict", "--gpu", "a100", "--allow-lossy", "--max-mem", "4GB", "--no-train", "--no-solver",
                     "--trials", "4", "--output", str(tmp_path / "tune")])
    assert code == 0
    assert any("starting points and the solver take optimizer_offload master" in r.getMessage() for r in caplog.records)
    found = report(tmp_path / "tune")
    winner = found["trials"][found["winner"]]
    assert winner["plan"]["optimizer_offload"] == {"policy": "master"}
    assert winner["measured_peak"] <= found["limit_bytes"]
    tuned = yaml.safe_load((tmp_path / "tune" / "tuned.yaml").read_text())
    assert tuned["memory"]["optimizer_offload"] == {"policy": "master"}
