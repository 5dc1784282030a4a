"""Text without packing (data.split: lines): a batch is padded to its longest line, and padding is
masked out of attention and carries no label."""

import torch
from hypothesis import given, settings, strategies as st

from ckrun.runner.builders.data import IGNORE, Shape, _generator, padded_batch


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=6), task=st.sampled_from(["masked_lm", "causal_lm"]))
def test_padding_is_masked_and_unlabelled(lengths, task):
    samples = [torch.randint(2, 50, (n,)) for n in lengths]
    batch = padded_batch(samples, Shape(task, True, vocab_size=50), _generator(0, 1), 0.3, 1)
    ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
    assert ids.shape == (len(lengths), max(lengths)) and mask.shape == ids.shape
    for row, n in enumerate(lengths):
        assert mask[row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert (batch.labels[row, n:] == IGNORE).all()  # nothing is learnt from padding
        if task == "causal_lm":  # the last real token predicts nothing: the next one is padding
            assert batch.labels[row, n - 1] == IGNORE
            assert torch.equal(batch.labels[row, : n - 1], samples[row][1:])
        else:
            labelled = batch.labels[row, :n] != IGNORE
            assert torch.equal(batch.labels[row, :n][labelled], samples[row][labelled])
