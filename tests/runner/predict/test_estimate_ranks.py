"""`ckrun estimate --nproc N` counts one rank: FSDP really shards the fake model over a fake group of
N ranks, so a rank holds exactly 1/N of the parameters and of AdamW's moments (every dimension here
splits evenly); DDP holds them whole plus gradient buckets as large as the gradients. The comparison
with measured per-rank peaks is in tests/runner/parallel/test_ranks.py (slow: it starts ranks)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=8", "precision=fp32"]


def estimate(ckrun, *args) -> dict:
    code, out, err = ckrun("estimate", STACK, *TINY, "--device", "cpu", "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_rank_holds_its_share_of_parameters_and_optimizer_state(ckrun, nproc):
    whole = estimate(ckrun, "train.batch_size=2", "distributed.strategy=fsdp")  # one process: nothing to shard
    rank = estimate(ckrun, f"train.batch_size={2 * nproc}", "distributed.strategy=fsdp", "--nproc", str(nproc))
    assert rank["breakdown"]["parameters"] * nproc == whole["breakdown"]["parameters"]
    # AdamW's two moments shard with their parameters; its step counters (a scalar each) do not
    counters = whole["breakdown"]["optimizer_state"] - 2 * whole["breakdown"]["parameters"]
    assert rank["breakdown"]["optimizer_state"] == 2 * rank["breakdown"]["parameters"] + counters
    assert rank["notes"][0].startswith(f"one of {nproc} ranks (fsdp): its share of 2 samples")


def test_fsdp_counts_one_blocks_gradients_in_their_reduce_scatter(ckrun):
    # the fake group ends each reduce-scatter at once; gloo held one block's buffer on in 4 of 5 runs at 2 ranks,
    # so the estimate was 4.5% low with no warning
    rank = estimate(ckrun, "train.batch_size=4", "distributed.strategy=fsdp", "--nproc", "2")
    # the stack's block in fp32: attention (4 x 16 x 16 + 4 x 16), MLP (16 x 64 + 64 + 64 x 16 + 16), 2 norms (2 x 32)
    assert rank["breakdown"]["reduce_in_flight"] == (4 * 16 * 16 + 4 * 16 + 16 * 64 + 64 + 64 * 16 + 16 + 2 * 32) * 4
    assert sum(rank["breakdown"].values()) == rank["peak_bytes"]
    assert any("one block's gradients still in their reduce-scatter" in note for note in rank["notes"])


def test_ddp_rank_holds_the_whole_model_and_gradient_buckets(ckrun):
    whole = estimate(ckrun, "train.batch_size=4", "distributed.strategy=ddp")
    rank = estimate(ckrun, "distributed.strategy=ddp", "--nproc", "2")
    assert rank["breakdown"]["gradient_buckets"] == whole["breakdown"]["parameters"]
    assert rank["peak_bytes"] == whole["peak_bytes"] + whole["breakdown"]["parameters"]


def test_a_batch_that_does_not_split_is_one_line(ckrun):
    code, _, err = ckrun("estimate", STACK, *TINY, "distributed.strategy=fsdp", "--nproc", "3")
    assert code == 2 and err.count("\n") == 1 and "does not split over 3 ranks" in err
