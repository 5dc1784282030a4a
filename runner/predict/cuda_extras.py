"""Device memory a CUDA step takes beyond its tensors, as far as it is known, for the estimate.

Each figure says where it comes from. Measured ones were read on an H100 80GB with torch 2.11 and
CUDA 13.0 by `bench/gpu/facts.py` (docs/benchmarks_gpu.md); other GPUs or versions may differ.

- cuBLAS workspaces: torch gives each (cuBLAS handle, stream) pair a workspace from the caching
  allocator and keeps it. Handles are per thread, so a training step has two: the forward on the
  main thread, the backward on autograd's device thread. Size from CUBLAS_WORKSPACE_CONFIG
  (":KiB:COUNT" pairs), else torch's default: 32 MiB on Hopper and newer (measured: 32 MiB per
  stream), 8 MiB + 128 KiB before.
- Attention backward scratch, held only while the kernel runs: flash (FlashAttention-2) two fp32
  buffers of the query's [B, S, H, D] (S rounded up to 128, D to 32) plus an fp32 [B, H, S]
  (measured at B16 H16 S512 D64: 67,633,152 bytes, exactly this); memory-efficient one fp32
  buffer of the query's size plus an fp32 [B, H, S + 32] (measured: 34,111,488, exactly this).
- PYTORCH_CUDA_ALLOC_CONF: `expandable_segments:True` is modelled (one growing segment per pool);
  other settings (max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions) are
  not, and are named in the estimate's notes when set.
Not modelled: the CUDA context (measured per device by the tuner's device probe), cuDNN
convolution workspaces, NCCL buffers.
"""

from __future__ import annotations

import os
import re

import torch

from ..environment import CAPABILITY_ENV  # "9.0": the card's, when the GPUs are hidden from this process

MiB = 1 << 20
HOPPER = (9, 0)
BLAS_HANDLES_PER_STEP = 2  # the forward's thread and autograd's backward thread


# The CUDA context, which counts against the card: measured on an H100 with torch 2.11 once BERT-large's
# kernels had loaded (docs/benchmarks.md), as autotune/search/predicted.py's CONTEXT_BYTES; taken for any GPU.
CUDA_CONTEXT_BYTES = 804_000_000


def target_capability() -> tuple[tuple[int, int], bool]:
    """(compute capability, whether it was read off a GPU): this machine's GPU, else Hopper. The
    tuner's model child predicts with the GPUs hidden (its context would sit beside every probe), so
    the tuner passes it the card's capability, as the device child read it, in CKRUN_CUDA_CAPABILITY."""
    given = re.fullmatch(r"(\d+)\.(\d+)", os.environ.get(CAPABILITY_ENV, "").strip())
    if given:
        return (int(given[1]), int(given[2])), True
    if torch.cuda.is_available():
        return torch.cuda.get_device_capability(), True
    return HOPPER, False


def cublas_workspace_bytes(capability: tuple[int, int], config: str | None = None) -> int:
    """One handle's workspace, as torch sizes it (CUBLAS_WORKSPACE_CONFIG, else its default)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") if config is None else config
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(kib) * int(count) for kib, count in pairs) * 1024
    return 32 * MiB if capability >= HOPPER else (4096 * 2 + 16 * 8) * 1024


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flash_backward_scratch(query: torch.Tensor) -> int:
    batch, heads, seq, head_dim = query.shape
    accumulators = 2 * batch * _round_up(seq, 128) * heads * _round_up(head_dim, 32) * 4
    return accumulators + batch * heads * _round_up(seq, 128) * 4


def efficient_backward_scratch(query: torch.Tensor) -> int:
    batch, heads, seq, head_dim = query.shape
    return batch * heads * seq * head_dim * 4 + batch * heads * (seq + 32) * 4


def hold_during_backward(output: torch.Tensor, inputs: tuple[torch.Tensor, ...], nbytes: int) -> None:
    """Model a kernel's backward scratch: allocate `nbytes` when the gradient of `output` arrives and
    free it once an input's gradient is out. Hooks sit on the forward's own tensors, so a
    checkpoint's recompute (whose graph backward never walks) adds nothing twice."""
    needing = [t for t in inputs if t.requires_grad]
    if not output.requires_grad or not needing or not torch.is_grad_enabled():
        return
    held: list[torch.Tensor] = []
    output.register_hook(lambda grad: held.append(torch.empty(nbytes, dtype=torch.uint8, device=grad.device)))
    needing[0].register_hook(lambda grad: held.clear())


def allocator_settings(planned: str | None = None) -> tuple[bool, list[str]]:
    """(expandable segments on, the settings this model does not follow) from the allocator config:
    the plan's memory.allocator when it has one (the trainer will set it), else the environment's."""
    text = planned or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable, ignored = False, []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            expandable = value.strip().lower() in ("true", "1")
        else:
            ignored.append(item)
    return expandable, ignored
