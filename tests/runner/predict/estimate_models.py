"""Models for the estimate tests, importable by recipes as `estimate_models:<factory>`."""

from __future__ import annotations

import torch
from torch import nn


class _BranchOnValues(nn.Module):
    """Picks a branch by a tensor's value: fake tensors have no values, so no estimate exists."""

    def __init__(self, width: int = 16, num_classes: int = 4):
        super().__init__()
        self.body = nn.Linear(3 * 8 * 8, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.body(images.flatten(1))
        if hidden.sum() > 0:
            hidden = hidden.relu()
        return self.head(hidden)


def branch_on_values(width: int = 16, num_classes: int = 4) -> nn.Module:
    return _BranchOnValues(width, num_classes)


class _TinyLSTM(nn.Module):
    """Embedding, stacked LSTM layers (the repeated blocks a plan acts on) and a linear head over the
    last step: sequence classification."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = layer(hidden)[0]
        return self.head(hidden[:, -1])


def tiny_lstm(**config) -> nn.Module:
    return _TinyLSTM(**config)
