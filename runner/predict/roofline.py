"""The time of each op of a fake training step on a named device: a roofline, op by op.

`OpClock` is a dispatch mode stacked beside the memory tracker in the estimator's one fake step.
Each aten op costs the longest of
- its FLOPs at the device's matmul rate for the op's dtype (torch's own FLOP formulas,
  `torch.utils.flop_counter.flop_registry`: products, convolutions, attention);
- the bytes it reads and writes at the device's memory bandwidth (`get_num_bytes` of torch's
  runtime estimation: broadcast dimensions read once);
- the device's per-op floor (eager dispatch and kernel launch), which small ops never beat.
Views and tensor creation cost nothing. Copies between the device and the host (activation
offload: the estimate's host is the meta device) go to a copy stream at the host link's rate, and
collectives (FSDP's all-gathers and reduce-scatters on the fake process group) to a comm stream at
the peer link's rate (ring: (N-1)/N of the bytes). `step_time.assemble` then overlaps those
streams with compute.

This is torch's own roofline (`torch.distributed._tools.runtime_estimator.RuntimeEstimator`'s
"operator-level-cost-model") rebuilt from the same parts, because RuntimeEstimator itself cannot
serve here: it asserts that an accelerator is present even when given `gpu_type` (torch 2.15),
has no `gpu_type` at all on torch 2.11, prints to stdout on exit, and its `flops_to_ns` counts
half the FLOPs against a FLOP/s peak, which would put MFU above 100 %.

Every op is attributed to a phase (forward, backward, recompute, update: what runs after a
micro-batch's backward, which after the last one is clipping and the optimizer), to a micro-batch
(the first, or the last seen: "repeat") and, inside a repeated block, to that block, so the step
can be extrapolated from its first two micro-batches and offload overlapped per block.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .hardware import DeviceFacts

log = logging.getLogger(__name__)

_COMPUTE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# no kernel: allocation, aliasing (views whose schema does not say so), metadata
_FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                   "detach", "alias", "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "_reshape_alias"})
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_PRICED = frozenset({"aten", "fsdp", *_COLLECTIVE_NAMESPACES})  # fsdp: FSDP2's copy-in/out kernels
PHASES = ("forward", "backward", "recompute", "update")


@functools.cache
def _num_bytes():
    try:  # torch's own: a broadcast (stride 0) dimension is read once
        from torch.utils._runtime_estimation import get_num_bytes
        return get_num_bytes
    except ImportError:
        return lambda t: t.numel() * t.element_size()


@dataclass
class Ledger:
    """Seconds and FLOPs by (micro-batch kind, phase), per-block figures of the first micro-batch,
    and the bytes put on the copy and comm streams."""

    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    flops: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    ops: int = 0
    block_forward_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    block_recompute_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    block_to_host: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    to_host: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes copied device -> host per micro-batch kind (offload stashes)."""
    comm_s: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    outside_blocks_forward_s: float = 0.0
    """Forward seconds of the first micro-batch after its last block (head, loss)."""

    def forget_repeat(self) -> None:
        """A later micro-batch starts: "repeat" holds only the last one (the step's update runs after it)."""
        for table in (self.seconds, self.flops, self.comm_s):
            for key in [k for k in table if k[0] == "repeat"]:
                del table[key]
        self.to_host.pop("repeat", None)


class OpClock(TorchDispatchMode):
    """Prices every op of the region on `facts` and files it in a `Ledger` (module docstring).

    The estimator tells it where the step is: `start_micro_batch()` as the model's forward
    begins, and `in_block(index)` around each repeated block's forward (installed inside any
    checkpoint, so a recompute in backward is seen as one)."""

    def __init__(self, facts: DeviceFacts, world_size: int = 1, tf32: bool = False,
                 moded_blocks: frozenset[int] = frozenset()):
        super().__init__()
        self.facts, self.world_size, self.tf32 = facts, world_size, tf32
        self.moded_blocks = moded_blocks  # blocks whose forward and recompute run under a Python mode
        self.ledger = Ledger()
        self.micro = 0
        self.block: int | None = None
        self.backward_seen = False  # since this micro-batch's forward began
        self.last_block_seen = -1

    # --- where the step is ------------------------------------------------------------------------

    def start_micro_batch(self) -> None:
        self.micro += 1
        self.backward_seen = False
        if self.micro > 2:
            self.ledger.forget_repeat()

    def in_block(self, forward, index: int):
        """A block's forward that tells the clock it runs (wrap it inside the checkpoint)."""
        @functools.wraps(forward)
        def run(*args, **kwargs):
            outer, self.block = self.block, index
            try:
                return forward(*args, **kwargs)
            finally:
                self.block = outer
                self.last_block_seen = max(self.last_block_seen, index)
        return run

    def _where(self) -> tuple[str, str]:
        kind = "first" if self.micro <= 1 else "repeat"
        if torch._C._current_graph_task_id() != -1:
            self.backward_seen = True
            return kind, "recompute" if self.block is not None else "backward"
        return (kind, "update") if self.backward_seen else (kind, "forward")

    # --- pricing ----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._file(func, args, kwargs, out)
        except Exception as err:  # noqa: BLE001 - pricing must never break the memory estimate
            log.debug("time model: %s not priced: %s", func, err)
        return out

    def _file(self, func, args, kwargs, out) -> None:
        kind, phase = self._where()
        name = func._overloadpacket.__name__
        if func.namespace not in _PRICED or func.is_view or name in _FREE:
            return  # prim::device and the like read metadata; profiler ops mark ranges
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.ledger.comm_s[(kind, phase)] += self._collective_s(name, args, out)
            return
        moved = _host_copy_bytes(args, out)
        if moved:
            if moved > 0:
                self.ledger.to_host[kind] += moved
                if kind == "first" and self.block is not None:
                    self.ledger.block_to_host[self.block] += moved
            return
        flops, seconds = self._cost(func, args, kwargs, out)
        if self.block in self.moded_blocks and phase in ("forward", "recompute"):
            seconds = max(seconds, (self.facts.launch_us + self.facts.python_mode_us) * 1e-6)
        self.ledger.seconds[(kind, phase)] += seconds
        self.ledger.flops[(kind, phase)] += flops
        self.ledger.ops += 1
        self._file_block(kind, phase, seconds)

    def _file_block(self, kind: str, phase: str, seconds: float) -> None:
        if kind != "first":
            return
        if phase == "forward" and self.block is not None:
            self.ledger.block_forward_s[self.block] += seconds
        elif phase == "recompute":
            self.ledger.block_recompute_s[self.block] += seconds
        elif phase == "forward" and self.last_block_seen >= 0:
            self.ledger.outside_blocks_forward_s += seconds

    def _cost(self, func, args, kwargs, out) -> tuple[float, float]:
        """(FLOPs, seconds) of one op: the slowest of compute, memory traffic and the launch floor."""
        flat_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        flat_out = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(map(_num_bytes(), flat_in)) + sum(map(_num_bytes(), flat_out))
        nbytes += _mutated_bytes(func, args, flat_out)
        flops, compute_s = 0.0, 0.0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            flops = float(counter(*args, **kwargs, out_val=out))
            compute_s = flops / self.facts.matmul_flops(self._compute_dtype(flat_out or flat_in))
        memory_s = nbytes / self.facts.bandwidth()
        return flops, max(compute_s, memory_s, self.facts.launch_us * 1e-6)

    def _compute_dtype(self, tensors: list[torch.Tensor]) -> str:
        dtype = next((_COMPUTE_DTYPES[t.dtype] for t in tensors if t.dtype in _COMPUTE_DTYPES), "fp32")
        return "tf32" if dtype == "fp32" and self.tf32 else dtype

    def _collective_s(self, name: str, args, out) -> float:
        """Ring collectives move (N-1)/N of the gathered bytes each way; an all-reduce twice that."""
        if self.world_size <= 1 or not self.facts.peer_gbs:
            return 0.0
        tensors = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        factor = 2.0 if "all_reduce" in name or "allreduce" in name else 1.0
        return factor * nbytes * (self.world_size - 1) / self.world_size / (self.facts.peer_gbs * 1e9)


def _host_copy_bytes(args, out) -> int:
    """Bytes of a copy between the device and the (meta) host: positive to the host, negative back, else 0."""
    sources = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    targets = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if len(targets) != 1 or not sources:
        return 0
    target, source = targets[0], sources[-1]
    if target.device.type == source.device.type:
        return 0
    nbytes = target.numel() * target.element_size()
    return nbytes if target.device.type == "meta" else -nbytes


def _mutated_bytes(func, args, outputs: list[torch.Tensor]) -> int:
    """Writes an op makes into its arguments without returning them (fused optimizers, foreach ops)."""
    returned = {id(t) for t in outputs}
    written = 0
    for argument, value in zip(func._schema.arguments, args, strict=False):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in returned:
                written += _num_bytes()(tensor)
    return written
