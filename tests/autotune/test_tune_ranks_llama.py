"""`ckrun tune --nproc N` on a tiny Llama, whose transformers config ships a tensor-parallel plan:
the real model child predicts one rank under each strategy (runner/predict/per_rank.py), and (slow)
the whole tune runs end to end, predicted for 4 ranks and measured with 2."""

from __future__ import annotations

import pytest

from ckrun.autotune.space.candidate import Candidate
from conftest import ROOT
from ckrun.runner.cli import main
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.strategies import strategy_from_label
from test_tune_sharding import TINY_LLAMA, _llama
from tune_helpers import report

LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")
# a Llama large enough that sharding matters beside the CUDA context: 4 layers of width 256, 8 heads
# sharing 4 key/value heads, a 32k vocabulary (its embedding and head are most of its 20M parameters)
SMALL_LLAMA = ["model.config.hidden_size=256", "model.config.intermediate_size=688", "model.config.num_hidden_layers=4",
               "model.config.num_attention_heads=8", "model.config.num_key_value_heads=4",
               "model.config.max_position_embeddings=128", "data.seq_len=128", "train.batch_size=8",
               "train.device=auto", "memory.micro_batch=null", "memory.checkpointing={policy: none}"]


def test_the_model_child_predicts_one_rank_of_four_under_each_strategy():
    """Each request goes through Candidate.request() and back, as the tuner sends it; sharding the
    parameters over more ranks lowers a rank's peak: fsdp over 4 below hsdp over groups of 2 below ddp."""
    from ckrun.autotune.probes.model_child import _predict, _ranks

    ranks = _ranks(_llama(), 4, "cpu", None)  # what the child builds before it says it is ready
    peaks = {}
    try:
        for label in ("ddp", "fsdp", "hsdp:2", "tp:2"):
            candidate = Candidate(MemoryPlan(micro_batch=1), "fp32", strategy_from_label(label))
            answer = _predict(ranks, {"id": 0, **candidate.request()}, nproc=4)
            assert answer["status"] == "ok", answer
            peaks[label] = answer["peak_bytes"]
    finally:
        ranks.predictor.close()
    assert peaks["fsdp"] < peaks["hsdp:2"] < peaks["ddp"] and peaks["tp:2"] < peaks["ddp"], peaks


@pytest.mark.slow
def test_tune_predicts_four_ranks_of_a_small_llama_and_writes_the_winners_strategy(tmp_path, capsys):
    """ckrun tune recipes/llama_1b.yaml SMALL_LLAMA --max-mem 1.5GB --nproc 4 --predict --gpu h100: ddp,
    fsdp, hsdp:2, tp:2 and tp:4 are searched (4 key/value heads split over 4 ranks); the plans with
    FSDP2's CPU offload cannot be predicted on fake tensors (its pinned host copies) and say so."""
    code = main(["tune", LLAMA, *SMALL_LLAMA, f"output.dir={tmp_path / 'run'}", "--max-mem", "1.5GB", "--nproc", "4",
                 "--predict", "--gpu", "h100", "--trials", "12", "--output", str(tmp_path / "tune")])
    assert code == 0, capsys.readouterr().err[-3000:]
    found = report(tmp_path / "tune")
    fitting = [t for t in found["trials"] if t["state"] == "feasible"]
    assert {t["strategy"]["strategy"] for t in fitting} >= {"hsdp", "tp"}  # predicted per rank, not refused
    assert all(t["measured_peak"] <= found["limit_bytes"] for t in fitting)
    winner = found["trials"][found["winner"]]
    tuned = recipe_from_text((tmp_path / "tune" / "tuned.yaml").read_text(), "tuned.yaml")
    assert tuned.distributed.model_dump(mode="json", exclude_none=True) == winner["strategy"]
    assert (tuned.memory.sharding is not None) == tuned.distributed.shards
    assert tuned.memory.micro_batch == winner["plan"]["micro_batch"]


@pytest.mark.slow
def test_tune_measures_two_ranks_of_a_tiny_llama_under_a_cap_ddp_cannot_meet(tmp_path, capsys):
    """ckrun tune recipes/llama_1b.yaml TINY_LLAMA train.batch_size=4 --max-mem 2.1MB --nproc 2: real
    torchrun groups of 2 ranks on the CPU. ddp keeps the whole model on each rank (2.3-2.5 MB a rank),
    fsdp and tp:2 split it (1.8-1.9 MB): ddp is screened out by its prediction, a sharded plan wins."""
    code = main(["tune", LLAMA, *TINY_LLAMA, "train.batch_size=4", f"output.dir={tmp_path / 'run'}", "--max-mem",
                 "2.1MB", "--nproc", "2", "--trials", "3", "--finalists", "0", "--no-train", "--warmup-steps", "1",
                 "--timed-steps", "2", "--output", str(tmp_path / "tune")])
    assert code == 0, capsys.readouterr().err[-3000:]
    found = report(tmp_path / "tune")
    assert all(t["state"] in ("screened", "over_limit", "invalid") for t in found["trials"]
               if (t.get("strategy") or {}).get("strategy") == "ddp")
    winner = found["trials"][found["winner"]]
    assert winner["strategy"]["strategy"] in ("fsdp", "tp") and winner["measured_peak"] <= found["limit_bytes"]
    tuned = recipe_from_text((tmp_path / "tune" / "tuned.yaml").read_text(), "tuned.yaml")
    assert tuned.distributed.model_dump(mode="json", exclude_none=True) == winner["strategy"]
