"""The loss without whole logits: the same loss and gradients as the model's own head, bit for bit
where the arithmetic is the same (one piece), within the bound of fp32 summation where pieces
reorder the sums; fewer bytes; refused in one line where the head cannot be split."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings, strategies as st
from torch import nn

from ckrun.runner.builders.data import IGNORE
from ckrun.runner.memory.chunked_loss import SplitHead
from ckrun.runner.plan.memory_plan import ChunkedLoss, MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.problems import InputError
from ckrun.runner.train.trainer import Trainer
from tests.runner.memory.tiny_lm import GPT2, LLAMA, identical, recipe, train

U = 2.0 ** -24  # float32's unit roundoff
BERT_MLM = ("{source: transformers, name: BertForMaskedLM, config: {vocab_size: 256, hidden_size: 32, num_hidden_layers: 2, "
            "num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 64}}")


@pytest.mark.parametrize(("model", "precision"), [(LLAMA, "fp32"), (LLAMA, "bf16"), (GPT2, "fp32"), (BERT_MLM, "fp32")],
                         ids=["llama", "llama-bf16", "gpt2-tied", "bert-sparse-masked-lm"])
def test_one_piece_is_the_models_own_head_bit_for_bit(model, precision):
    """One piece runs the projection and the cross-entropy on the same values as the model does: the
    same losses and weights, though the logits are recomputed in the backward."""
    whole = train(recipe("{}", model, precision), steps=3)
    split = train(recipe("{loss: {policy: chunked, chunks: 1}}", model, precision), steps=3)
    assert split[0] == whole[0]
    assert identical(split[1], whole[1])
    assert split[2].plan.head is not None


class Head(nn.Module):
    """A language model reduced to its head: the hidden states are the input."""

    def __init__(self, hidden: int, vocab: int, bias: bool):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def _loss_and_gradients(model: Head, hidden: torch.Tensor, labels: torch.Tensor, chunks: int | None):
    hidden = hidden.clone().requires_grad_()
    model.zero_grad()
    if chunks is None:
        loss = F.cross_entropy(model(hidden).float().reshape(-1, model.lm_head.out_features), labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
    else:
        head = SplitHead(model, ChunkedLoss(policy="chunked", chunks=chunks))
        with head.passing_through():
            out = model(hidden)
        loss = head.loss_sum(out, labels, None, contextlib.nullcontext)
    loss.backward()
    grads = [hidden.grad, model.lm_head.weight.grad] + ([model.lm_head.bias.grad] if model.lm_head.bias is not None else [])
    return loss.detach(), [g.detach().clone() for g in grads]


def _gamma(n: int) -> float:
    """The bound on the relative rounding of an fp32 sum of n terms, in any order (Higham's gamma_n)."""
    return n * U / (1 - n * U)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 24), chunks=st.integers(1, 30), vocab=st.integers(2, 300),
       bias=st.booleans(), seed=st.integers(0, 2 ** 16), ignored=st.floats(0, 0.5))
# drawn by a seeded run: a 12-row matrix product and twelve 1-row ones rounded the logits differently
@example(batch=1, length=12, chunks=12, vocab=2, bias=True, seed=26998, ignored=0.0)
def test_pieces_reorder_only_the_sums_within_fp32_summations_bound(batch, length, chunks, vocab, bias, seed, ignored):
    """The bound, from fp32 summation (u = 2^-24): a float32 sum of n terms is within gamma_n =~ n u
    times sum|terms| of the exact sum in any order, so two orders are within 2 gamma_n sum|terms|.
    A logit is a sum of 16 products and the bias, which the matrix kernel may order otherwise for a
    piece's fewer rows (it does: one row and twelve differ in the last bit): two evaluations within
    m = 2 gamma_17 max_j (|h| |W_j| + |b_j|) of each other, so a row's loss (its log-sum-exp less its
    label's logit) within 2 m, and each probability p_i within p_i (e^(2m) - 1). A row's softmax (and
    its log-sum-exp) sums the V exponentials of the row, which a kernel working on another number of
    rows may order, and vectorise, otherwise: each evaluation within (V + 4) u relative (the sum, the
    exponential's own error, a division and a subtraction), so two within 2 (V + 4) u. Then the loss
    (a sum over the N labelled positions) is within 2 (N - 1) u L plus the rows' own differences; the
    weight's gradient (a sum of N outer products dlogits x hidden) within (2 (V + 4) + 2 (N - 1)) u
    |dlogits|^T |hidden|; the hidden states' gradient (a sum over the vocabulary) within
    (2 (V + 4) + 2 (V - 1)) u |dlogits| |weight|; the bias's likewise; each plus what the probabilities'
    shift carries through the same products (to first order: the rest is u^2)."""
    torch.manual_seed(seed)
    model, hidden = Head(16, vocab, bias), torch.randn(batch, length, 16)
    labels = torch.randint(0, vocab, (batch, length)).masked_fill(torch.rand(batch, length) < ignored, IGNORE)
    whole, whole_grads = _loss_and_gradients(model, hidden, labels, None)
    split, split_grads = _loss_and_gradients(model, hidden, labels, chunks)
    counted, labelled = int((labels != IGNORE).sum()), (labels != IGNORE).reshape(-1)
    softmax = 2 * (vocab + 4) * U
    with torch.no_grad():
        logits = model(hidden).double().reshape(-1, vocab)
        rows = (logits.logsumexp(-1).abs() + 2 * logits.abs().amax(-1))[labelled]
        probabilities = torch.softmax(logits, -1) * labelled.unsqueeze(-1)
        dlogits = (probabilities - F.one_hot(labels.reshape(-1).clamp(min=0), vocab).double() * labelled.unsqueeze(-1))
        dlogits = dlogits.abs()
        weight, flat = model.lm_head.weight.double().abs(), hidden.reshape(-1, 16).double().abs()
        terms = flat @ weight.T + (model.lm_head.bias.double().abs() if bias else 0)
        shift = 2 * _gamma(16 + 1) * terms.amax(-1)  # m: the most one row's logits move between two kernels
        moved = torch.expm1(2 * shift).unsqueeze(-1) * probabilities  # what that moves each probability by
    assert abs(float(split) - float(whole)) <= (2 * max(counted - 1, 0) * U * float(whole) + softmax * float(rows.sum())
                                                + 2 * float(shift[labelled].sum()))
    n = batch * length
    bounds = [((softmax + 2 * (vocab - 1) * U) * dlogits @ weight + moved @ weight).reshape(batch, length, 16),
              (softmax + 2 * (n - 1) * U) * dlogits.T @ flat + moved.T @ flat,
              (softmax + 2 * (n - 1) * U) * dlogits.sum(0) + moved.sum(0)][: len(whole_grads)]
    for got, want, bound in zip(split_grads, whole_grads, bounds, strict=True):
        assert torch.all((got.double() - want.double()).abs() <= bound)


def test_more_pieces_train_as_the_whole_within_rounding_and_hold_fewer_bytes():
    """Over steps the weights differ by the rounding of the sums (the property above); AdamW can carry
    a last-bit difference of a gradient into a larger one of an update, so the losses are compared
    to a tolerance of a few such steps, and the saving is counted."""
    whole = train(recipe("{}", seq_len=32), steps=3)
    split = train(recipe("{loss: {policy: chunked, chunks: 4}}", seq_len=32), steps=3)
    assert split[0] == pytest.approx(whole[0], rel=1e-5)
    estimator = Estimator(recipe("{}", seq_len=32), "cpu")
    full = estimator.estimate(MemoryPlan())
    pieces = estimator.estimate(MemoryPlan(loss={"policy": "chunked", "chunks": 4}))
    assert pieces.peak_bytes < full.peak_bytes
    assert split[2].train_step()["peak_mem_bytes"] == pieces.peak_bytes


def test_a_model_without_a_plain_output_projection_is_refused_in_one_line():
    classifier = ("{source: transformers, name: BertForSequenceClassification, config: {vocab_size: 256, hidden_size: 32, "
                  "num_hidden_layers: 1, num_attention_heads: 2, intermediate_size: 64, num_labels: 3}}")
    with pytest.raises(InputError) as refused:
        Trainer(recipe("{loss: {policy: chunked}}", classifier))
    message = str(refused.value)
    assert ("memory.loss: chunked needs a language model whose logits are its output projection's output, and "
            "BertForSequenceClassification's output projection (get_output_embeddings) is none, not one nn.Linear; "
            "use memory.loss.policy: whole") in message and "\n" not in message.strip()


def test_a_model_that_changes_its_logits_after_the_projection_is_refused_at_its_first_step():
    """Gemma 2 soft-caps its logits (tanh(logits / 30) * 30): the loss of the projection's output would
    not be its loss. What the model returns is checked against what the projection passed through."""
    gemma = ("{source: transformers, name: Gemma2ForCausalLM, config: {vocab_size: 256, hidden_size: 32, "
             "num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 64, head_dim: 8}}")
    trainer = Trainer(recipe("{loss: {policy: chunked}}", gemma))
    with pytest.raises(InputError, match="chunked needs a language model whose logits are its output projection's "
                                         "output, and Gemma2ForCausalLM changes that output") as refused:
        trainer.train_step()
    assert refused.value.key == "memory.loss" and "\n" not in str(refused.value).strip()


def test_a_lossy_compressions_error_is_measured_through_the_split_head():
    """memory.compression's gradient error runs the step's own loss: with a chunked loss, the pieces,
    never the whole logits."""
    memory = "{loss: {policy: chunked, chunks: 4}, compression: {policy: bf16, min_bytes: 0}, allow_lossy: true}"
    trainer = Trainer(recipe(memory, seq_len=32))
    assert trainer.gradient_error is not None and 0 < trainer.gradient_error < 0.05
