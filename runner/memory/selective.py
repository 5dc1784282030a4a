"""Selective checkpointing that is exact: cache an op's output only where the block leaves it alone.

torch's selective checkpointing (SAC) keeps the outputs of chosen ops from the forward and hands
them back when the backward recomputes the block. A cached output that the block then changes in
place comes back changed: torch notices through the tensor's version counter and raises ("Tensor
cached during selective activation checkpoint has been mutated": EfficientNet's in-place SiLU after
a convolution), but not through aliases that share no version counter. nn.GRU's and nn.RNN's CPU
cells split their `addmm` outputs with `unsafe_split` and add into the pieces in place, so the
recompute read the gates after the forward had written them: silently wrong gradients.

So each block learns, before its first forward with a new input signature (shapes, dtypes, autocast),
which calls of its save-ops are safe to cache: it runs the forward once under a plain checkpoint
(grad mode, so the same ops run; nothing kept; RNG and buffers put back) while watching every op.
A save-op call is cached only when its output is fresh memory (not a view), it draws no random
numbers, no later op of the block writes its storage (by any alias) and it is not the block's output
(which code after the block may change). Everything else is recomputed, as under policy full.
The look-ahead forward runs the block's Python once more per new signature, as any recompute does:
state a block keeps in plain attributes (a call counter) sees it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .torch_features import checkpoint_options, storage_key

log = logging.getLogger(__name__)

OpCall = tuple[object, int]  # (the aten overload, its occurrence in one forward of the block)
_MOST_SIGNATURES = 64  # input signatures remembered per block; more (every length of varying text) start over
_learning = threading.local()


def learning() -> bool:
    """True while a block runs its one-off learning forward (module docstring): a step-time model
    counts those ops once, for the first step, not in every step."""
    return getattr(_learning, "depth", 0) > 0


def op_name(func) -> str:
    return getattr(getattr(func, "_overloadpacket", func), "__name__", "")  # aten.mm.default -> "mm"


def cacheable(func, args, kwargs, save_ops: frozenset[str]) -> bool:
    """A call whose output SAC may keep: a save-op that returns new memory and draws no random numbers."""
    schema = getattr(func, "_schema", None)
    if op_name(func) not in save_ops or schema is None:
        return False
    if any(argument.alias_info is not None for argument in (*schema.arguments, *schema.returns)):
        return False  # an in-place or out= variant, or a view: its output is someone else's memory
    return not _draws_random(func, args, kwargs)


def _draws_random(func, args, kwargs) -> bool:
    """True for a call that consumes the RNG (attention with dropout_p > 0).

    Such a call must be recomputed, not cached: the recompute replays the RNG from the block's
    start, and skipping one draw would shift the dropout masks of every later op in the block.
    """
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    names = [argument.name for argument in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout_p = args[position] if position < len(args) else kwargs.get("dropout_p", 0.0)
    return dropout_p != 0


# the ops a stride over products counts, each on its own: a block's 1st, 3rd, ... mm, and its 1st, 3rd, ... convolution
PRODUCT_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution"})


def kept_product(call: OpCall, product_stride: int) -> bool:
    """Whether a cacheable call stays cached under a stride over products (memory.checkpointing.
    products_kept_every): a product op's call is kept when it is that op's first in the block, its
    (1 + stride)-th, ...; every other op is kept as before."""
    func, occurrence = call
    return op_name(func) not in PRODUCT_OPS or occurrence % product_stride == 0


def static_policy(save_ops: frozenset[str], product_stride: int = 1) -> _CallPolicy:
    """The policy of one checkpointed forward under torch.compile, which functionalises the graph (no
    in-place writes to learn): every cacheable call, matrix products at the stride."""
    return _CallPolicy(lambda call, args, kwargs: cacheable(call[0], args, kwargs, save_ops)
                       and kept_product(call, product_stride))


class SelectiveBlock:
    """One block's selective checkpointing: the op calls it caches, learnt per input signature."""

    def __init__(self, save_ops: frozenset[str], name: str, keep_state: Callable[[], contextlib.AbstractContextManager] | None = None,
                 product_stride: int = 1):
        self.save_ops, self.name, self.product_stride = save_ops, name, product_stride
        self.keep_state = keep_state  # makes a context that puts the block's buffers back after the learning forward
        self.cached_by_signature: dict[tuple, frozenset[OpCall]] = {}
        self.cached: frozenset[OpCall] = frozenset()
        self.reported: set[str] = set()

    def prepare(self, forward, args: tuple, kwargs: dict) -> None:
        """Choose what the coming forward caches, learning it first for an unseen input signature."""
        signature = _signature(args, kwargs)
        if signature not in self.cached_by_signature:
            if len(self.cached_by_signature) >= _MOST_SIGNATURES:
                self.cached_by_signature.clear()
            self.cached_by_signature[signature] = self._learn(forward, args, kwargs)
        self.cached = self.cached_by_signature[signature]

    def context_fn(self):
        cached = self.cached
        forward, recompute = create_selective_checkpoint_contexts(_CallPolicy(lambda call, *_: call in cached))
        # checkpoint(respect_saved_tensors_hooks=True) sets this on SAC's own mode only, and ckrun nests that
        # mode in its buffer replay: set here, so what SAC caches passes through offload's and compression's
        # hooks as checkpoint_options() asks (torch >= 2.14 has the attribute; older torch always bypasses)
        if checkpoint_options() and hasattr(forward, "respect_saved_tensors_hooks"):
            forward.respect_saved_tensors_hooks = True
        return forward, recompute

    def _learn(self, forward, args: tuple, kwargs: dict) -> frozenset[OpCall]:
        watch = _OpWatch(self.save_ops)
        devices = sorted({t.device.index or 0 for t in tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        _learning.depth = getattr(_learning, "depth", 0) + 1
        try:
            with torch.random.fork_rng(devices=devices), (self.keep_state or contextlib.nullcontext)(), _no_cast_cache():
                output = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                                    context_fn=lambda: (watch, contextlib.nullcontext()), **checkpoint_options(),
                                    **kwargs)
                watch.returned(output)
                del output
        finally:
            _learning.depth -= 1
        self._report(watch.refused)
        return frozenset(call for call in watch.safe() if kept_product(call, self.product_stride))

    def _report(self, refused: dict[str, str]) -> None:
        new = {op: why for op, why in refused.items() if op not in self.reported}
        if new:
            self.reported.update(new)
            log.info("memory.checkpointing: selective: in %s, %s; recomputed, not cached (caching would hand "
                     "the backward a changed value)", self.name, "; ".join(f"{op} {why}" for op, why in new.items()))


class _CallPolicy:
    """SAC's policy for one checkpointed forward: counts each op's calls, as SAC keys its cache, and keeps
    the calls `keeps(call, args, kwargs)` names.

    torch >= 2.14 asks it once per op in the forward; torch 2.11 asks before each op in the forward
    and again in the recompute (`ctx.is_recompute`), where the answers must match: one count per phase."""

    def __init__(self, keeps: Callable[[OpCall, tuple, dict], bool]):
        self.keeps = keeps
        self.counts = {False: Counter(), True: Counter()}

    def __call__(self, ctx, func, *args, **kwargs):
        counts = self.counts[bool(getattr(ctx, "is_recompute", False))]
        call = (func, counts[func])
        counts[func] += 1
        return CheckpointPolicy.MUST_SAVE if self.keeps(call, args, kwargs) else CheckpointPolicy.PREFER_RECOMPUTE


class _OpWatch(TorchDispatchMode):
    """Watches one forward of a block: the cacheable calls, and which of their outputs are written later."""

    def __init__(self, save_ops: frozenset[str]):
        super().__init__()
        self.save_ops = save_ops
        self.counts: Counter = Counter()
        self.candidates: dict[int, tuple[OpCall, torch.Tensor]] = {}  # storage -> call (tensor held: no reuse)
        self.unsafe: set[OpCall] = set()
        self.refused: dict[str, str] = {}  # op name -> why, for the log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._writes(func, args, kwargs)
        call = (func, self.counts[func])
        self.counts[func] += 1
        out = func(*args, **kwargs)
        if cacheable(func, args, kwargs, self.save_ops):
            for tensor in _tensors(out):
                self.candidates[_storage(tensor)] = (call, tensor)
        return out

    def _writes(self, func, args, kwargs) -> None:
        schema = getattr(func, "_schema", None)
        for index, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
            for tensor in _tensors(value):
                self._refuse(_storage(tensor), f"is changed in place by aten.{op_name(func)}")

    def returned(self, output) -> None:
        for tensor in _tensors(output):
            self._refuse(_storage(tensor), "is the block's output")

    def _refuse(self, storage: int | None, why: str) -> None:
        hit = self.candidates.get(storage)
        if hit is not None and hit[0] not in self.unsafe:
            self.unsafe.add(hit[0])
            self.refused.setdefault(f"aten.{op_name(hit[0][0])}", why)

    def safe(self) -> frozenset[OpCall]:
        return frozenset(call for call, _ in self.candidates.values() if call not in self.unsafe)


@contextlib.contextmanager
def _no_cast_cache():
    """Autocast off its weight-cast cache: casts the look-ahead cached would be missing from the real
    forward, whose recompute then casts again, an op SAC never saw in the forward."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _tensors(value) -> list[torch.Tensor]:
    return [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return storage_key(tensor)
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return None


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What decides which ops a block runs: its inputs' shapes, strides and dtypes, plain arguments, autocast.
    Strides too: nn.GRU projects a contiguous input with addmm and a strided one with clone, mm and add, so
    a block called again on its own output (shared blocks) runs other ops than it learnt on."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), _strides(x), x.dtype, x.device.type, x.requires_grad)
        return x if isinstance(x, (bool, int, float, str, type(None))) else type(x).__name__
    autocast = tuple(torch.is_autocast_enabled(device) for device in ("cpu", "cuda"))
    return (tuple(leaf(x) for x in tree_leaves((args, kwargs))), tuple(sorted(kwargs)), autocast, torch.is_grad_enabled())


def _strides(tensor: torch.Tensor) -> tuple | None:
    try:
        return tuple(tensor.stride())
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without strides
        return None
