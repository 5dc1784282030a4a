"""A step's predicted time from the op clock's ledger: phases, micro-batches, overlap, MFU and HFU.

The estimator runs the first two micro-batches of a step (the rest repeat the second exactly) and
the update; the step's time is then, per phase,
    first micro-batch + (micro-batches - 1) x the last
where the "update" phase of a micro-batch is what runs after its backward: adding up the loss,
and after the last one clipping and the optimizer (so (n - 1) x the first's tail + the last's)
plus what the side streams cannot hide:
- activation offload: a block's copy to the host hides behind the next block's forward, its copy
  back behind the next block's backward (taken as the step's backward in proportion to that
  block's forward); only the excess shows;
- an offloaded optimizer's gradients, copied to the host as the backward makes them, behind that
  micro-batch's backward; only the excess shows;
- collectives: each micro-batch replayed on a compute and a comm stream (overlap.py): FSDP's all-gathers
  prefetched one unit ahead, its reduce-scatters behind the next unit's backward, tensor parallelism's
  eager collectives blocking; DDP's bucketed all-reduce through the last micro-batch's backward, its
  last bucket (at least) after it. Only what compute waits for shows, so a step over several ranks is
  never as fast per rank as one alone.
MFU counts the model's FLOPs (a recompute does not count), HFU every FLOP the device runs, each
op's FLOPs against the datasheet peak of the rate it was priced at (bf16 products at the bf16 peak,
fp32 convolutions that cuDNN runs in TF32 at the TF32 peak, fp32 products at TF32's where `tf32: true`
lets them, else fp32's): the rate used is the rate stated against, so neither passes 100 %.
Under tensor parallelism both count a rank's own share of the FLOPs, against one device's peak.
What only a run's first step does (selective checkpointing's learning forward, once per block and
input shape) is `first_step_extra_s`, outside the step's time, FLOPs, MFU and HFU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .device_facts import DeviceFacts
from .overlap import ddp_buckets_exposed
from .roofline import STEP_PHASES, Ledger, StepWork, price


@dataclass(frozen=True)
class BlockTime:
    index: int
    forward_s: float
    """The block's forward in one step (every micro-batch)."""
    recompute_s: float
    """What its recompute adds to a step under this plan (0: not recomputed)."""


@dataclass(frozen=True)
class StepTime:
    """One step's predicted time on `device`, by phase, and what it does with the device."""

    device: str
    seconds: float
    forward_s: float
    backward_s: float
    recompute_s: float
    update_s: float
    offload_s: float
    """Copy time to and from the host that compute does not hide."""
    comm_s: float
    """Collective time that compute does not hide (--nproc)."""
    flops: float
    """FLOPs the device runs in a step, recompute included (hardware FLOPs)."""
    model_flops: float
    """FLOPs of the step without recompute."""
    mfu: float
    hfu: float
    samples_per_s: float
    tokens_per_s: float | None
    blocks: list[BlockTime] = field(default_factory=list)
    source: str = ""
    first_step_extra_s: float = 0.0
    """What a run's first step takes beyond `seconds` (selective checkpointing learning, once, which
    ops of each block it may cache)."""
    by_class: dict[str, float] = field(default_factory=dict)
    """Compute seconds of the step by class of kernel (products, convolutions, attention, memory-bound,
    the optimizer's step): where the time goes; they add up to `seconds` less offload and collectives."""

    def record(self) -> dict:
        data = asdict(self)
        data["blocks"] = [asdict(b) for b in self.blocks]
        return data


@dataclass(frozen=True)
class StepShape:
    """What the time is divided by: the step's samples (the global batch), tokens per sample, ranks."""

    micro_batches: int
    samples: int
    tokens_per_sample: int | None
    precision: str
    world_size: int = 1
    ddp_gradient_bytes: int = 0
    data_parallel: int | None = None
    """Groups of ranks that see different samples (the step's samples are one group's); None: world_size.
    Tensor parallelism's groups share samples, so they count once."""
    tf32: bool | None = None
    """The recipe's `tf32` (MFU now follows each op's priced rate, `Ledger.peak_s`; kept for callers)."""


def step_time(work: StepWork, shape: StepShape, facts: DeviceFacts) -> StepTime:
    """The step whose work the op clock recorded, on the device `facts` describe."""
    return assemble(price(work, facts), shape, facts)


def assemble(ledger: Ledger, shape: StepShape, facts: DeviceFacts) -> StepTime:
    n = shape.micro_batches
    phase = {name: _extrapolated(ledger.seconds, name, n) for name in STEP_PHASES}
    update = _tails(ledger.seconds, n)
    flops = sum(_extrapolated(ledger.flops, name, n) for name in STEP_PHASES)
    flops += _tails(ledger.flops, n)
    recompute_flops = _extrapolated(ledger.flops, "recompute", n)
    backward = (phase["backward"] + phase["recompute"]) / n
    offload = n * (_offload_exposed(ledger, facts, phase["forward"] / n, backward)
                   + _gradients_exposed(ledger, facts, backward))
    comm = _comm_exposed(ledger, shape, facts, phase)
    seconds = sum(phase.values()) + update + offload + comm
    peak_s = sum(_extrapolated(ledger.peak_s, name, n) for name in STEP_PHASES) + _tails(ledger.peak_s, n)
    model_peak_s = peak_s - _extrapolated(ledger.peak_s, "recompute", n)
    samples_per_s = shape.samples * (shape.data_parallel or shape.world_size) / seconds if seconds else 0.0
    blocks = [BlockTime(i, n * ledger.block_forward_s[i], n * ledger.block_recompute_s.get(i, 0.0))
              for i in sorted(ledger.block_forward_s)]
    return StepTime(
        device=facts.name, seconds=seconds, forward_s=phase["forward"], backward_s=phase["backward"],
        recompute_s=phase["recompute"], update_s=update, offload_s=offload, comm_s=comm, flops=flops,
        model_flops=flops - recompute_flops, mfu=model_peak_s / seconds if seconds else 0.0,
        hfu=peak_s / seconds if seconds else 0.0, samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * shape.tokens_per_sample if shape.tokens_per_sample else None,
        blocks=blocks, source=facts.source,
        first_step_extra_s=ledger.seconds[("first", "learn")] + ledger.seconds[("repeat", "learn")],
        by_class={name: _step_seconds(table, n) for name, table in sorted(ledger.class_seconds.items())})


def _step_seconds(table: dict, micro_batches: int) -> float:
    return sum(_extrapolated(table, name, micro_batches) for name in STEP_PHASES) + _tails(table, micro_batches)


def _extrapolated(table: dict, phase: str, micro_batches: int) -> float:
    """A phase of every micro-batch: the first, then the rest as the last one seen."""
    first, repeat = table[("first", phase)], table[("repeat", phase)]
    return first + (micro_batches - 1) * repeat if micro_batches > 1 else first


def _tails(table: dict, micro_batches: int) -> float:
    """What runs after each backward: every micro-batch's tail as the first's, the last's holding the update."""
    first, last = table[("first", "update")], table[("repeat", "update")]
    return (micro_batches - 1) * first + last if micro_batches > 1 else first


def _offload_exposed(ledger: Ledger, facts: DeviceFacts, forward_s: float, backward_s: float) -> float:
    """One micro-batch's copy time that the next block's compute does not hide, both ways."""
    if not ledger.to_host.get("first"):
        return 0.0
    if not facts.host_gbs:
        return 0.0
    rate = facts.host_gbs * 1e9
    order = sorted(ledger.block_forward_s)
    windows = {i: ledger.block_forward_s[j] for i, j in zip(order, order[1:], strict=False)}
    if order:
        windows[order[-1]] = ledger.outside_blocks_forward_s
    share = backward_s / forward_s if forward_s else 0.0
    exposed = 0.0
    for block, nbytes in ledger.block_to_host.items():
        window = windows.get(block, 0.0)
        exposed += max(0.0, nbytes / rate - window) + max(0.0, nbytes / rate - share * window)
    unplaced = ledger.to_host["first"] - sum(ledger.block_to_host.values())
    return exposed + 2 * max(0, unplaced) / rate


def _gradients_exposed(ledger: Ledger, facts: DeviceFacts, backward_s: float) -> float:
    """One micro-batch's gradient copies to the host (an offloaded optimizer's) that its backward does not hide."""
    nbytes = ledger.gradients_to_host.get("first", 0)
    if not nbytes or not facts.host_gbs:
        return 0.0
    return max(0.0, nbytes / (facts.host_gbs * 1e9) - backward_s)


def _comm_exposed(ledger: Ledger, shape: StepShape, facts: DeviceFacts, phase: dict[str, float]) -> float:
    """What compute does not hide of the step's collectives: each micro-batch's replay (overlap.exposed), the
    update's collectives (clipping's norm) whole, and DDP's buckets after the last backward."""
    n = shape.micro_batches
    first, repeat = ledger.comm_exposed.get("first", 0.0), ledger.comm_exposed.get("repeat", 0.0)
    exposed = first + (n - 1) * repeat if n > 1 else first
    exposed += _tails(ledger.comm_s, n)
    if shape.ddp_gradient_bytes and shape.world_size > 1:
        rate = facts.ring_rate(shape.world_size, min(shape.world_size, facts.gpus_per_host))
        exposed += ddp_buckets_exposed(shape.ddp_gradient_bytes, rate, shape.world_size,
                                       (phase["backward"] + phase["recompute"]) / n)
    return exposed
