"""Tiny user models (`model.source: python`, imported as `user_models:FACTORY`) for the export and
evaluation tests: each has something that makes weights or training easy to get subtly wrong."""

import torch
from torch import nn


class TiedLM(nn.Module):
    """A causal LM whose output projection is the embedding (tied weights), with dropout."""

    def __init__(self, vocab_size: int, width: int, dropout: float, noise: float = 0.0):
        super().__init__()
        self.noise = noise  # drawn in eval mode too, as stochastic layers do: only a forked RNG keeps training apart
        self.vocab_size = vocab_size  # read by ckrun to draw token ids
        self.embed = nn.Embedding(vocab_size, width)
        self.mix = nn.Linear(width, width)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(input_ids)))
        if self.noise:
            hidden = hidden + self.noise * torch.randn_like(hidden)
        return self.head(self.drop(hidden))


def tied_lm(vocab_size: int = 64, width: int = 16, dropout: float = 0.1, noise: float = 0.0) -> nn.Module:
    return TiedLM(vocab_size, width, dropout, noise)


def small_cnn(num_classes: int = 4, width: int = 8, dropout: float = 0.25) -> nn.Module:
    """BatchNorm (running statistics: buffers that eval mode must leave alone) and dropout."""
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Dropout(dropout),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
