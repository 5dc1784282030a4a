"""A family of small models built from drawn layer lists, for the generated checkpointing tests.

Each model is a stack of `Block`s of one class (so the block finder sees them as repeated blocks),
every block a drawn list of layers over `[batch, time, width]` tensors. The layers are the kinds
that have broken checkpointing before: RNNs (GRU's cell writes its matmul outputs in place through
unsafe aliases), in-place activations after a matmul or convolution, BatchNorm, weights tied
between blocks, buffers that the forward changes and reads, dropout, RReLU (an op that writes into
a tensor it saved: a recompute stopped early never writes it).

Between two blocks the model's own loop may run code of its own (`BETWEEN`): noise drawn from the
RNG, a module of another class that saves tensors (Swin's PatchMerging), LayerDrop (a coin drawn,
then the block skipped), a block called a second time. sqrt's segments span that code.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 8
LAYERS = ("gru", "lstm", "rnn", "linear_relu_", "conv_silu_", "batchnorm", "ema_buffer", "dropout",
          "residual_add_", "tied", "mm_view_add_", "rrelu")


BETWEEN = ("none", "noise", "module", "layerdrop", "repeat")


class Block(nn.Module):
    def __init__(self, layers: list[str], shared: nn.Linear):
        super().__init__()
        self.layers = list(layers)
        self.parts = nn.ModuleDict({f"{i}_{name}": _make(name, shared) for i, name in enumerate(layers)})
        if "ema_buffer" in layers:
            self.register_buffer("ema", torch.zeros(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for key, part in self.parts.items():
            x = _run(key.split("_", 1)[1], part, x, self)
        return x


def _make(name: str, shared: nn.Linear) -> nn.Module:
    makers = {
        "gru": lambda: nn.GRU(WIDTH, WIDTH, batch_first=True),
        "lstm": lambda: nn.LSTM(WIDTH, WIDTH, batch_first=True),
        "rnn": lambda: nn.RNN(WIDTH, WIDTH, batch_first=True),
        "linear_relu_": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(inplace=True)),
        "conv_silu_": lambda: nn.Sequential(nn.Conv1d(WIDTH, WIDTH, 3, padding=1), nn.SiLU(inplace=True)),
        "batchnorm": lambda: nn.BatchNorm1d(WIDTH),
        "dropout": lambda: nn.Dropout(0.2),
        "rrelu": lambda: nn.RReLU(),  # random slopes written into a noise tensor its backward reads
        "tied": lambda: shared,
    }
    return makers.get(name, lambda: nn.Linear(WIDTH, WIDTH))()


def _run(name: str, part: nn.Module, x: torch.Tensor, block: Block) -> torch.Tensor:
    if name in ("gru", "lstm", "rnn"):
        return part(x)[0]
    if name in ("conv_silu_", "batchnorm"):
        return part(x.transpose(1, 2)).transpose(1, 2)
    if name == "ema_buffer":  # a running mean the forward both updates and reads
        with torch.no_grad():
            block.ema.mul_(0.5).add_(x.detach().mean(dim=(0, 1)), alpha=0.5)
        return part(x - block.ema)
    if name == "residual_add_":  # the matmul's own output changed in place
        y = part(x)
        y += x
        return y
    if name == "mm_view_add_":  # through a view of the matmul's output
        y = part(x)
        y[..., :2].mul_(2.0)
        return y
    return part(x)


class Stack(nn.Module):
    def __init__(self, blocks: list[list[str]], vocab: int = 11, between: list[str] | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        shared = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.Sequential(*[Block(layers, shared) for layers in blocks])
        self.between = list(between or ["none"] * len(blocks))
        self.mids = nn.ModuleDict({str(i): nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                   for i, kind in enumerate(self.between) if kind == "module"})
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input and output embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for index, (block, kind) in enumerate(zip(self.blocks, self.between, strict=True)):
            if kind == "layerdrop" and self.training and torch.rand([]) < 0.5:
                continue  # as Pegasus and BART: the coin drawn between blocks, the block skipped
            x = block(x)
            if kind == "noise":
                x = x + 0.01 * torch.randn_like(x)
            elif kind == "module":
                x = self.mids[str(index)](x)
            elif kind == "repeat":
                x = block(x)
        return self.head(x)
