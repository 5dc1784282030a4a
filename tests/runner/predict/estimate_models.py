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


INPLACE_OPS = {  # the in-place activations torchvision's models and users' own use, and plain in-place arithmetic
    "relu_": lambda h: torch.nn.functional.relu_(h),
    "relu_module": lambda h: nn.ReLU(inplace=True)(h),
    "hardswish_": lambda h: torch.nn.functional.hardswish(h, inplace=True),
    "silu_": lambda h: torch.nn.functional.silu(h, inplace=True),
    "add_": lambda h: h.add_(1.0),
    "dropout_": lambda h: torch.nn.functional.dropout(h, 0.25, True, inplace=True),
}
INPLACE_PLACES = ("model_input", "between", "block_input", "middle", "block_output", "residual", "before_head")


class _InPlaceBlock(nn.Module):
    def __init__(self, width: int, where: str, op: str):
        super().__init__()
        self.first, self.second = nn.Linear(width, width), nn.Linear(width, width)
        self.where, self.act = where, INPLACE_OPS[op]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "block_input":
            x = self.act(x)
        h = self.first(x)
        if self.where == "middle":
            h = self.act(h)
        h = self.second(h)
        if self.where == "block_output":
            h = self.act(h)
        return self.act(h + x) if self.where == "residual" else h


class _InPlaceNet(nn.Module):
    """Blocks of two linear layers with one in-place op where `where` says: before, between or inside them."""

    def __init__(self, where: str, op: str, width: int = 32, depth: int = 3, num_classes: int = 4):
        super().__init__()
        self.where, self.act = where, INPLACE_OPS[op]
        self.inp = nn.Linear(3 * 8 * 8, width)
        self.layers = nn.ModuleList(_InPlaceBlock(width, where, op) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        x = self.inp(self.act(x.clone()) if self.where == "model_input" else x)
        if self.where == "between":
            x = self.act(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.act(x) if self.where == "before_head" else x)


def in_place_net(where: str = "middle", op: str = "relu_", **config) -> nn.Module:
    return _InPlaceNet(where, op, **config)


class _ConvBnNet(nn.Module):
    """Convolution, BatchNorm and an in-place ReLU per block, as torchvision's CNNs stack them."""

    def __init__(self, channels: int = 16, depth: int = 3, num_classes: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                                  nn.ReLU(inplace=True)) for _ in range(depth))
        self.head = nn.Linear(channels, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean((2, 3)))


def conv_bn_net(**config) -> nn.Module:
    return _ConvBnNet(**config)


class _ResidualNet(nn.Module):
    """torchvision's ResNet in small: a stem, a widening residual block, then `depth` alike, each ending
    in a ReLU that saves its output for its backward (torchvision's BasicBlock)."""

    def __init__(self, channels: int = 8, depth: int = 2, num_classes: int = 4):
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        wide = 2 * channels
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        widen = nn.Sequential(nn.Conv2d(channels, wide, 1, bias=False), nn.BatchNorm2d(wide))
        self.layers = nn.Sequential(BasicBlock(channels, wide, downsample=widen),
                                    *(BasicBlock(wide, wide) for _ in range(depth)))
        self.head = nn.Linear(wide, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(images)).mean((2, 3)))


def residual_net(**config) -> nn.Module:
    return _ResidualNet(**config)
