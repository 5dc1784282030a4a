"""The classic activation-checkpointing examples, as small models ckrun ships.

Each factory takes keyword arguments only, so a recipe's `model.config` (or an override such as
`model.config.depth=4`) can resize it. The repeated blocks are their own classes and nothing
else in a model shares a block's class, so `ckrun.runner.memory.blocks.find_blocks` finds exactly the
blocks a plan's indices count, with no `memory.blocks` needed.

- `conv20`: 20 Conv-BN-ReLU blocks that keep the image size, the `checkpoint_sequential` example.
- `cifar_cnn`: the textbook CIFAR-10 network: two conv blocks, dropout, a linear head.
- `transformer_stack`: a GPT-style stack of pre-LayerNorm attention + GELU feed-forward blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --- conv20 ---------------------------------------------------------------------------------


class ConvBlock(nn.Sequential):
    """Conv 3x3 (same size) -> BatchNorm -> ReLU; no stride, so every block keeps a full-size map."""

    def __init__(self, in_channels: int, out_channels: int):
        # no bias: BatchNorm's shift makes it redundant. ReLU is not in place, so a checkpointed
        # block's output is a fresh tensor and never a view the recompute would have to match.
        super().__init__(nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU())


def conv20(num_classes: int = 10, width: int = 64, depth: int = 20, in_channels: int = 3) -> nn.Sequential:
    """`depth` ConvBlocks of `width` channels, then global average pooling and a linear head.

    One flat nn.Sequential, as `torch.utils.checkpoint.checkpoint_sequential` expects: its
    children are the blocks (found by ckrun as the repeated class) and the head.
    """
    blocks = [ConvBlock(in_channels if i == 0 else width, width) for i in range(depth)]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
    return nn.Sequential(*blocks, head)


# --- cifar_cnn ------------------------------------------------------------------------------


class CifarBlock(nn.Sequential):
    """Two 3x3 convs with ReLU, 2x2 max-pool, dropout: halves the image, doubles the channels."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(dropout),
        )


def cifar_cnn(num_classes: int = 10, width: int = 32, image_size: int = 32, dropout: float = 0.25,
              head_dropout: float = 0.5, in_channels: int = 3) -> nn.Sequential:
    """Blocks of `width` and 2*`width` channels, then dropout and one linear layer to the classes."""
    if image_size % 4:
        raise ValueError(f"cifar_cnn: image_size {image_size} must be a multiple of 4 (two 2x2 poolings)")
    features = 2 * width * (image_size // 4) ** 2  # the linear head sees the flattened last map
    return nn.Sequential(
        CifarBlock(in_channels, width, dropout), CifarBlock(width, 2 * width, dropout),
        nn.Flatten(), nn.Dropout(head_dropout), nn.Linear(features, num_classes),
    )


# --- transformer_stack ----------------------------------------------------------------------


class StackBlock(nn.Module):
    """Pre-LayerNorm block: x + attention(LN(x)), then x + FFN(LN(x)) with a GELU in between."""

    def __init__(self, width: int, heads: int, ff_mult: int, dropout: float):
        super().__init__()
        if width % heads:
            raise ValueError(f"transformer_stack: width {width} is not divisible by heads {heads}")
        self.heads, self.dropout = heads, dropout
        self.ln_attn, self.ln_ff = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        # named layers, not an nn.Sequential: two Linears in a container would look like blocks
        self.ff_in, self.ff_out = nn.Linear(width, ff_mult * width), nn.Linear(ff_mult * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.out(self._attention(self.ln_attn(x))))
        return x + self.drop(self.ff_out(F.gelu(self.ff_in(self.ln_ff(x)))))

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # causal: a language model
        return y.transpose(1, 2).reshape(batch, length, width)


class TransformerStack(nn.Module):
    def __init__(self, vocab_size: int, width: int, depth: int, heads: int, ff_mult: int, max_len: int,
                 dropout: float):
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len  # data reads vocab_size when the recipe omits it
        self.embed, self.position = nn.Embedding(vocab_size, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(StackBlock(width, heads, ff_mult, dropout) for _ in range(depth))
        self.ln_final, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens is longer than max_len {self.max_len}; "
                             "raise model.config.max_len or lower data.seq_len")
        positions = torch.arange(length, device=input_ids.device)
        x = self.drop(self.embed(input_ids) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))


def transformer_stack(vocab_size: int = 16384, width: int = 512, depth: int = 12, heads: int = 8, ff_mult: int = 4,
                      max_len: int = 1024, dropout: float = 0.1) -> TransformerStack:
    """A causal language model of `depth` blocks; logits of shape [batch, length, vocab_size]."""
    return TransformerStack(vocab_size, width, depth, heads, ff_mult, max_len, dropout)
