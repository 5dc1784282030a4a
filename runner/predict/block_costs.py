"""What each block costs under each plan choice: bytes it leaves for backward, time its recompute takes.

Bytes come from the estimator (fake tensors, no device memory): one step per choice, every block
under that choice, with hooks that read the live-bytes tracker as each block's forward begins and
ends. A block's bytes are what its first forward leaves alive (its output included: under
checkpointing that is what remains). Per-block figures add up: a block's saved tensors do not
depend on what its neighbours chose, so a plan's block bytes are the sum of its choices' bytes.

Time comes from a short real run (the model built on the training device) with every block
checkpointed: each block's forward is timed at its first call (the forward) and its second (the
recompute in backward), once fully, once under selective checkpointing, whose recompute skips the
ops it cached but whose forward pays for its caching mode (both count). Where no real run is
possible or wanted (`timed_steps` 0: `tune --predict`, a target GPU that is not this machine), the
times are the estimator's own predictions for its device (`Estimate.time`, per block). Offload
costs no recompute; its time is the bytes moved both ways at the host link's bandwidth (measured,
or the device's facts), not hidden behind compute (an upper bound: the copies overlap compute).
Offload exists on CUDA only, so its columns are empty for a CPU run.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from ..memory.apply import apply_plan
from ..memory.blocks import BlockList, find_blocks, undo_all, wrap_forward
from ..plan.memory_plan import FullCheckpointing, MemoryPlan, NoCheckpointing, SelectiveCheckpointing
from ..recipe.recipe import Recipe
from ..units import format_bytes
from .estimate import HOST, Estimate, Estimator

@dataclass(frozen=True)
class BlockCost:
    index: int
    name: str
    keep_bytes: int
    """Bytes the block's forward leaves for backward when nothing is recomputed."""
    recompute_bytes: int
    """What stays when the block is checkpointed (its output; the recompute brings back keep_bytes)."""
    selective_bytes: int
    """What stays under selective checkpointing (its output and the matmul outputs it caches)."""
    offload_bytes: int | None = None
    """Device bytes that stay when its saved activations go to the host (CUDA only)."""
    moved_bytes: int | None = None
    """Bytes copied to the host in forward, and back in backward (CUDA only)."""
    forward_s: float | None = None
    recompute_s: float | None = None
    """Seconds per step the full recompute adds (summed over micro-batches)."""
    selective_s: float | None = None
    offload_s: float | None = None
    """Seconds per step to move moved_bytes both ways, unhidden."""

    def of(self, action: str) -> tuple[int | None, float | None]:
        """(bytes the block leaves for backward, seconds it adds a step) under a policy whose
        `block_action` is `action` (runner/plan/policies.py): the columns are named after the actions, and
        an action without its columns (offload on the CPU) has no bytes, so no solver plans it."""
        seconds = 0.0 if action == "keep" else getattr(self, f"{action}_s", None)
        return getattr(self, f"{action}_bytes", None), seconds


@dataclass
class CostTable:
    """Per-block costs of one recipe at one micro-batch and precision."""

    micro_batch: int
    precision: str
    device: str
    none_peak: int
    """The estimator's peak with every block kept."""
    full_peak: int
    """The estimator's peak with every block recomputed."""
    base_bytes: int
    """none_peak less every block's keep_bytes: what no block choice changes."""
    blocks: list[BlockCost]
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {**asdict(self), "blocks": [asdict(b) for b in self.blocks]}


def cost_table(estimator: Estimator, micro_batch: int, precision: str, timed_steps: int = 2,
               pools: MemoryPlan | None = None) -> CostTable:
    """The per-block costs of `estimator`'s recipe at `micro_batch` and `precision`, with the weights,
    optimizer and loss policies of `pools` (default: the pools as the recipe's model and optimizer hold
    them): their bytes are part of what no block choice changes. Times: a short real run of
    `timed_steps`; with 0, the estimator's predictions when it has device facts, else none."""
    recipe, cuda = estimator.recipe, estimator.cuda
    held = {policy.section: policy for policy in pools.pool_policies()} | {"allow_lossy": pools.allow_lossy} \
        if pools is not None else {}
    plan = lambda checkpointing, **more: MemoryPlan(  # noqa: E731
        micro_batch=micro_batch, checkpointing=checkpointing, blocks=recipe.memory.blocks, **held, **more)
    none, keep, _ = block_bytes(estimator, plan(NoCheckpointing()), precision)
    full, recompute, _ = block_bytes(estimator, plan(FullCheckpointing(policy="full")), precision)
    selective_run, selective, _ = block_bytes(estimator, plan(SelectiveCheckpointing(policy="selective")), precision)
    offloaded = moved = [None] * len(keep)
    if cuda:
        _, offloaded, moved = block_bytes(estimator, plan(NoCheckpointing(), offload={"policy": "all"}), precision)
        offloaded = [k - m for k, m in zip(keep, moved, strict=True)]  # in flight at the block's end is not saved
    found = find_blocks(estimator.model, recipe.memory.blocks)
    if timed_steps:
        times = recompute_seconds(recipe, micro_batch, precision, timed_steps)
        times = _alike_averaged(times, [(type(b.module).__name__, keep[b.index], recompute[b.index]) for b in found])
        how = (f"median of {timed_steps} real steps after a warm-up, the same for blocks of one class that save "
               "the same bytes (their median)")
    else:
        times, how = _predicted_times(none, full, selective_run), f"predicted for {estimator.facts.name} (a roofline)" \
            if estimator.facts else "not measured"
    bandwidth = _host_rate(estimator, measured=timed_steps > 0) if times and cuda else None
    names = [block.name for block in found]
    blocks = [BlockCost(i, names[i], keep[i], recompute[i], selective[i], offloaded[i], moved[i],
                        *_times(times, i), 2 * moved[i] / bandwidth if bandwidth and moved[i] is not None else None)
              for i in range(len(keep))]
    notes = [f"bytes: the estimator ({estimator.recipe.train.batch_size} samples in micro-batches of {micro_batch}, "
             f"{precision}, {'cuda' if cuda else 'cpu'}); times: {how}"]
    if bandwidth:
        notes.append(f"offload: {format_bytes(int(bandwidth))}/s host copies, counted unhidden (an upper bound)")
    return CostTable(micro_batch, precision, "cuda" if cuda else "cpu", none.peak_bytes, full.peak_bytes,
                     none.peak_bytes - sum(keep), blocks, notes)


def _predicted_times(none, full, selective) -> dict[str, list[float]]:
    """Per block, from the estimator's step times: the forward, what full recompute adds, and what
    selective adds (its recompute, and its caching mode's cost in the forward)."""
    if none.time is None or not none.time.blocks:
        return {}
    plain = {b.index: b.forward_s for b in none.time.blocks}
    recomputed = {b.index: b.recompute_s for b in full.time.blocks}
    cached = {b.index: b.recompute_s + max(0.0, b.forward_s - plain.get(b.index, 0.0)) for b in selective.time.blocks}
    count = max(plain) + 1
    return {"forward": [plain.get(i, 0.0) for i in range(count)],
            "recompute": [recomputed.get(i, 0.0) for i in range(count)],
            "selective": [cached.get(i, 0.0) for i in range(count)]}


def _host_rate(estimator: Estimator, measured: bool) -> float | None:
    if measured and torch.cuda.is_available():
        return host_bandwidth()
    facts = estimator.facts
    return facts.host_gbs * 1e9 if facts is not None and facts.host_gbs else None


def _alike_averaged(times: dict[str, list[float]], kinds: list[tuple]) -> dict[str, list[float]]:
    """Blocks of one class that save the same bytes do the same work: each gets the median of their
    timings, since one short run on a busy machine can make any single block look slow."""
    groups: dict[tuple, list[int]] = {}
    for index, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(index)
    out = {}
    for name, values in times.items():
        out[name] = list(values)
        for members in groups.values():
            for index in members:
                out[name][index] = statistics.median(values[i] for i in members)
    return out


def _times(times: dict[str, list[float]], index: int) -> tuple[float | None, float | None, float | None]:
    return tuple(times[k][index] if times else None for k in ("forward", "recompute", "selective"))


def host_bandwidth(nbytes: int = 64 << 20) -> float:
    """Bytes per second of a pinned device-to-host copy (the slower direction on most systems)."""
    device_tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(device_tensor)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        host.copy_(device_tensor, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - started)


def format_table(table: CostTable) -> str:
    """The table `ckrun show --costs` prints."""
    size = lambda n: "-" if n is None else format_bytes(n)  # noqa: E731
    ms = lambda s: "-" if s is None else f"{1000 * s:.1f}"  # noqa: E731
    rows = [("block", "name", "keep", "recompute", "selective", "offload", "moved", "fwd ms", "recomp ms",
             "select ms", "offload ms")]
    rows += [(str(b.index), b.name, size(b.keep_bytes), size(b.recompute_bytes), size(b.selective_bytes),
              size(b.offload_bytes), size(b.moved_bytes), ms(b.forward_s), ms(b.recompute_s), ms(b.selective_s),
              ms(b.offload_s)) for b in table.blocks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 1 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    head = (f"micro_batch {table.micro_batch}, {table.precision}, {table.device}: peak with every block kept "
            f"{format_bytes(table.none_peak)}, of which {format_bytes(table.base_bytes)} no block choice changes")
    return "\n".join([head, *lines, *(f"note: {n}" for n in table.notes)])


# --- bytes, from the estimator ---------------------------------------------------------------


def block_bytes(estimator: Estimator, plan: MemoryPlan, precision: str) -> tuple[Estimate, list[int], list[int]]:
    """(the estimate, per-block device bytes, per-block host bytes) of one step of `plan` on fake tensors
    (a plan composed from parts says them from its composition: runner/predict/compose.py)."""
    if hasattr(estimator, "block_bytes"):
        return estimator.block_bytes(plan, precision)
    blocks = find_blocks(estimator.model, plan.blocks)
    device_bytes, host_bytes = [0] * len(blocks), [0] * len(blocks)
    watch = lambda run: _watched(blocks, run.tracker, device_bytes, host_bytes)  # noqa: E731
    return estimator.estimate(plan, precision, watch=watch), device_bytes, host_bytes


@contextlib.contextmanager
def _watched(blocks: BlockList, tracker, device_bytes: list[int], host_bytes: list[int]):
    """Hooks that record what each block's first forward leaves on the device and on the host."""
    started: dict[int, tuple[int, int]] = {}
    done: set[int] = set()

    def now() -> tuple[int, int]:
        current = tracker.current_by_device
        return current.get(str(tracker.device), 0), current.get(str(HOST), 0)

    def before(index, *_):
        if index not in done:
            started[index] = now()

    def after(index, *_):
        if index in started and index not in done:
            done.add(index)
            (device0, host0), (device1, host1) = started[index], now()
            device_bytes[index], host_bytes[index] = device1 - device0, host1 - host0

    handles = [h for block in blocks for h in (
        block.module.register_forward_pre_hook(functools.partial(before, block.index)),
        block.module.register_forward_hook(functools.partial(after, block.index)))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# --- time, from a short real run -------------------------------------------------------------


def recompute_seconds(recipe: Recipe, micro_batch: int, precision: str, steps: int = 2,
                      device: torch.device | None = None) -> dict[str, list[float]]:
    """Per block: `forward`, `recompute` (full) and `selective` seconds per step, medians of `steps`
    timed steps after one warm-up, on the recipe's device with a real model and a synthetic batch."""
    from ..builders.model import build_model
    from ..builders.optim import build_optimizer
    from ..builders.sources import stand_in_batch
    from ..train.trainer import pick_device
    from ..train.step import Precision, run_step

    device = device or pick_device(recipe)
    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe.model, device).train()
    optimizer = build_optimizer(model, recipe.train, device)
    batch = stand_in_batch(recipe, model).to(device)
    blocks = find_blocks(model, recipe.memory.blocks)
    out: dict[str, list[float]] = {}
    for policy, name in ((FullCheckpointing(policy="full"), "recompute"),
                         (SelectiveCheckpointing(policy="selective"), "selective")):
        calls = [[] for _ in blocks]
        timers = undo_all([wrap_forward(b.module, _timed, calls[b.index], device) for b in blocks])
        plan = MemoryPlan(checkpointing=policy, micro_batch=micro_batch, blocks=recipe.memory.blocks)
        try:
            with apply_plan(model, plan, device):
                for _ in range(steps + 1):
                    run_step(model, optimizer, batch, micro_batch, Precision(precision, device.type), None,
                             recipe.train.grad_clip)
        finally:
            timers()
        per_step = [_per_step(c, steps, recipe.train.batch_size // micro_batch) for c in calls]
        out[name] = [recompute for _, recompute in per_step]
        if name == "selective":  # its caching mode slows the forward as well: that is part of its cost
            out[name] = [r + max(0.0, f - plain) for r, (f, _), plain in zip(out[name], per_step, out["forward"],
                                                                           strict=True)]
        out.setdefault("forward", [forward for forward, _ in per_step])
    del model, optimizer, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the tuner's model child lives on beside the probes: give the memory back
    return out


def _timed(forward, calls: list[float], device: torch.device):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        _sync(device)
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:  # checkpoint's early stop ends a recompute by raising: it still counts
            _sync(device)
            calls.append(time.perf_counter() - started)
    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_step(calls: list[float], steps: int, micro_batches: int) -> tuple[float, float]:
    """(forward, recompute) seconds per step: calls alternate forward, recompute per micro-batch;
    the warm-up step's calls are dropped, the median step counts."""
    per = 2 * micro_batches
    timed = calls[per:per * (steps + 1)]
    rounds = [timed[i:i + per] for i in range(0, len(timed), per)] or [[0.0, 0.0]]
    return (statistics.median(sum(r[0::2]) for r in rounds), statistics.median(sum(r[1::2]) for r in rounds))
