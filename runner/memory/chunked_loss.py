"""memory.loss chunked: a language model's loss without its whole logits.

A language model's logits are [batch, sequence, vocabulary]: at Llama-3's 128256 words and 8192
positions a sample's are 2 GB in bf16, their fp32 copy for the loss 4 GB more, their gradient as
much again. Here the model's output projection (`get_output_embeddings()`, one nn.Linear) passes
its input through during the forward, so the model returns its last hidden states, and the loss
runs over `chunks` pieces of the sequence: each piece's logits are the projection of its hidden
states, its cross-entropy (in float32, summed) is computed at once, and the piece is one
non-reentrant checkpoint, so its logits are freed after the forward and recomputed in the backward.
One piece's logits, their fp32 copy and gradient are alive at a time (torchtune's chunked output
loss keeps every piece's logits; Liger's fused linear cross-entropy recomputes, as here).

Exact up to float summation order: the loss is the sum of the pieces' sums, and the projection's
weight gradient the sum of the pieces' contributions, where the whole computation sums each in one
reduction; every logit and every other gradient is the same sum of the same values, though the
matrix kernel may order a logit's terms otherwise for a piece's fewer rows (the last bit differs).
With `chunks: 1` the arithmetic is the same as the model's own.

Refused, in one line, where the split would not compute the model's loss: a model without an
output projection that is one plain nn.Linear (classifiers, vision models, user models without
`get_output_embeddings`), and a model whose returned logits are not the projection's output (one
that scales or soft-caps them, as Gemma 2 does): the pass-through is checked by identity every step.
A tied projection (GPT-2's, shared with the input embedding) is fine: autograd sums its two
gradients as it does without the split.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..builders.contract import check_classes
from ..builders.data import IGNORE
from ..builders.resolve import BuildError
from ..plan.pool_policies import LossPolicy
from .blocks import wrap_forward

SPLIT_REFUSAL = "memory.loss: chunked needs a language model whose logits are its output projection's output"


class SplitHead:
    """The output projection of one model, passed through in its forward, and the loss over pieces."""

    def __init__(self, model: nn.Module, policy: LossPolicy):
        self.model, self.head, self.chunks = model, output_projection(model), policy.pieces()
        self._passed: torch.Tensor | None = None

    @contextlib.contextmanager
    def passing_through(self):
        """The projection returns its input (the last hidden states) while the model runs inside."""
        undo = wrap_forward(self.head, lambda _forward: self._through)
        try:
            yield
        finally:
            undo()

    def _through(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._passed = hidden
        return hidden

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None,
                 autocast) -> torch.Tensor:
        """The summed cross-entropy of what the model returned (`hidden`: the projection's input),
        piece by piece; `autocast` makes the context the projection ran in (the recipe's precision)."""
        passed, self._passed = self._passed, None
        if hidden is not passed:  # known only once the model has run: a fault of the model, at its first step
            raise BuildError("memory.loss", f"{SPLIT_REFUSAL.removeprefix('memory.loss: ')}, and "
                             f"{type(self.model).__name__} changes that output before returning it (scaling or capping "
                             "the logits); use memory.loss.policy: whole")
        if positions is not None and hidden.shape[1] == positions.shape[1]:
            labels = labels.gather(1, positions)  # the sparse masked-LM head: hidden states at the masked positions
        check_classes(self.head.out_features, labels, self.model)  # as the whole logits are checked
        length = hidden.shape[1]
        size = -(-length // self.chunks)  # a piece is at least one position
        total = None
        for start in range(0, length, size):
            # no random op in a projection and a cross-entropy: no RNG state to keep for the recompute
            piece = checkpoint(_piece_loss, hidden[:, start:start + size], labels[:, start:start + size],
                               self.head.weight, self.head.bias, autocast, use_reentrant=False,
                               preserve_rng_state=False)
            total = piece if total is None else total + piece
        return total


def _piece_loss(hidden: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                autocast) -> torch.Tensor:
    with autocast():
        logits = F.linear(hidden, weight, bias)
    logits = logits.float()  # as runner/train/step.py's loss_sum: the softmax of a large vocabulary in fp32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def output_projection(model: nn.Module) -> nn.Linear:
    """The model's output projection, or a ValueError saying in one line why it has none to split."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        found = "none" if head is None else type(head).__name__
        raise ValueError(f"{SPLIT_REFUSAL}, and {type(model).__name__}'s output projection (get_output_embeddings) "
                         f"is {found}, not one nn.Linear; use memory.loss.policy: whole")
    return head
