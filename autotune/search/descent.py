"""tune --predict: where the search goes next from the plans it has priced, one knob at a time.

A predicted plan costs a fraction of a second once its parts are traced, so the search can walk from
what it knows instead of waiting for the sampler to land near it. Two walks:

- **faster**: from the fastest plan predicted to fit (each new one, once), every neighbour: a weaker
  checkpointing or a larger micro-batch may be faster and still fit, or faster and over the limit;
- **lighter**: from a plan predicted faster than that one but over the limit, each knob's nearest value
  that holds less memory (`Knob.lighter`: offload, compression, a smaller micro-batch, a stronger pool
  setting). A value that raises the pools' lower bound is no lighter (an fp8 optimizer state after 4bit),
  and one that lowers it is tried only where the pools could still close the gap: lowered to the space's
  least bound, the plan would fit (else only the activations' knobs can bring it under).

The fastest plan that fits (the Llama 8B's at 80 GB: selective checkpointing, every block's activations
on the host, a 4-bit optimizer state) is three knobs from the plans the starting points find, and its
first step (selective checkpointing alone) is 3.5 times over the limit: no walk that stays under the
limit reaches it. Plans over the limit are gone on from in order of their step time scaled by how far
over they are (a plan twice over counts twice as slow: the further over, the more knobs it takes, and
the likelier one of them costs time), and a plan no faster than the fastest fit is not gone on from: a
lighter value adds work (a recompute, a copy, a rounding) and so never makes a step faster.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from ..records import TrialRecord
from ..space.pool_floor import least
from ..space.pool_knobs import space_values
from ..space.space import Space
from ..space.validity import invalid_reason

FASTER = 1 - 1e-9  # relative: composed step times are sums of floats in different orders
CLOSES = 1 / 16  # the least share of a plan's gap over the limit one lighter knob must close to be gone on from


def point_key(params: dict) -> str:
    return json.dumps(params, sort_keys=True)


@dataclass(frozen=True)
class Priced:
    """A plan the search has predicted: its trial, point, predicted peak (CUDA context included) and step time."""

    number: int
    params: dict
    peak: int
    seconds: float

    @functools.cached_property
    def key(self) -> str:  # read in every walk's choice: made once
        return point_key(self.params)


class Descent:
    """The plans priced so far and which of them the walks have gone on from (module docstring)."""

    def __init__(self, space: Space, limit: int):
        self.space, self.limit = space, limit
        self.priced: dict[str, Priced] = {}
        self.gone_from: set[str] = set()
        self.faster_from = float("inf")  # the step time of the last fit the faster walk went from
        self.came_from: dict[str, Priced] = {}  # a point the lighter walk led to -> the plan it went from
        bound = space.bound
        self.least_floor = None if bound is None else \
            least(space_values(space), bound.facts, bound.step, bound.context)[1].total

    def add(self, number: int, params: dict, record: TrialRecord) -> None:
        """What a trial's prediction said of its plan; a plan without a peak and a step time is no place to go from."""
        peak = record.measured_peak if record.measured_peak is not None else record.predicted_peak
        seconds = record.step_s if record.step_s is not None else record.predicted_s
        if peak is not None and seconds:
            plan = Priced(number, dict(params), peak, seconds)
            self.priced.setdefault(plan.key, plan)

    def fastest_fit(self) -> Priced | None:
        fits = [p for p in self.priced.values() if p.peak <= self.limit]
        return min(fits, key=lambda p: (p.seconds, p.key), default=None)

    def next_moves(self) -> tuple[str, Priced, list[dict]] | None:
        """The next plan to go from, which walk, and the points one knob away it leads to; None: nowhere left."""
        best = self.fastest_fit()
        over = [p for p in self.priced.values() if p.peak > self.limit and p.key not in self.gone_from
                and (best is None or (p.seconds < FASTER * best.seconds and p.key in self.came_from))
                and self._nearer(p)]
        if over:  # the plans faster than the best fit are brought under the limit first, if they can be
            start = min(over, key=lambda p: (p.seconds * p.peak / self.limit, p.key))
            self.gone_from.add(start.key)
            return "lighter", start, self._led_from(start, self._lighter(start))
        if best is not None and best.seconds < FASTER * self.faster_from:
            self.faster_from = best.seconds
            self.gone_from.add(best.key)
            return "faster", best, self._led_from(best, list(self._heavier(best.params)))
        return None

    def _led_from(self, start: Priced, points: list[dict]) -> list[dict]:
        for point in points:
            self.came_from.setdefault(point_key(point), start)
        return points

    def _nearer(self, plan: Priced) -> bool:
        """Whether a plan the lighter walk led to closed at least CLOSES of the gap of the plan it came from (a
        knob that barely moves the peak, compression where nothing is checkpointed, leads nowhere in the few
        knobs left); one the faster walk led to, from a fit, is over by what it holds more."""
        before = self.came_from.get(plan.key)
        return before is None or before.peak <= self.limit or \
            before.peak - plan.peak >= CLOSES * (before.peak - self.limit)

    def _heavier(self, params: dict):
        """The points one searched knob away that hold more, or whose knob has no such order (checkpointing),
        in the table's order: the only ones that may be faster."""
        lighter = {knob.name: knob.lighter for knob in self.space.knobs}
        for name, point in self.space.neighbours(params):
            ordered = lighter.get(name)
            if ordered is None or params.get(name) in ordered(self.space, point[name]):
                yield point

    def _lighter(self, start: Priced) -> list[dict]:
        """Each ordered knob's nearest valid value that holds less, and where the pools' bound knows better, the
        nearest that lowers it (weights fp32:uncached saves activations only, bf16 the pools) (module docstring)."""
        floor = self._floor(self.space.candidate(start.params))
        pools_may_close = floor is None or self.least_floor is None or start.peak - floor + self.least_floor <= self.limit
        moves = []
        for knob in self.space.knobs:
            if knob.lighter is None or knob.name not in self.space.choices:
                continue
            kinds = set()  # "same" (the bound unmoved, or unknown), "lower": at most the nearest of each
            for value in knob.lighter(self.space, start.params[knob.name]):
                point = {**start.params, knob.name: value}
                candidate = self.space.candidate(point)
                moved = self._floor(candidate)
                kind = "same" if moved is None or floor is None or moved == floor else \
                    "lower" if moved < floor and pools_may_close else None
                if kind is None or kind in kinds or invalid_reason(candidate, self.space):
                    continue  # holds more by the bound (fp8 after 4bit), or the pools cannot close the gap
                kinds.add(kind)
                moves.append(point)
        return moves

    def _floor(self, candidate) -> int | None:
        """The pools' lower bound of a plan (None where there is none: under --nproc)."""
        bound = self.space.bound
        floor = bound.floor(candidate) if bound is not None else None
        return None if floor is None else floor.total
