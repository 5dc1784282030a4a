"""Masked LM's sparse prediction: the head projects only the labelled positions, for the model as
built and for the model DDP wraps (whose wrapper has no `get_output_embeddings` of its own)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM

from ckrun.runner.train.step import predict_only_at

VOCAB, SEQ, BATCH, LABELLED = 64, 16, 2, 3


@contextlib.contextmanager
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already up in this worker")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> BertForMaskedLM:
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ)
    return BertForMaskedLM(config).eval()  # no dropout: the two forwards must agree


@pytest.mark.parametrize("wrap", ["none", "ddp"])
def test_the_head_sees_only_the_labelled_positions(wrap):
    torch.manual_seed(0)
    model, ids = _model(), torch.randint(0, VOCAB, (BATCH, SEQ))
    positions = torch.tensor([[1, 4, 9], [0, 2, 15]])
    full = model(input_ids=ids).logits
    with one_rank_group() if wrap == "ddp" else contextlib.nullcontext():
        called = torch.nn.parallel.DistributedDataParallel(model) if wrap == "ddp" else model
        with predict_only_at(called, positions):
            sparse = called(input_ids=ids).logits
    assert sparse.shape == (BATCH, LABELLED, VOCAB)
    torch.testing.assert_close(sparse, full.gather(1, positions.unsqueeze(-1).expand(-1, -1, VOCAB)))
