"""The work of each op of a fake training step, and its time on a named device: a roofline.

`OpClock` is a dispatch mode stacked beside the memory tracker in the estimator's one fake step.
It records each aten op's work (`StepWork`, measured by `op_work`): its class of kernel (product,
convolution, fused attention, the optimizer's step, or memory-bound), its FLOPs (torch's own
formulas, causal attention counted as the share of the score matrix it computes), the bytes it
reads and writes (`get_num_bytes` of torch's runtime estimation: broadcast dimensions read once),
its compute dtype and, for a product, its output's shape. `price(work, facts)` then gives each op
the longest of
- its FLOPs at the share of the device's matrix peak its class reaches in that dtype (fp32
  products and convolutions at the TF32 rate where the recipe's `tf32` lets them; attention by
  kernel family, forward or backward, causal or not; the memory-efficient kernel in fp32 at its
  half-precision rate over its fp32 slowdown, its products being CUTLASS's 3xTF32), a product
  further slowed by wave quantisation (`DeviceFacts.wave_share`) and given its fixed fill time,
- its bytes at the share of the device's bandwidth its class reaches (normalisation kernels
  their own, forward and backward),
- the device's per-op floor (eager dispatch and kernel launch, plus the Python dispatch mode's
  cost where selective checkpointing's cache handles the op), which small ops never beat.
The figures come from the calibration table (runner/predict/efficiency.py). Views and tensor
creation cost nothing. Copies between the device and the host (activation offload: the estimate's
host is the meta device) go to a copy stream at the host link's rate, and collectives (FSDP's
all-gathers and reduce-scatters, tensor parallelism's redistributes, on the fake process group) to a
comm stream at the rate of their group's ring (`DeviceFacts.ring_rate`: the peer link within a host,
the hosts' network rails across them; (N-1)/N of the bytes), in program order beside the compute
(overlap.py says what each kind of collective hides behind). MFU counts each op's FLOPs against the
peak of the rate it was priced at (`Ledger.peak_s`), so it never passes 100 %. The work does not
depend on the device, so one fake step can be priced on many.

This is torch's own roofline (`torch.distributed._tools.runtime_estimator.RuntimeEstimator`'s
"operator-level-cost-model") rebuilt from the same parts, because RuntimeEstimator itself cannot
serve here: it asserts that an accelerator is present even when given `gpu_type` (torch 2.15),
has no `gpu_type` at all on torch 2.11, prints to stdout on exit, and its `flops_to_ns` counts
half the FLOPs against a FLOP/s peak, which would put MFU above 100 %.

Every op is attributed to a phase (forward, backward, recompute, update: what runs after a
micro-batch's backward, which after the last one is clipping and the optimizer; learn: selective
checkpointing's one-off forward that learns which ops a block may cache, which only the first step
of a run pays), to a micro-batch (the first, or the last seen: "repeat") and, inside a repeated
block, to that block, so the step can be extrapolated from its first two micro-batches and offload
overlapped per block.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory.selective import learning
from .device_facts import DeviceFacts
from .device_query import DEVICE_QUERY, fake_device
from .op_work import is_causal, layout_bytes, measure, op_class
from .overlap import Collective, exposed

log = logging.getLogger(__name__)

# no kernel: allocation, aliasing (views whose schema does not say so), metadata
_FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                   "detach", "alias", "_local_scalar_dense", "set_", "resize_", "_unsafe_view", "_reshape_alias"})
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_BLOCKING_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional"})  # DTensor's: eager waits on them
_NOT_COLLECTIVES = frozenset({"wait_tensor", "barrier", "monitored_barrier_"})  # waits, no bytes of their own
_PRICED = frozenset({"aten", "fsdp", *_COLLECTIVE_NAMESPACES})  # fsdp: FSDP2's copy-in/out kernels
AFTER_BLOCKS = -1  # the block field of a forward op after the last block (the head, the loss)
# memory.optimizer_offload's host step: torch's fused CPU AdamW, memory-bound (each float32 element reads
# parameter, gradient and both moments and writes three: 28 bytes). bench/host_adamw.py measured 313 M
# parameters/s on one thread of this 2-core CPU machine (2026-11-27, torch 2.14.1); a GPU machine's host
# is assumed to run it on 8 such cores at once (2.5 G parameters/s, 70 GB/s of DRAM traffic: what a
# two-socket server's memory gives one process's threads, short of its peak). A facts file's
# `host_adamw_per_s` replaces it with the rate measured on that host.
HOST_ADAMW_PER_CORE = 313e6
HOST_CORES = 8
HOST_ADAMW_PER_S = HOST_ADAMW_PER_CORE * HOST_CORES
STEP_PHASES = ("forward", "backward", "recompute")  # and "update"; "learn" runs in the first step only


@dataclass(frozen=True)
class OpWork:
    kind: str  # "first" or "repeat" (the last micro-batch seen)
    phase: str  # forward | backward | recompute | update | learn
    block: int | None  # the repeated block it ran in; AFTER_BLOCKS after them; None elsewhere
    flops: float
    dtype: str  # fp32 | bf16 | fp16: the rate its FLOPs run at
    nbytes: int
    moded: bool  # handled by a Python dispatch mode (selective checkpointing's cache)
    op_class: str = "memory"  # efficiency.OP_CLASSES
    family: str = ""  # an attention kernel's family (flash, efficient, cudnn)
    outputs: tuple[int, int, int] | None = None  # a product's (batch, rows, columns)
    layout_bytes: int = 0  # a channels-first convolution's transposes, paid on tensor cores (op_work)
    causal: bool = False  # an attention op under a causal mask
    backward_kernel: bool = False  # a kernel's own backward (attention's, a norm's): priced at its backward figures


@dataclass(frozen=True)
class CollectiveWork:
    """One collective of a fake step, device-independent (`price` gives it its seconds)."""

    kind: str  # "first" or "repeat"
    phase: str
    nbytes: float
    """What a ring moves for it before the (n-1)/n of its group: the gathered size, twice for an all-reduce."""
    ranks: tuple[int, ...]
    """The global ranks of its group (how many share a host decides its rate)."""
    position: int
    """Compute ops of its micro-batch (`kind`, update phase aside) recorded before it."""
    shape: str  # "gather" | "reduce" | "other" (overlap.Collective.kind)
    blocking: bool


@dataclass
class StepWork:
    """What a fake step's ops did, device-independent: price it with `price`."""

    ops: list[OpWork] = field(default_factory=list)
    to_host: list[tuple[str, int | None, int]] = field(default_factory=list)
    """(kind, block, bytes) of each device -> host copy (activation offload stashes)."""
    host_updates: list[tuple[str, str, int]] = field(default_factory=list)
    """(kind, phase, parameters) of each optimizer update that runs on the host (the estimate's host is
    the meta device): memory.optimizer_offload's step, priced at the host's AdamW rate."""
    gradients_to_host: list[tuple[str, int]] = field(default_factory=list)
    """(kind, bytes) of each gradient copied to the host inside the backward (an offloaded optimizer's, as the
    backward accumulates it): one way, behind the rest of the backward."""
    update_copies: list[tuple[str, int]] = field(default_factory=list)
    """(kind, bytes) of each copy between the device and the host after the backward (the offloaded
    optimizer's gradients out, its parameters back): nothing computes meanwhile, so each is exposed."""
    collectives: list[CollectiveWork] = field(default_factory=list)
    world_size: int = 1
    matmul_tf32: bool = False
    """fp32 products on TF32 tensor cores (torch's default: no; the recipe's `tf32: true`)."""
    conv_tf32: bool = True
    """fp32 convolutions on TF32 tensor cores (cuDNN's default in torch: yes; the recipe's `tf32: false`)."""

    def forget_repeat(self) -> None:
        """A later micro-batch starts: "repeat" holds only the last one (the step's update runs after it)."""
        self.ops = [op for op in self.ops if op.kind != "repeat"]
        self.to_host = [copy for copy in self.to_host if copy[0] != "repeat"]
        self.collectives = [c for c in self.collectives if c.kind != "repeat"]
        self.host_updates = [u for u in self.host_updates if u[0] != "repeat"]
        self.update_copies = [c for c in self.update_copies if c[0] != "repeat"]
        self.gradients_to_host = [c for c in self.gradients_to_host if c[0] != "repeat"]


@dataclass
class Ledger:
    """Seconds and FLOPs by (micro-batch kind, phase), per-block figures of the first micro-batch,
    and the bytes and seconds of the copy and comm streams: `StepWork` priced on one device."""

    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    flops: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    block_forward_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    block_recompute_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    block_to_host: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    to_host: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    gradients_to_host: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    comm_s: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    class_seconds: dict[str, dict[tuple[str, str], float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    """The `seconds` table of each class of kernel (efficiency.OP_CLASSES) alone."""
    outside_blocks_forward_s: float = 0.0
    """Forward seconds of the first micro-batch after its last block (head, loss)."""
    peak_s: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    """Each op's FLOPs at the datasheet peak of the rate it was priced at: what MFU and HFU divide."""
    comm_exposed: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Per micro-batch kind, the seconds its compute waits for its collectives (overlap.exposed), the
    update's aside."""


def price(work: StepWork, facts: DeviceFacts) -> Ledger:
    """The step's work on `facts`: each op the slowest of compute, memory traffic and its floor."""
    ledger = Ledger()
    seconds_of, peak_of = _op_pricer(work, facts)
    timeline: dict[str, list[float]] = defaultdict(list)  # each micro-batch kind's compute, update aside
    for op in work.ops:
        seconds = seconds_of(op)
        ledger.seconds[(op.kind, op.phase)] += seconds
        ledger.class_seconds[op.op_class][(op.kind, op.phase)] += seconds
        ledger.flops[(op.kind, op.phase)] += op.flops
        if op.flops:
            ledger.peak_s[(op.kind, op.phase)] += op.flops / peak_of(op)
        if op.phase != "update":
            timeline[op.kind].append(seconds)
        if op.kind == "first":
            _file_block(ledger, op, seconds)
    for kind, block, nbytes in work.to_host:
        ledger.to_host[kind] += nbytes
        if kind == "first" and block is not None and block >= 0:
            ledger.block_to_host[block] += nbytes
    for kind, nbytes in work.gradients_to_host:
        ledger.gradients_to_host[kind] += nbytes
    _price_host(work, facts, ledger)
    _price_collectives(work, facts, ledger, timeline)
    return ledger


def _price_collectives(work: StepWork, facts: DeviceFacts, ledger: Ledger, timeline: dict[str, list[float]]) -> None:
    """Each collective's seconds at its group's ring rate; per micro-batch kind, what compute does not hide."""
    if work.world_size < 2 or not facts.peer_gbs:
        return
    streams: dict[str, list[Collective]] = defaultdict(list)
    for c in work.collectives:
        n = len(c.ranks)
        rate = facts.ring_rate(n, _per_host(c.ranks, facts.gpus_per_host))
        seconds = c.nbytes * (n - 1) / n / rate if n > 1 and rate else 0.0
        ledger.comm_s[(c.kind, c.phase)] += seconds
        if c.phase != "update":
            streams[c.kind].append(Collective(c.position, seconds, c.shape, c.blocking))
    for kind, collectives in streams.items():
        ledger.comm_exposed[kind] = exposed(timeline.get(kind, []), collectives)


def _per_host(ranks: tuple[int, ...], gpus_per_host: int) -> int:
    """The most of a group's ranks one host holds (ranks are laid out host by host, as torchrun numbers them)."""
    hosts: dict[int, int] = defaultdict(int)
    for rank in ranks:
        hosts[rank // gpus_per_host] += 1
    return max(hosts.values(), default=1)


def _price_host(work: StepWork, facts: DeviceFacts, ledger: Ledger) -> None:
    """The host's optimizer step at its AdamW rate, and the copies after the backward at the host link's
    rate (none without it: a CPU's facts), each in its phase and in the classes `host_adamw`, `host_copies`."""
    rate = facts.host_adamw_per_s or HOST_ADAMW_PER_S
    for kind, phase, parameters in work.host_updates:
        _add(ledger, "host_adamw", (kind, phase), parameters / rate)
    if facts.host_gbs:
        for kind, nbytes in work.update_copies:
            _add(ledger, "host_copies", (kind, "update"), nbytes / (facts.host_gbs * 1e9))


def _add(ledger: Ledger, op_class: str, where: tuple[str, str], seconds: float) -> None:
    ledger.seconds[where] += seconds
    ledger.class_seconds[op_class][where] += seconds


def _op_pricer(work: StepWork, facts: DeviceFacts):
    """(seconds(op), peak(op)) on `facts`: the op's time, and the datasheet peak of the rate its FLOPs were
    priced at (for MFU); rates looked up once per (class, dtype, family, direction), not per op."""
    floor = facts.floor_seconds()
    moded_floor = floor + facts.python_mode_us * 1e-6
    tf32 = {"matmul": work.matmul_tf32, "conv": work.conv_tf32}
    ampere = facts.kind == "cuda" and (facts.capability or (0, 0)) >= (8, 0)

    @functools.cache
    def rates(kind: str, dtype: str, family: str, backward: bool, causal: bool) -> tuple[float, float, float]:
        """(FLOP/s, bytes/s, the peak FLOP/s the rate is a share of)."""
        traffic = facts.traffic_rate(kind, backward)
        if kind == "attention" and dtype == "fp32" and ampere:
            # the memory-efficient kernel, the one SDPA dispatches fp32 to (flash and cuDNN take half precision
            # only: sdp_utils.cpp), runs its products as CUTLASS's 3xTF32 on sm80+ (mem_eff_attention
            # gemm_kernel_utils.h: OpMultiplyAddFastF32): its half-precision rate over its measured fp32 slowdown,
            # against the 3xTF32 peak (a third of TF32's)
            slowdown = facts.efficiency.efficient_fp32_slowdown if facts.efficiency else 6.0
            own_peak = facts.peak_flops("tf32") / 3
            rate = facts.compute_rate(kind, "bf16", family, backward, causal) / slowdown
            return min(rate, own_peak), traffic, own_peak
        rate_dtype = "tf32" if dtype == "fp32" and tf32.get(kind) else dtype
        return (facts.compute_rate(kind, rate_dtype, family, backward, causal), traffic,
                facts.peak_flops(rate_dtype))

    def of(op: OpWork) -> tuple[float, float, float]:
        return rates(op.op_class, op.dtype, op.family, op.backward_kernel, op.causal)

    def seconds(op: OpWork) -> float:
        compute, traffic, _ = of(op)
        flops_s = 0.0
        if op.flops:
            flops_s = op.flops / (compute * facts.wave_share(op.outputs, op.flops))
            if op.op_class == "matmul":
                flops_s += facts.fill_seconds("tf32" if op.dtype == "fp32" and work.matmul_tf32 else op.dtype)
        tensor_cores = ampere and (op.dtype != "fp32" or tf32.get(op.op_class))
        nbytes = op.nbytes + (op.layout_bytes if tensor_cores else 0)
        return max(flops_s, nbytes / traffic, moded_floor if op.moded else floor)

    return seconds, lambda op: of(op)[2]


def _file_block(ledger: Ledger, op: OpWork, seconds: float) -> None:
    if op.phase == "forward" and op.block == AFTER_BLOCKS:
        ledger.outside_blocks_forward_s += seconds
    elif op.phase == "forward" and op.block is not None:
        ledger.block_forward_s[op.block] += seconds
    elif op.phase == "recompute" and op.block is not None:
        ledger.block_recompute_s[op.block] += seconds


class OpClock(TorchDispatchMode):
    """Records the work of every op of the region in a `StepWork` (module docstring).

    The estimator tells it where the step is: `start_micro_batch()` as the model's forward
    begins, and `in_block(index)` around each repeated block's forward (installed inside any
    checkpoint, so a recompute in backward is seen as one)."""

    def __init__(self, world_size: int = 1, tf32: bool | None = None, moded_blocks: frozenset[int] = frozenset()):
        """`tf32`: the recipe's key (None: torch's defaults, products in full fp32, convolutions in TF32)."""
        super().__init__()
        self.work = StepWork(world_size=world_size, matmul_tf32=bool(tf32), conv_tf32=tf32 is not False)
        self.moded_blocks = moded_blocks  # blocks whose forward and recompute run under a Python mode
        self.micro = 0
        self.positions: dict[str, int] = {"first": 0, "repeat": 0}  # compute ops a collective comes after
        self.block: int | None = None
        self.backward_seen = False  # since this micro-batch's forward began
        self.last_block_seen = -1

    # --- where the step is ------------------------------------------------------------------------

    def start_micro_batch(self) -> None:
        self.micro += 1
        self.backward_seen = False
        if self.micro > 2:
            self.work.forget_repeat()
            self.positions["repeat"] = 0

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
        if learning():
            return kind, "learn"
        if torch._C._current_graph_task_id() != -1:
            self.backward_seen = True
            return kind, "recompute" if self.block is not None else "backward"
        return (kind, "update") if self.backward_seen else (kind, "forward")

    def host_update(self, parameters: int) -> None:
        """The step's optimizer updated `parameters` elements on the host (memory.optimizer_offload)."""
        kind = "first" if self.micro <= 1 else "repeat"
        self.work.host_updates.append((kind, "update", parameters))

    def _block(self, phase: str) -> int | None:
        if self.block is None and phase == "forward" and self.last_block_seen >= 0:
            return AFTER_BLOCKS
        return self.block

    # --- recording --------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY and (device := fake_device(args)) is not None:
            return device  # not priced, and nothing below acts on it (device_query.py)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception as err:  # noqa: BLE001 - timing must never break the memory estimate
            log.debug("time model: %s not counted: %s", func, err)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        if func.namespace not in _PRICED or func.is_view or name in _FREE:
            return  # prim::device and the like read metadata; profiler ops mark ranges
        kind, phase = self._where()
        if func.namespace in _COLLECTIVE_NAMESPACES:
            if name not in _NOT_COLLECTIVES:
                self.work.collectives.append(CollectiveWork(
                    kind, phase, _ring_bytes(name, args, out), _group_ranks(args, self.work.world_size),
                    self.positions[kind], _shape(name), func.namespace in _BLOCKING_NAMESPACES))
            return
        moved = _host_copy_bytes(args, out)
        if moved and phase == "update":  # the offloaded optimizer's copies: each way, nothing to hide behind
            self.work.update_copies.append((kind, abs(moved)))
            return
        if moved > 0 and phase in ("backward", "recompute"):  # a gradient to an offloaded optimizer (activations go forward)
            self.work.gradients_to_host.append((kind, moved))
            return
        if moved:
            if moved > 0:  # what comes back in backward is what went out: priced both ways from this
                self.work.to_host.append((kind, self._block(phase), moved))
            return
        if _on_host(args, out):
            return  # the host's update, priced whole by `host_update` (on meta tensors torch runs AdamW op by op)
        flops, dtype, nbytes, outputs = measure(func, args, kwargs, out)
        moded = self.block in self.moded_blocks and phase in ("forward", "recompute", "learn")
        kind_of_kernel, family = op_class(name, phase)
        causal = kind_of_kernel == "attention" and is_causal(func, args, kwargs)
        self.work.ops.append(OpWork(kind, phase, self._block(phase), flops, dtype, nbytes, moded, kind_of_kernel,
                                    family, outputs, layout_bytes(func, args, out), causal, name.endswith("_backward")))
        if phase != "update":
            self.positions[kind] += 1


def _ring_bytes(name: str, args, out) -> float:
    """What a ring collective moves before its (n-1)/n (priced in `price`): the gathered or reduced bytes, twice
    for an all-reduce (a reduce-scatter, then an all-gather)."""
    tensors = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
    nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
    return (2.0 if "all_reduce" in name or "allreduce" in name else 1.0) * nbytes


def _shape(name: str) -> str:
    """What the comm stream does with it (overlap.py): an all-gather is prefetched, a reduction waited for late."""
    if "gather" in name:
        return "gather"
    return "reduce" if "reduce" in name else "other"


@functools.cache
def _world(world_size: int) -> tuple[int, ...]:
    return tuple(range(world_size))


def _group_ranks(args, world_size: int) -> tuple[int, ...]:
    """The global ranks a collective runs over: a sub-mesh's group (tensor parallelism's, HSDP's replicas) is a
    part of the world. c10d ops carry their ProcessGroup, functional collectives its name."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)  # private: looked for, not assumed
    for arg in args:
        group = None
        if isinstance(arg, str) and resolve is not None:
            try:
                group = resolve(arg)
            except RuntimeError:  # another string argument: the reduce op's name
                continue
        elif not isinstance(arg, torch.Tensor) and callable(getattr(arg, "size", None)):
            group = arg
        if group is not None:
            return _ranks_of(group, world_size)
    return _world(world_size)


def _ranks_of(group, world_size: int) -> tuple[int, ...]:
    from torch.distributed import distributed_c10d

    try:
        return _interned(tuple(sorted(distributed_c10d.get_process_group_ranks(group))))
    except (RuntimeError, ValueError, KeyError, AttributeError, TypeError):  # not a registered group: its size
        return _world(int(group.size())) if int(group.size()) != world_size else _world(world_size)


_INTERNED: dict[tuple[int, ...], tuple[int, ...]] = {}


def _interned(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """One tuple per group however many of its collectives a step records."""
    return _INTERNED.setdefault(ranks, ranks)


def _on_host(args, out) -> bool:
    """Every tensor of the op is on the estimate's host (the meta device): it runs on the CPU."""
    tensors = [t for t in pytree.tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


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
