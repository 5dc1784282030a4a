"""How much of a step's communication its compute hides: the compute stream and one comm stream, run in
program order.

The op clock (roofline.py) records each collective with its place among the compute ops (the number of
ops recorded before it), its size and how torch runs it. `exposed` replays one micro-batch: compute ops
one after another on the compute stream, collectives one after another on the comm stream, and each
collective starts and is waited for as its kind says:
- blocking (`Collective.blocking`): a functional collective (tensor parallelism's DTensor redistributes,
  eager: the next op needs its result) starts where it is issued and the compute stream waits for it;
- an FSDP all-gather is prefetched one unit ahead (FSDP2 issues the next unit's gather while the current
  unit computes; in backward, the unit before it): it may start where the previous all-gather was
  issued, and the op after it waits for it; the first of a micro-batch has nothing to hide behind;
- a reduce-scatter or asynchronous all-reduce starts where it is issued and is only waited for at the
  end of the micro-batch: it hides behind the next unit's backward; the last one is exposed.
All-gathers and reductions run on streams of their own (FSDP2's all-gather and reduce-scatter streams), so a
gather prefetched during a unit's backward does not queue behind that unit's reduce-scatter; each stream
runs its collectives one after another. What the compute stream waits, beyond its own ops, is the exposed
time.

DDP's gradient all-reduce is not an op the fake step runs: `ddp_buckets_exposed` replays its buckets
(25 MiB, DDP's `bucket_cap_mb` default) becoming ready evenly through the last micro-batch's backward;
each all-reduce starts when its bucket is ready and the previous one is done; what runs past the end of
the backward (at least the last bucket's all-reduce) is exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default (25)


@dataclass(frozen=True)
class Collective:
    position: int
    """Compute ops recorded before it in its micro-batch (it runs between op position-1 and op position)."""
    seconds: float
    kind: str  # "gather" | "reduce" (reduce-scatter, all-reduce) | "other"
    blocking: bool


def exposed(op_seconds: list[float], collectives: list[Collective]) -> float:
    """Seconds the compute stream waits for collectives over one micro-batch (module docstring)."""
    at = _by_position(collectives)
    clock = pending = 0.0
    free = {"gather": 0.0, "reduce": 0.0, "other": 0.0}  # when each comm stream is next idle
    started: dict[int, float] = {}  # compute clock at each position that issued an all-gather
    last_gather: int | None = None
    for position in range(len(op_seconds) + 1):
        for collective in at.get(position, ()):
            stream = collective.kind if collective.kind in free else "other"
            if collective.blocking:
                free[stream] = clock = max(clock, free[stream]) + collective.seconds
            elif stream == "gather":
                issued = started[last_gather] if last_gather is not None else clock
                started.setdefault(position, clock)
                free[stream] = max(issued, free[stream]) + collective.seconds
                clock = max(clock, free[stream])
                last_gather = position
            else:
                free[stream] = max(clock, free[stream]) + collective.seconds
                pending = max(pending, free[stream])
        if position < len(op_seconds):
            clock += op_seconds[position]
    return max(clock, pending) - sum(op_seconds)


def _by_position(collectives: list[Collective]) -> dict[int, list[Collective]]:
    at: dict[int, list[Collective]] = {}
    for collective in collectives:
        at.setdefault(collective.position, []).append(collective)
    return at


def ddp_buckets_exposed(gradient_bytes: int, ring_rate: float, world_size: int, backward_s: float) -> float:
    """Seconds DDP's bucketed all-reduce runs past the end of the backward (module docstring)."""
    if gradient_bytes <= 0 or world_size < 2 or ring_rate <= 0:
        return 0.0
    buckets = max(1, math.ceil(gradient_bytes / DDP_BUCKET_BYTES))
    done = 0.0
    for index in range(buckets):
        size = min(DDP_BUCKET_BYTES, gradient_bytes - index * DDP_BUCKET_BYTES)
        ready = backward_s * (index + 1) / buckets
        done = max(done, ready) + 2 * size * (world_size - 1) / world_size / ring_rate
    return max(0.0, done - backward_s)
