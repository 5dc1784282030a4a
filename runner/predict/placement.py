"""Placing a plan's composed parts in time (runner/predict/compose.py's module docstring says how): the
parts put in order, the storages that cross parts joined by what they are, each freed at the latest
release any trace saw, and the allocations and frees reported as the estimator reports a tracker's."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..plan.memory_plan import MemoryPlan
from ..units import format_bytes
from ..memory.tracker import CATEGORIES
from .estimate import CPU, Estimate, micro_batch_of
from .parts import BASE, Sid, Trace
from .roofline import StepWork
from .step_time import step_time

END = 1 << 62  # a position after every allocation of a part
MADE_KEPT = 24  # compositions kept (each the events of a step: megabytes for a deep model)


class NotComposable(Exception):
    """Why a plan's prediction cannot be composed from parts (the whole-model step is the answer)."""


@dataclass
class _Bytes:
    """The composed step's allocations, as `Estimator._result` reads a tracker."""

    events: list
    peak_bytes: int
    breakdown: dict[str, int]
    peak_by_device: dict[str, int]
    category_peaks: dict[str, int]
    """Each category's own most on the step's device, as the tracker keeps it."""

    @property
    def breakdown_at_peak(self) -> dict[str, int]:
        return dict(self.breakdown)  # a copy, as the tracker's: the estimate adds the allocator's parts to it


@dataclass
class Layout:
    """One plan on this model: each block's signature and representative, and the traces it is made of."""

    plan: MemoryPlan
    precision: str
    key: str
    micro_batches: int
    signatures: list[tuple]
    windows: list[tuple[int, int]]
    """Per block, the first and last block traced beside its representative."""
    reps: list[tuple[Trace, int]] = field(default_factory=list)
    absolute: Trace | None = None
    update: Trace | None = None


class Composition:
    """One plan's parts put in order, its storages joined and placed (module docstring)."""

    def __init__(self, composer, layout: Layout):
        self.composer, self.layout = composer, layout
        self.count = len(layout.signatures)
        self.order = self._order()
        self.at = {sid: n for n, sid in enumerate(self.order)}
        self.frees: dict[tuple, tuple] = {}  # store -> latest position it was seen let go
        self.labels: dict[tuple, list[tuple[tuple, str]]] = {}
        self.memo: dict[tuple, tuple] = {}
        self.wiring: dict[tuple, dict[int, int]] = {}
        self.cuts: dict[Sid, tuple[int, int]] = {}  # part -> (events before it, events before what goes after it)

    def _order(self) -> list[Sid]:
        order: list[Sid] = [("head",)]
        for m in range(1, self.layout.micro_batches + 1):
            order += [("pre", m, "f"), *[("blk", i, m, "f") for i in range(self.count)], ("post", m, "f"),
                      ("post", m, "b"), *[("blk", i, m, "b") for i in reversed(range(self.count))], ("pre", m, "b"),
                      ("tail", m)]
        return order + [("update",), ("end",)]

    def source(self, sid: Sid) -> tuple[Trace, Sid, int]:
        """The trace, its part and the shift (full block less traced block) that a full part is copied from."""
        if sid[0] == "blk":
            trace, t = self.layout.reps[sid[1]]
            return trace, ("blk", t, *sid[2:]), sid[1] - t
        if sid == ("update",):
            return self.layout.update, sid, 0
        return self.layout.absolute, sid, 0

    # --- naming storages ---------------------------------------------------------------------------

    def store(self, trace: Trace, serial: int, shift: int) -> tuple:
        """The full step's name for `serial` of `trace` seen from a block `shift` away."""
        key = (id(trace), serial, shift)
        if key not in self.memo:
            self.memo[key] = self._name(trace, serial, shift)
        return self.memo[key]

    def _name(self, trace: Trace, serial: int, shift: int) -> tuple:
        stored = trace.stores[serial]
        owner = stored.owner
        if owner == BASE:
            if trace is not self.layout.update:
                raise NotComposable("a part frees a storage that existed before the step")
            return (BASE, stored.ordinal)
        if owner[0] != "blk":
            if trace is self.layout.update and owner == ("head",):
                raise NotComposable("the update's placeholder gradient reached another part")
            self._same_as_absolute(trace, owner, stored)
            return (owner, stored.ordinal)
        j, m, phase = owner[1], owner[2], owner[3]
        full = j + shift
        if 0 <= full < self.count and self.layout.reps[full][0] is trace and self.layout.reps[full][1] == j:
            return (("blk", full, m, phase), stored.ordinal)  # the block that stands for `full` made it
        boundary = trace.boundaries.get((j, m))
        if phase == "f" and boundary is not None and serial in boundary.outputs:
            return self.output(full, m, boundary.outputs.index(serial))
        if phase == "b" and boundary is not None and serial in boundary.din.values():
            leaf = next(k for k, s in boundary.din.items() if s == serial)
            if 0 <= full < self.count:
                return self.gradient_in(full, m, leaf)
            before = trace.boundaries.get((j - 1, m))  # past the last block: what the head's backward sends
            if full == self.count and before is not None and boundary.inputs[leaf] in before.outputs:
                return self.arriving(full - 1, m, before.outputs.index(boundary.inputs[leaf]))
            raise NotComposable("a block is given a tensor needing gradients that its predecessor did not return")
        if j in trace.real and 0 <= full < self.count:  # a neighbour's own, traced beside its representative
            self._same_as_copied(("blk", full, m, phase), stored)
            return (("blk", full, m, phase), stored.ordinal)
        raise NotComposable("a block's storage is named past the model's blocks")

    def output(self, block: int, m: int, leaf: int) -> tuple:
        """Block `block`'s output leaf `leaf` in micro-batch `m`."""
        if not 0 <= block < self.count:
            raise NotComposable("a block's output is named past the model's blocks")
        trace, t = self.layout.reps[block]
        return self.store(trace, trace.boundaries[(t, m)].outputs[leaf], block - t)

    def arriving(self, block: int, m: int, leaf: int) -> tuple:
        """The gradient that arrives for block `block`'s output leaf `leaf`: what the next block computes
        for the input it made of it, or for the last block what the head's backward computes."""
        absolute = self.layout.absolute
        if block == self.count - 1:
            return self.store(absolute, absolute.boundaries[(block, m)].dout[leaf], 0)
        return self.gradient_in(block + 1, m, self._wired(block, m)[leaf])

    def gradient_in(self, block: int, m: int, leaf: int) -> tuple:
        """The gradient block `block` computes for its input leaf `leaf`, or passes on (a residual's: then it
        is the one that arrived for its output, whoever sent it)."""
        trace, t = self.layout.reps[block]
        boundary = trace.boundaries[(t, m)]
        serial = boundary.din[leaf]
        passed = [k for k, s in boundary.dout.items() if s == serial]
        if passed:
            return self.arriving(block, m, passed[0])
        return self.store(trace, serial, block - t)

    def _wired(self, block: int, m: int) -> dict[int, int]:
        """Which input leaf of block+1 each output leaf of `block` becomes (read in the absolute trace)."""
        if (block, m) not in self.wiring:
            bounds = self.layout.absolute.boundaries
            outputs, inputs = bounds[(block, m)].outputs, bounds[(block + 1, m)].inputs
            self.wiring[(block, m)] = {k: inputs.index(s) for k, s in enumerate(outputs) if s is not None and s in inputs}
        return self.wiring[(block, m)]

    def _same_as_absolute(self, trace: Trace, owner: Sid, stored) -> None:
        absolute = self.layout.absolute
        if trace is absolute or trace is self.layout.update:
            return
        part = absolute.parts.get(owner)
        if part is None or len(part.allocs) < stored.ordinal or \
                absolute.stores[part.allocs[stored.ordinal - 1]].nbytes != stored.nbytes:
            raise NotComposable(f"the {owner[0]} part differs between traces")

    def _same_as_copied(self, sid: Sid, stored) -> None:
        trace, tsid, _ = self.source(sid)
        part = trace.parts.get(tsid)
        if part is None or len(part.allocs) < stored.ordinal or \
                trace.stores[part.allocs[stored.ordinal - 1]].nbytes != stored.nbytes:
            raise NotComposable("a block's neighbours differ from those it was traced with")

    # --- placing frees -----------------------------------------------------------------------------

    def position(self, trace: Trace, sid: Sid, k: int, shift: int, boundary: bool = False) -> tuple | None:
        """Where in the full step a trace's position (part, allocations made) falls, seen `shift` away, or
        None where that trace cannot say. A real block's part speaks for the full block it stands for;
        another real block's (a neighbour traced beside it) only where its allocations are the same, and
        never of a boundary tensor (the neighbour's own trace says when it lets go). A relay's part is
        the full block's start (a relay holds nothing: someone let go no later), the gap after it its
        end. The embedding's and head's parts speak of a block's boundary only for the block itself."""
        if sid[0] == "blk":
            full = sid[1] + shift
            if not 0 <= full < self.count:
                return None
            if sid[1] not in trace.real:
                return (self.at[("blk", full, *sid[2:])], 0)
            rep_trace, t = self.layout.reps[full]
            if not (rep_trace is trace and t == sid[1]):
                if boundary:
                    return None
                self._same_part(trace, sid, ("blk", full, *sid[2:]))
            return (self.at[("blk", full, *sid[2:])], k)
        if sid[0] == "gap":
            full = sid[1] + shift
            return (self.at[("blk", full, sid[2], "f")], END) if 0 <= full < self.count else None
        if sid[0] == "gapb" or sid == BASE or (boundary and shift):
            return None
        return (self.at[sid], k)

    def _same_part(self, trace: Trace, sid: Sid, full: Sid) -> None:
        source, tsid, _ = self.source(full)
        mine, theirs = trace.parts.get(sid), source.parts.get(tsid)
        sizes = lambda t, part: [t.stores[s].nbytes for s in part.allocs] if part else []  # noqa: E731
        if sizes(trace, mine) != sizes(source, theirs):
            raise NotComposable("a block's neighbours differ from those it was traced with")

    def seen(self, trace: Trace, serial: int, shift: int, store: tuple | None = None, boundary: bool = False) -> None:
        """Note where `trace` saw `serial` let go and re-labelled, seen `shift` away (`boundary`: it crosses
        between blocks, so only the parts of whoever holds it in the full step may say: `position`)."""
        stored = trace.stores[serial]
        store = store or self.store(trace, serial, shift)
        if stored.freed is not None:
            at = self.position(trace, *stored.freed, shift, boundary)
            if at is not None and (store not in self.frees or at > self.frees[store]):
                self.frees[store] = at
        for sid, k, category in stored.labels[1:]:  # the first is its category when made
            at = self.position(trace, sid, k, shift)
            if at is not None:
                self.labels.setdefault(store, []).append((at, category))

    def observe(self) -> None:
        """Every trace's view of what its real blocks, and (the absolute trace) the model's own code, let go."""
        for i, (trace, t) in enumerate(self.layout.reps):
            edges, roles = self.composer.edges(trace, t), self.composer.boundary_roles(trace, t)
            for serial in self.composer.around(trace, t):
                self.seen(trace, serial, i - t, self._given(roles, t, serial, i), serial in edges)
            for copy, shared in trace.copies.items():  # when this block lets go of an input it shares
                stored = trace.stores[copy]
                if stored.owner[1] == t and stored.freed is not None:
                    at = self.position(trace, *stored.freed, i - t)
                    store = self._given(roles, t, shared, i) or self.store(trace, shared, i - t)
                    if at is not None and (store not in self.frees or at > self.frees[store]):
                        self.frees[store] = at
        self._passed_on()
        absolute = self.layout.absolute
        edges = self.composer.edges(absolute, None)
        for serial in _outside_blocks(absolute, edges):
            self.seen(absolute, serial, 0, boundary=serial in edges)
        update = self.layout.update
        for serial, stored in enumerate(update.stores):
            if stored.owner != ("head",) and (stored.owner in (BASE, ("update",)) or stored.freed is not None):
                if stored.owner == BASE and stored.freed is None and not any(s[0] == ("update",) for s in stored.labels):
                    continue
                self.seen(update, serial, 0)
        self._gradients()

    def _passed_on(self) -> None:
        """What a block returns and the next is given lives at least until the next block's forward returns
        (its call holds it): a trace whose next block is real and holds it longer cannot say when it would
        otherwise go, which is then when the model's loop lets go of it."""
        for m in range(1, self.layout.micro_batches + 1):
            for block in range(self.count - 1):
                at = (self.at[("blk", block + 1, m, "f")], END)
                for leaf in self._wired(block, m):
                    store = self.output(block, m, leaf)
                    if store not in self.frees or at > self.frees[store]:
                        self.frees[store] = at

    def _given(self, roles: dict, t: int, serial: int, block: int) -> tuple | None:
        """The full step's name of a boundary tensor of representative `t` standing for `block`: the gradient
        that arrives for its output, the one it computes for its input, and its input (its predecessor's
        output, or the embedding's for the first block); None for the rest (named by who made them).
        `roles`: what each serial is at `t`'s boundary (`Composer.boundary_roles`)."""
        if block == t:
            return None  # the representative stands for itself: its trace names its boundary
        for m, kind, leaf in roles.get(serial, ()):
            if m > self.layout.micro_batches:
                break
            if kind == "dout":
                return self.arriving(block, m, leaf)
            if kind == "din":
                return self.gradient_in(block, m, leaf)
            if block == 0:  # the first block's inputs are the embedding's: the absolute trace's
                absolute = self.layout.absolute
                return self.store(absolute, absolute.boundaries[(0, m)].inputs[leaf], 0)
            fed = self._fed(block - 1, m).get(leaf)
            if fed is not None:
                return self.output(block - 1, m, fed)
        return None

    def _fed(self, block: int, m: int) -> dict[int, int]:
        """Which output leaf of `block` each input leaf of block+1 is (`_wired` turned round)."""
        key = ("fed", block, m)
        if key not in self.wiring:
            self.wiring[key] = {into: out for out, into in self._wired(block, m).items()}
        return self.wiring[key]

    def _gradients(self) -> None:
        """A parameter's gradient is let go where the update lets go of its placeholder."""
        update, blocks = self.layout.update, self.composer.blocks(self.layout.plan)
        released = {index: update.stores[serial].freed for index, serial in update.grads.items()}
        owner = {id(p): (b.index, q) for b in blocks for q, p in enumerate(self.composer.block_parameters(b))}
        for index, param in enumerate(self.composer.params):
            if index not in released or released[index] is None:
                continue
            if id(param) in owner:
                block, q = owner[id(param)]
                trace, t = self.layout.reps[block]
                theirs = self.composer.param_index[id(self.composer.block_parameters(blocks[t])[q])]
                serial, shift = trace.grads.get(theirs), block - t
            else:
                trace, serial, shift = self.layout.absolute, self.layout.absolute.grads.get(index), 0
            if serial is None:
                raise NotComposable("a parameter has a gradient in the update but none in the backward")
            store = self.store(trace, serial, shift)
            self.frees[store] = self.position(update, *released[index], 0)

    # --- the result --------------------------------------------------------------------------------

    def events(self) -> tuple[list, int, dict[int, str], list]:
        """(events, baseline, first category of each allocation by event index, re-labels): the composed
        allocations and frees in order as `(key, bytes, device)`, re-labels as `(events so far, key, category)`."""
        self.observe()
        out = _Emitted()
        for stored in self.layout.update.stores:
            if stored.owner == BASE:
                out.allocate_base((BASE, stored.ordinal), stored, self.composer.device(stored.device))
        baseline = len(out.events)
        pending: dict[int, dict[int, list]] = {}  # part's place -> allocations made -> frees and re-labels
        for store, changes in self.labels.items():  # a re-label placed where its storage goes came before it
            for at, category in changes:
                pending.setdefault(at[0], {}).setdefault(at[1], []).append(("label", store, category))
        for store, at in self.frees.items():
            pending.setdefault(at[0], {}).setdefault(at[1], []).append(("free", store))
        for sid in self.order:
            trace, tsid, _ = self.source(sid)
            n, begun = self.at[sid], len(out.events)
            here = pending.pop(n, {})
            out.flush(here.pop(0, ()))
            out.emit(sid, self.composer.allocations(trace, tsid), here)
            for k in sorted(here):
                if k == END:
                    self.cuts[sid] = (begun, len(out.events))
                out.flush(here[k])
            self.cuts.setdefault(sid, (begun, len(out.events)))
        if out.early:
            raise NotComposable("a storage was placed as let go before it was made")
        unfreed = [store for store in out.freed_in_trace() if store not in self.frees]
        if unfreed:
            raise NotComposable(f"no trace saw where {len(unfreed)} storage(s) are let go")
        return out.events, baseline, out.initial, out.labels

    def work(self) -> StepWork:
        """The op clock's records of every part, blocks renumbered as the full step's."""
        recipe = self.composer.estimator.recipe
        work = StepWork(world_size=self.composer.estimator.world_size, matmul_tf32=bool(recipe.tf32),
                        conv_tf32=recipe.tf32 is not False)
        computed = {"first": 0, "repeat": 0}  # compute ops so far, per micro-batch kind: where a collective runs
        for sid in self.order:
            trace, tsid, shift = self.source(sid)
            part = trace.parts.get(tsid)
            if part is None:
                continue
            work.collectives += [replace(c, position=computed[c.kind] + before) for before, c in part.collectives]
            for op in part.ops:
                computed[op.kind] += op.phase != "update"
            if shift and sid[0] == "blk":
                ops, to_host = self.composer.renumbered(part, shift)
                work.ops += ops
                work.to_host += to_host
            else:
                work.ops += part.ops
                work.to_host += part.to_host
            work.update_copies += part.update_copies
            work.gradients_to_host += part.gradients_to_host
        plan, batch = self.layout.plan, recipe.train.batch_size
        hosted = self.layout.update.host_work[batch // micro_batch_of(plan, batch)]
        if hosted:
            work.host_updates.append(("first" if self.layout.micro_batches == 1 else "repeat", "update", hosted))
        return work

    def estimate(self, over: int | None = None) -> Estimate:
        """The plan's estimate; what only its parts decide (the events, the live peak, the step's work and
        time) is kept per set of parts, so plans that differ in the allocator or the cap alone reuse it.
        `over`: see `Composer.estimate`."""
        estimator, layout = self.composer.estimator, self.layout
        key = (tuple((id(trace), t) for trace, t in layout.reps), id(layout.absolute), id(layout.update),
               layout.micro_batches)
        made = self.composer.made.get(key)
        if made is None:
            made = self.composer.made[key] = self._made()
            while len(self.composer.made) > MADE_KEPT:
                self.composer.made.pop(next(iter(self.composer.made)))
        composed, baseline, self.cuts, timed = made
        self.emitted = composed.events
        plan, precision = layout.plan, layout.precision
        if over is not None and estimator.cuda and composed.peak_bytes > over:
            return Estimate(composed.peak_bytes, composed.breakdown_at_peak, [
                f"over {format_bytes(over)} by its live tensors alone ({format_bytes(composed.peak_bytes)}): the caching "
                "allocator's reserve, which holds at least as much, is not replayed"], composed.peak_bytes, "cuda",
                **timed)
        estimate = estimator._result(composed, baseline, plan, precision, estimator._optimizing(plan))
        estimate.notes.extend(estimator.routed.notes())
        estimate.warnings.extend(dict.fromkeys(w for trace in self._traces() for w in trace.warnings))
        return replace(estimate, **timed)

    def _made(self) -> tuple:
        events, baseline, initial, labels = self.events()
        return _replayed(events, initial, labels), baseline, dict(self.cuts), self.timed()

    def timed(self) -> dict:
        """The step's work, shape and time on the estimator's device ({} without its facts): no storage placed."""
        estimator = self.composer.estimator
        if estimator.facts is None:
            return {}
        micro = micro_batch_of(self.layout.plan, estimator.recipe.train.batch_size)
        shape, work = estimator._shape(micro, self.layout.precision), self.work()
        return {"work": work, "shape": shape, "time": step_time(work, shape, estimator.facts)}

    def _traces(self) -> list[Trace]:
        return list({id(t): t for t in [*(trace for trace, _ in self.layout.reps), self.layout.absolute]}.values())


class _Emitted:
    """The composed events as they are written. A part's allocations are keyed in a run (`emit`): its store
    (part, k) is the part's first key plus k - 1, its size and device read off the part's `Allocations`."""

    def __init__(self):
        self.events: list[tuple[int, int, torch.device]] = []
        self.initial: dict[int, str] = {}
        self.labels: list[tuple[int, int, str]] = []
        self.early: list[tuple] = []
        self.base: dict[tuple, tuple[int, int, torch.device]] = {}  # a storage from before the step -> (key, bytes, device)
        self.parts: dict[tuple, tuple[int, Allocations, int]] = {}  # part -> (its first key, its allocations, made so far)
        self.count = 0  # keys given

    def allocate_base(self, store: tuple, stored, device: torch.device) -> None:
        self.base[store] = (self.count, stored.nbytes, device)
        if stored.labels:
            self.initial[len(self.events)] = stored.labels[0][2]
        self.events.append((self.count, stored.nbytes, device))
        self.count += 1

    def emit(self, sid: tuple, made: Allocations, here: dict[int, list]) -> None:
        """The part's allocations in order, after its k-th what `here[k]` holds (taken out of `here`)."""
        first, events, initial, sizes, devices, labels = self.count, self.events, self.initial, made.sizes, made.devices, made.labels
        done = 0
        for k in [*sorted(k for k in here if 0 < k <= len(sizes)), len(sizes)]:
            for j in range(done, k):
                if labels[j] is not None:
                    initial[len(events)] = labels[j]
                events.append((first + j, sizes[j], devices[j]))
            done = k
            self.parts[sid] = (first, made, done)
            self.flush(here.pop(k, ()))
        self.count = first + len(sizes)

    def _find(self, store: tuple) -> tuple[int, int, torch.device] | None:
        """(key, bytes, device) of a storage allocated so far, or None."""
        found = self.parts.get(store[0])
        if found is None:
            return self.base.get(store)
        first, made, done = found
        k = store[1]
        return (first + k - 1, made.sizes[k - 1], made.devices[k - 1]) if 0 < k <= done else None

    def flush(self, items) -> None:
        for item in items:
            found = self._find(item[1])
            if found is None:
                self.early.append(item[1])
            elif item[0] == "free":
                self.events.append((found[0], -found[1], found[2]))
            else:
                self.labels.append((len(self.events), found[0], item[2]))

    def freed_in_trace(self) -> list[tuple]:
        """The storages allocated that their trace saw let go (one from before the step: none)."""
        return [(sid, k) for sid, (_, made, done) in self.parts.items() for k in made.freed if k <= done]


@dataclass(frozen=True)
class Allocations:
    """A traced part's allocations as a composition writes them (`Composer.allocations`: made once per part): per
    allocation its bytes, device and first category (None: none), and which of them (k from 1) its trace saw let go."""

    sizes: list[int]
    devices: list[torch.device]
    labels: list[str | None]
    freed: list[int]


def allocations(trace: Trace, tsid: tuple, device) -> Allocations:
    """`Allocations` of a trace's part (none where it has no such part); `device(name)` gives one object per name."""
    part = trace.parts.get(tsid)
    stored = [trace.stores[serial] for serial in part.allocs] if part is not None else []
    return Allocations([s.nbytes for s in stored], [device(s.device) for s in stored],
                       [s.labels[0][2] if s.labels else None for s in stored],
                       [k for k, s in enumerate(stored, 1) if s.freed is not None])


def trace_around(trace: Trace, t: int) -> list[int]:
    """The serials a representative block's own work touches: what it allocates, what is let go or
    re-labelled during its parts, and its boundary tensors."""
    mine = {sid for sid in trace.parts if sid[0] == "blk" and sid[1] == t}
    serials = []
    for serial, stored in enumerate(trace.stores):
        if stored.owner[0] == "copies":
            continue  # a shared input's own copy: `_Composition.observe` reads when it goes
        if stored.owner in mine or (stored.freed is not None and stored.freed[0] in mine) or \
                any(sid in mine for sid, _, _ in stored.labels):
            serials.append(serial)
    for (block, _), boundary in trace.boundaries.items():
        if block == t:
            serials += [s for s in (*boundary.inputs, *boundary.outputs, *boundary.din.values(), *boundary.dout.values())
                        if s is not None]
    return list(dict.fromkeys(serials))


def _outside(sid: Sid) -> bool:
    """A part of the model's own code or the step's (embedding, head, loss, the step's head and tail)."""
    return sid[0] not in ("blk", "gap", "gapb", "copies") and sid != BASE


def _outside_blocks(trace: Trace, edges: set[int]) -> list[int]:
    """Serials the model's own code (embedding, head, loss, the step's head and tail) makes, and the
    blocks' boundary tensors it lets go or re-labels (what a block makes on its own, its trace says)."""
    return [serial for serial, stored in enumerate(trace.stores)
            if _outside(stored.owner) or (serial in edges and (
                (stored.freed is not None and _outside(stored.freed[0])) or any(_outside(sid) for sid, _, _ in stored.labels)))]


def _replayed(events: list, initial: dict[int, str], labels: list) -> _Bytes:
    """Live bytes per device over the composed events, as the tracker counts them: the peak of the step's
    device and the bytes per category at that peak, and each device's peak (a loop over every event of
    the step, for each plan composed: its names are bound once, the device's name looked up once)."""
    totals: dict[str, int] = {}
    peaks: dict[str, int] = {}
    category: dict[int, str] = {}
    size: dict[int, int] = {}
    where: dict[int, str] = {}
    names: dict = {}
    by_category = dict.fromkeys(CATEGORIES, 0)
    peak, breakdown, at, device_name = 0, dict(by_category), 0, str(CPU)
    most = dict(by_category)
    next_label = labels[0][0] if labels else len(events)
    for index, (key, nbytes, device) in enumerate(events):
        if next_label <= index:
            while at < len(labels) and labels[at][0] <= index:
                _, relabelled, new = labels[at]
                if relabelled in category and where[relabelled] == device_name:
                    by_category[category[relabelled]] -= size[relabelled]
                    by_category[new] += size[relabelled]
                    most[new] = max(most[new], by_category[new])
                if relabelled in category:
                    category[relabelled] = new
                at += 1
            next_label = labels[at][0] if at < len(labels) else len(events)
        name = names.get(device)
        if name is None:
            name = names[device] = str(device)
        total = totals[name] = totals.get(name, 0) + nbytes
        if total > peaks.setdefault(name, 0):
            peaks[name] = total
        if nbytes > 0:
            category[key], size[key], where[key] = initial.get(index, "activations"), nbytes, name
        if name == device_name:
            kind = category[key]
            now = by_category[kind] = by_category[kind] + nbytes
            if now > most[kind]:
                most[kind] = now
            if total > peak:
                peak, breakdown = total, dict(by_category)
        if nbytes < 0:
            category.pop(key, None)
    return _Bytes(events, peak, breakdown, peaks, most)
