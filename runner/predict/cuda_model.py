"""What a CUDA training step would do with memory, reproduced on fake CPU tensors.

Fake CUDA tensors run forward without a GPU, but autograd's engine asks the driver about the
device before any backward ("hasPrimaryContext expects a valid device index"), so the estimate
runs the step on fake CPU tensors and reproduces here the CUDA behaviour that changes memory:

- `CudaOnCpu`: (1) `F.scaled_dot_product_attention` goes to the kernel a GPU (sm80+) picks, in
  torch's priority order: flash (fp16/bf16, no mask, head dim <= 256, GQA allowed), else
  memory-efficient (mask allowed, a bool mask becoming an additive bias as on CUDA; no GQA), else
  the math path. Flash and efficient save the output and a log-sum-exp, not the S x S attention
  matrix of CPU's math path. (2) `F.dropout` uses CUDA's fused kernel, which saves a bool mask
  (CPU saves one in the input's dtype). (3) Under autocast, CUDA's fp32 ops (layer_norm,
  group_norm, softmax, exp, pow, ...) run in fp32 and cat/stack promote without a copy, as on
  CUDA; the lower-precision ops (mm, linear, conv, ...) and the cast-weight cache are the same
  on both devices, so CPU autocast does that part.
- `CachingAllocatorModel`: turns the order of allocations and frees into reserved bytes, as
  c10's CUDACachingAllocator does (see the class).

Checked against fake CUDA tensors, whose forward does run (tests): the forward of BERT, GPT-2,
Llama, T5 and ViT gives the same bytes, ResNet too (a half-precision BatchNorm keeps float32 statistics
on CUDA, which `fake_gaps.BatchNormStats` gives the fake kernel).
What CUDA adds beyond tensors (cuBLAS workspaces, attention backward scratch, the allocator's
config) is in `cuda_extras`. Not modelled: cuDNN attention, CPU autocast fp32 ops that CUDA keeps
in low precision beyond those listed here.
"""

from __future__ import annotations

import bisect
import functools
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .cuda_extras import efficient_backward_scratch, flash_backward_scratch, hold_during_backward

HALF = (torch.float16, torch.bfloat16)
_FP32_OPS = frozenset({  # CUDA autocast's fp32 list (autocast_mode.cpp), the ones models call
    "layer_norm", "group_norm", "exp", "expm1", "log", "log1p", "log2", "log10", "pow", "__pow__", "__rpow__",
    "rsqrt", "reciprocal", "softplus", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "logsumexp",
    "cosine_similarity", "dist", "cdist", "renorm", "binary_cross_entropy_with_logits", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "kl_div", "nll_loss", "interpolate",
})
_FP32_DTYPE_OPS = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "sum", "prod"})  # run with dtype=fp32
# in CPU autocast's lists but in none of CUDA's: CUDA runs them as called (cat promotes by itself)
_NOT_CAST_ON_CUDA = frozenset({"cat", "concat", "concatenate", "stack", "index_copy", "pad", "grid_sample",
                               "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d", "stft"})
_DROPOUT = F.dropout  # torch's own, for the fallback


class CudaOnCpu:
    """While open: CUDA's attention and dropout kernels (`F.scaled_dot_product_attention` and
    `F.dropout` replaced, so that calls from inside other functional code such as
    nn.MultiheadAttention are routed too, which a torch-function mode would not see) and CUDA
    autocast's op lists on top of CPU autocast (a torch-function mode). See the module docstring."""

    def __enter__(self) -> CudaOnCpu:
        self._saved = (F.scaled_dot_product_attention, F.dropout)  # nested use restores the outer's
        F.scaled_dot_product_attention, F.dropout = attention_as_on_cuda, _dropout_as_on_cuda
        self._mode = _CudaAutocastLists()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        F.scaled_dot_product_attention, F.dropout = self._saved


_LISTED = _FP32_OPS | _FP32_DTYPE_OPS | _NOT_CAST_ON_CUDA


class _CudaAutocastLists(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of the step comes here (a fake step's own modes' too: ~4 per op dispatched), and
        # few are listed: one set lookup for the rest
        name = getattr(func, "__name__", "")
        if name not in _LISTED or not torch.is_autocast_enabled("cpu"):
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        if name in _FP32_OPS:
            args, kwargs = _to_fp32((args, kwargs))
        elif name in _FP32_DTYPE_OPS and "dtype" not in kwargs and _has_half(args):
            kwargs = {**kwargs, "dtype": torch.float32}
        elif name in _NOT_CAST_ON_CUDA:
            with torch.autocast("cpu", enabled=False):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def in_cuda_mode(forward):
    """A block's forward that runs under `CudaOnCpu` also when checkpointing recomputes it in
    backward: autograd runs backward (and so the recompute) without torch-function modes."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with CudaOnCpu():
            return forward(*args, **kwargs)
    return run


def _has_half(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.dtype in HALF for a in args)


def _to_fp32(tree):
    cast = lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in HALF else t  # noqa: E731
    return torch.utils._pytree.tree_map(cast, tree)


def attention_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    """`F.scaled_dot_product_attention` through the kernel CUDA would pick (module docstring)."""
    low = _autocast_dtype()
    if low is not None:  # CUDA autocast casts attention inputs to the low dtype before choosing
        query, key, value = (t.to(low) if t.dtype == torch.float32 else t for t in (query, key, value))
    head_dim = query.size(-1)
    dense = query.dim() == 4 and key.size(-1) == value.size(-1) == head_dim
    if dense and query.dtype in HALF and attn_mask is None and head_dim <= 256:  # flash takes GQA as it is
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        hold_during_backward(out, (query, key, value), flash_backward_scratch(query))
        return out
    if dense and not enable_gqa and head_dim % (8 if query.dtype in HALF else 4) == 0:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, -math.inf)
        needs_lse = any(t.requires_grad for t in (query, key, value))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, needs_lse, dropout_p, is_causal, scale=scale)[0]
        hold_during_backward(out, (query, key, value), efficient_backward_scratch(query))
        return out
    # the math path, as CUDA runs it (the CPU dispatcher would pick its own flash kernel)
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def _autocast_dtype() -> torch.dtype | None:
    # "cuda" too, so the same routing serves fake CUDA tensors (where the GPU's choice is unknown)
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    return None


def _dropout_as_on_cuda(input, p=0.5, training=True, inplace=False):
    # CUDA's fused kernel keeps a bool mask for backward; CPU keeps one in the input's dtype
    if training and 0 < p < 1 and not inplace and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return _DROPOUT(input, p, training, inplace)


# --- the caching allocator --------------------------------------------------------------------

MIN_BLOCK = 512  # every request is rounded up to a multiple of this
SMALL_SIZE = 1 << 20  # requests up to 1 MiB come from the small pool
SMALL_SEGMENT = 2 << 20  # the small pool grows in 2 MiB segments
MIN_LARGE_ALLOC = 10 << 20  # large requests below 10 MiB get a 20 MiB segment ...
LARGE_SEGMENT = 20 << 20
ROUND_LARGE = 2 << 20  # ... larger ones a segment rounded up to 2 MiB


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int, prev=None, next=None):
        self.segment, self.offset, self.size, self.free, self.prev, self.next = segment, offset, size, True, prev, next


class CachingAllocatorModel:
    """Reserved bytes of CUDA's caching allocator for a sequence of allocations and frees.

    The model (c10/cuda/CUDACachingAllocator.cpp, default settings, one stream):
    - a request is rounded up to a multiple of 512 B;
    - requests up to 1 MiB are served from a small pool of 2 MiB segments, larger ones from a
      large pool whose new segments are 20 MiB for requests under 10 MiB and the request rounded
      up to 2 MiB otherwise;
    - a request takes the smallest free block of its pool that fits (best fit), split when the
      rest is at least 512 B (small pool) or more than 1 MiB (large pool); only when none fits is a
      new segment reserved (cudaMalloc);
    - a freed block merges with free neighbours of its segment; segments are never returned (no
      empty_cache), so reserved bytes only grow, and their maximum is the reserved peak;
    - with `expandable=True` (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) each pool is one
      segment that maps more pages at its end (2 MiB small, 20 MiB large) when nothing fits,
      growing its free tail block rather than reserving a new segment;
    - with a `capacity` (the card less its CUDA context, or a cap's memory fraction): a new segment
      that would pass it first makes the allocator release every cached segment no block of which is
      in use (expandable: unmap the whole pages of each pool's free tail) and retry, as `release_cached_blocks` does
      after a failed cudaMalloc; `releases` counts those, `over_capacity` says a retry still failed
      (the step runs out of memory). Without a capacity, segments are never returned and the reserved
      bytes only grow: on a card too small for them the allocator would have released and retried.
    Not modelled: max_split_size / garbage-collection settings.
    """

    def __init__(self, expandable: bool = False, capacity: int | None = None):
        self.expandable = expandable
        self.capacity = capacity
        self.releases = 0
        self.over_capacity = False
        self.peak_reserved = 0
        self._grown: dict[bool, int] = {}  # expandable: small pool? -> its one segment
        self._last_block: dict[int, _Block] = {}  # expandable segment -> its block at the highest offset
        self._mapped: dict[int, int] = {}  # expandable segment -> bytes mapped
        self.reserved = 0
        self.allocated = 0
        self.peak_allocated = 0
        # small pool? -> its free blocks as (size, segment, offset, block), sorted: the first three tell any two apart
        self._free: dict[bool, list[tuple]] = {True: [], False: []}
        self._live: dict[int, _Block] = {}  # key -> its block
        self._stacked: dict[int, list[_Block]] = {}  # key -> its earlier blocks still live (a key reused while live)
        self._segment_small: list[bool] = []  # per segment: in the small pool?

    def alloc(self, key: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        block = self._take(small, size) or self._new_segment(small, size)
        block.free = False
        held = self._live.get(key)
        if held is not None:
            self._stacked.setdefault(key, []).append(held)
        self._live[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def free(self, key: int) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        stacked = self._stacked.get(key)
        if stacked:  # the key's block before this one is live again (the last made is the first let go)
            self._live[key] = stacked.pop()
            if not stacked:
                del self._stacked[key]
        self.allocated -= block.size
        small = self._segment_small[block.segment]
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._unlist(small, neighbour)
                block = self._merge(block, neighbour)
        self._list(small, block)

    def _take(self, small: bool, size: int) -> _Block | None:
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size,))
        if at == len(pool):
            return None
        block = pool.pop(at)[3]
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            if self._last_block.get(block.segment) is block:
                self._last_block[block.segment] = tail
            block.next, block.size = tail, size
            self._list(small, tail)
        return block

    def _new_segment(self, small: bool, size: int) -> _Block:
        if self.expandable:
            return self._expand(small, size)
        if small:
            segment_size = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            segment_size = LARGE_SEGMENT
        else:
            segment_size = -(-size // ROUND_LARGE) * ROUND_LARGE
        self._make_room(segment_size)
        self._segment_small.append(small)
        self._grow(segment_size)
        block = _Block(len(self._segment_small) - 1, 0, segment_size)
        self._list(small, block)
        return self._take(small, size)

    def _expand(self, small: bool, size: int) -> _Block:
        """Expandable segments: map pages at the pool segment's end, enough for `size` with its free tail."""
        if small not in self._grown:
            self._grown[small] = len(self._segment_small)
            self._segment_small.append(small)
            self._mapped[self._grown[small]] = 0
        segment = self._grown[small]
        tail = self._last_block.get(segment)
        has_free_tail = tail is not None and tail.free
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        grow = -(-(size - (tail.size if has_free_tail else 0)) // page) * page
        if self.capacity is not None and self.reserved + grow > self.capacity:
            self._make_room(grow, keep=tail if has_free_tail else None)
            tail = self._last_block.get(segment)
            has_free_tail = tail is not None and tail.free
            grow = -(-(size - (tail.size if has_free_tail else 0)) // page) * page
        self._grow(grow)
        if has_free_tail:
            self._unlist(small, tail)
            tail.size += grow
            block = tail
        else:
            block = _Block(segment, self._mapped[segment], grow, prev=tail)
            if tail is not None:
                tail.next = block
            self._last_block[segment] = block
        self._mapped[segment] += grow
        self._list(small, block)
        return self._take(small, size)

    def _grow(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _make_room(self, nbytes: int, keep: _Block | None = None) -> None:
        """Past the capacity: release what no live block uses, then see whether `nbytes` more fits."""
        if self.capacity is None or self.reserved + nbytes <= self.capacity:
            return
        self.releases += 1
        for small in (True, False):
            for *_, block in list(self._free[small]):
                if block is keep:
                    continue
                if self.expandable and block.next is None:  # a pool's free tail: its whole pages unmapped
                    self._unmap_tail(small, block)
                elif not self.expandable and block.prev is None and block.next is None:  # a whole segment
                    self._unlist(small, block)
                    self.reserved -= block.size
        self.over_capacity |= self.reserved + nbytes > self.capacity

    def _unmap_tail(self, small: bool, block: _Block) -> None:
        """Unmap the pages of a pool's free tail that no live block touches, as ExpandableSegment::unmap
        does: a page the tail shares with a live block stays mapped (a seeded run found the whole tail
        unmapped, so the next request mapped a fresh page and the reserve passed the unlimited one)."""
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        unmapped = self._mapped[block.segment] - -(-block.offset // page) * page
        if unmapped <= 0:
            return
        self._unlist(small, block)
        self._mapped[block.segment] -= unmapped
        self.reserved -= unmapped
        if unmapped < block.size:
            block.size -= unmapped
            self._list(small, block)
            return
        self._last_block[block.segment] = block.prev
        if block.prev is not None:
            block.prev.next = None

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour.offset < block.offset else (block, neighbour)
        if self._last_block.get(second.segment) is second:
            self._last_block[second.segment] = first
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.free = True
        return first

    def _list(self, small: bool, block: _Block) -> None:
        block.free = True
        bisect.insort(self._free[small], (block.size, block.segment, block.offset, block))

    def _unlist(self, small: bool, block: _Block) -> None:
        pool = self._free[small]
        del pool[bisect.bisect_left(pool, (block.size, block.segment, block.offset))]  # shorter: before its entry


def replay(events, device: torch.device, baseline: int, repeats: int = 2, kept: tuple[int, ...] = (),
           expandable: bool = False, capacity: int | None = None) -> CachingAllocatorModel:
    """Run `events[:baseline]` once (what exists before the step), then allocations that stay from the
    first step on (`kept`: cuBLAS workspaces), then the step's events `repeats` times (the second
    step already finds the first step's cached segments)."""
    model = CachingAllocatorModel(expandable, capacity)
    steps = [e for e in events[baseline:] if e[2] == device]
    workspaces = [(-1 - i, nbytes, device) for i, nbytes in enumerate(kept)]  # keys no tensor has
    alloc, free = model.alloc, model.free
    for key, nbytes, _device in [e for e in events[:baseline] if e[2] == device] + workspaces + steps * repeats:
        if nbytes > 0:
            alloc(key, nbytes)
        else:
            free(key)
    return model


def replay_within(events, device: torch.device, baseline: int, capacity: int | None,
                  **settings) -> tuple[CachingAllocatorModel, str]:
    """The allocator on a card whose allocator may hold `capacity` bytes (None: no limit), and a note when
    that limit shaped the result: a step whose cache outgrows the card releases it and retries (so what
    fits after a release is what it reserves), and a step that does not fit even then is reported with
    its unlimited reserve, which a cap check rejects."""
    unlimited = replay(events, device, baseline, **settings)
    if capacity is None or unlimited.peak_reserved <= capacity:
        return unlimited, ""
    limited = replay(events, device, baseline, capacity=capacity, **settings)
    if limited.over_capacity:
        return unlimited, (f"needs more than the {capacity / 2**30:.1f} GiB the card leaves the allocator, even after "
                           "releasing every cached segment: the step runs out of memory there")
    return limited, (f"reaches the {capacity / 2**30:.1f} GiB the card leaves the allocator, which then releases its "
                     f"cached segments and retries ({limited.releases} times in two steps; each release synchronises "
                     f"the device) and fits; without that limit it would reserve {unlimited.peak_reserved / 2**30:.1f} "
                     "GiB")
