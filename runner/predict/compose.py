"""A plan's prediction composed from parts: what the whole-model fake step would say, at the cost of a
few traced blocks.

`Composer.estimate(plan, precision)` returns the `Estimate` that `Estimator.estimate` gives for the same
plan (tests/runner/predict/test_compose.py holds the two equal: the peak to the byte, the time within
1 %), from traces (runner/predict/parts.py) that are made once and shared between plans:

- each block gets a signature: its kind (class, parameters, what it is given) and its action under the
  plan (kept; recomputed, and which ops' outputs its recompute keeps; its parameters' backward hooks);
  where activation offload moves a block's tensors, the signatures of the two blocks on either side
  too, since offload's schedule releases a block's copies two blocks on and fetches one block back;
- blocks with one signature do the same work: the first of them, traced once with the blocks around
  it as the signature asks and relays elsewhere, stands for all of them (its "representative");
- a trace per set of plan settings the blocks depend on (everything but the per-block actions, the
  allocator and the cap; the optimizer's settings only where it acts inside the backward), and a trace
  of the update per optimizer setting.

Composing is placing storages in time. The step is the sequence of parts (head; per micro-batch the
embedding, each block's forward, the head and loss, their backward, each block's backward in reverse,
the embedding's backward and the tail; the update; the end), each copied from its trace. A storage a
part allocates is named by that part and its number there. Storages that cross parts are joined by
what they are: a block's input is its predecessor's output, the gradient arriving for its output is
what its successor computes for its input (the head's backward for the last block), a parameter's
gradient is freed where the update lets it go. A storage is freed at the latest point any trace saw it
released: a relay holds nothing, so each trace shows when its real blocks and the model's own code let
go (a real block is given its own copy of what the model or another real block holds too: a kept block
holding its output would hide when its real successor lets go of it), and the latest of them is the whole
step's. The composed allocations and frees then go through the same reporting as the estimator's (live
peak and breakdown; on CUDA the caching allocator's replay).

Where a plan or model is outside this (the model runs code between its blocks, a block runs twice, a
region of blocks checkpointed as one, adaptive plans, ranks), the composer says why and the caller
runs the whole-model step (`Composer.estimate` does so itself, and says it in a note).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import replace

import torch

from ..memory.blocks import find_blocks
from ..plan.memory_plan import LayerListCheckpointing, MemoryPlan, NoCheckpointing
from ..recipe.recipe import Precision as PrecisionName
from .estimate import CPU, HOST, Estimate, EstimateUnavailable, micro_batch_of
from .parts import PartsEstimator, Trace, trace_step, trace_update
from .placement import Composition, Layout, NotComposable, allocations, trace_around
from .relays import parameter_signature
from .roofline import AFTER_BLOCKS

log = logging.getLogger(__name__)

OPTIMIZER_POOLS = ("optimizer_state", "gradients")  # pools that only the update touches, unless it hooks the backward


class Composer:
    """Predictions of many plans of one recipe from shared traces (module docstring)."""

    ranks = False  # whether one of several ranks' steps compose here (runner/predict/rank_parts.py)

    def __init__(self, estimator: PartsEstimator, neighbours: int = 0, tracer: Tracer | None = None):
        """`neighbours`: how many blocks on either side of a block are traced real beside it, because their
        work lands in its parts (one of several ranks: runner/predict/rank_parts.py); then the embedding's and
        head's parts are traced per plan, since what they hand to the blocks is let go inside them. `tracer`
        makes the traces (`Tracer`: here, unless a second process made one already)."""
        self.estimator, self.neighbours = estimator, neighbours
        self.tracer = tracer or Tracer()
        self.model = estimator.model
        self.templates: dict = {}  # relays' output layouts, by block kind and input
        self.found: dict[str | None, object] = {}
        self.represented: dict[tuple, tuple[Trace, int]] = {}  # (parts key, signature) -> (trace, block)
        self.absolute: dict[str, Trace] = {}  # parts key -> the trace whose head, embedding and loss serve
        self.inputs: dict[str, dict[int, tuple]] = {}  # parts key -> what each block is given
        self.updates: dict[tuple, Trace] = {}
        self.hooked: dict[tuple, bool] = {}
        self._around: dict[tuple, object] = {}
        self.made: dict[tuple, tuple] = {}  # a composition's parts -> what they decide (`_Composition.estimate`)
        self.traces = 0  # traces made so far (each a fake step of a few real blocks)
        self.traced_s: list[float] = []  # the seconds each took
        self.params = list(self.model.parameters())
        self.frozen = any(not p.requires_grad for p in self.params)
        self.param_index = {id(p): i for i, p in enumerate(self.params)}

    # --- the answer --------------------------------------------------------------------------------

    def estimate(self, plan: MemoryPlan, precision: PrecisionName | None = None, over: int | None = None) -> Estimate:
        """The plan's estimate composed from parts; where it cannot be, the whole-model step's, saying why.
        `over`: a peak above which the caller needs no more than that (a tuner screening against its cap): a
        plan whose live tensors alone pass it gets their peak, without the caching allocator's replay."""
        precision = precision or self.estimator.recipe.precision
        self.estimator.check(plan, precision)
        try:
            return self.composed(plan, precision, over)
        except NotComposable as why:
            log.info("prediction: %s not composed from parts (%s): the whole-model fake step", plan.checkpointing.label(), why)
            estimate = self.estimator.estimate(plan, precision)
            estimate.notes.append(f"the whole-model fake step (not composed from parts: {why})")
            return estimate

    def step_time(self, plan: MemoryPlan, precision: PrecisionName | None = None):
        """The plan's predicted step time alone (`StepTime`, the figure `estimate` gives it), its parts' work
        priced and no storage placed: a fraction of a composition (an exhaustive search orders plans by it)."""
        precision = precision or self.estimator.recipe.precision
        self.estimator.check(plan, precision)
        try:
            return self._composition(plan, precision).timed().get("time")
        except NotComposable:
            return self.estimate(plan, precision).time

    def composed(self, plan: MemoryPlan, precision: PrecisionName, over: int | None = None) -> Estimate:
        return self._composition(plan, precision).estimate(over)

    def _composition(self, plan: MemoryPlan, precision: PrecisionName) -> Composition:
        layout = self._layout(plan, precision)
        self._represent(layout)
        return Composition(self, layout)

    def block_bytes(self, plan: MemoryPlan, precision: PrecisionName) -> tuple[Estimate, list[int], list[int]]:
        """(the estimate, per block the device bytes and the host bytes its first forward leaves), as
        runner/predict/block_costs.py's `block_bytes` reads them from hooks, here from the composition."""
        self.estimator.check(plan, precision)
        try:
            composition = self._composition(plan, precision)
            estimate = composition.estimate()
        except NotComposable:
            from .block_costs import block_bytes

            return block_bytes(self.estimator, plan, precision)  # the whole-model step, read by hooks
        events, count = composition.emitted, len(composition.layout.signatures)
        live = {str(CPU): [0], str(HOST): [0]}
        for _, nbytes, device in events:
            for name, totals in live.items():
                totals.append(totals[-1] + (nbytes if str(device) == name else 0))
        left = {name: [totals[composition.cuts[("blk", i, 1, "f")][1]] - totals[composition.cuts[("blk", i, 1, "f")][0]]
                       for i in range(count)] for name, totals in live.items()}
        return estimate, left[str(CPU)], left[str(HOST)]

    # --- what the per-block cost table reads (runner/predict/block_costs.py) ------------------------

    @property
    def recipe(self):
        return self.estimator.recipe

    @property
    def cuda(self) -> bool:
        return self.estimator.cuda

    @property
    def facts(self):
        return self.estimator.facts

    def renumbered(self, part, shift: int) -> tuple[list, list]:
        """A block part's op clock records as the block `shift` further on (made once per part and shift)."""
        key = ("ops", id(part), shift)
        if key not in self._around:
            self._around[key] = (
                [op if op.block is None or op.block == AFTER_BLOCKS else replace(op, block=op.block + shift)
                 for op in part.ops],
                [(kind, block + shift if block is not None and block >= 0 else block, nbytes)
                 for kind, block, nbytes in part.to_host])
        return self._around[key]

    def edges(self, trace: Trace, t: int | None) -> set[int]:
        """The serials of block `t`'s boundary tensors (inputs, outputs, their gradients); every block's for None."""
        key = ("edges", id(trace), t)
        if key not in self._around:
            self._around[key] = {s for (block, _), b in trace.boundaries.items() if t is None or block == t
                                 for s in (*b.inputs, *b.outputs, *b.din.values(), *b.dout.values()) if s is not None}
        return self._around[key]

    def boundary_roles(self, trace: Trace, t: int) -> dict[int, list[tuple[int, str, int]]]:
        """Per serial, what it is at representative `t`'s boundary, in the order `Composition._given` asks:
        by micro-batch, the gradient arriving for an output leaf ("dout"), the one leaving for an input leaf
        ("din"), an input leaf ("inputs"); each the first leaf of its kind (made once per trace and block)."""
        key = ("roles", id(trace), t)
        if key not in self._around:
            roles: dict[int, list] = {}
            for m in sorted(m for block, m in trace.boundaries if block == t):
                boundary = trace.boundaries[(t, m)]
                for kind, leaves in (("dout", boundary.dout.items()), ("din", boundary.din.items()),
                                     ("inputs", enumerate(boundary.inputs))):
                    first: dict[int, int] = {}
                    for leaf, serial in leaves:
                        first.setdefault(serial, leaf)
                    for serial, leaf in first.items():
                        roles.setdefault(serial, []).append((m, kind, leaf))
            self._around[key] = roles
        return self._around[key]

    def allocations(self, trace: Trace, tsid: tuple):
        """A traced part's allocations as a composition writes them (placement.py `Allocations`), made once."""
        key = ("allocations", id(trace), tsid)
        if key not in self._around:
            self._around[key] = allocations(trace, tsid, self.device)
        return self._around[key]

    def device(self, name: str) -> torch.device:
        """One device object per name: the allocator's replay looks a device's name up by it."""
        key = ("device", name)
        if key not in self._around:
            self._around[key] = torch.device(name)
        return self._around[key]

    def around(self, trace: Trace, t: int) -> list[int]:
        key = (id(trace), t)
        if key not in self._around:
            self._around[key] = trace_around(trace, t)
        return self._around[key]

    def ready(self, plan: MemoryPlan, precision: PrecisionName | None = None) -> bool:
        """Whether `plan` composes from what is traced already: no trace to make, no optimizer to warm up
        (a search prices such plans first: each costs a fraction of a trace)."""
        precision = precision or self.estimator.recipe.precision
        if self._not_composed(plan) or self.estimator.optimizer_key(plan) not in self.estimator._optimizers:
            return False
        try:
            self.estimator.check(plan, precision)
            key = self._parts_key(plan, precision)
            if key not in self.absolute:
                return False
            layout = Layout(plan, precision, key, 1 if micro_batch_of(plan, self.estimator.recipe.train.batch_size)
                             >= self.estimator.recipe.train.batch_size else 2, *self._signatures(plan, key))
        except ValueError:
            return False
        if any((key, signature) not in self.represented for signature in layout.signatures):
            return False
        self._place(layout)
        return self._update_key(layout) in self.updates

    # --- which traces a plan needs -------------------------------------------------------------------

    def _not_composed(self, plan: MemoryPlan) -> str | None:
        return _not_composed(plan, self.estimator, self.ranks)

    def blocks(self, plan: MemoryPlan):
        if plan.blocks not in self.found:
            self.found[plan.blocks] = find_blocks(self.model, plan.blocks)
        return self.found[plan.blocks]

    def _layout(self, plan: MemoryPlan, precision: str) -> Layout:
        why = self._not_composed(plan)
        if why:
            raise NotComposable(why)
        batch = self.estimator.recipe.train.batch_size
        micro = micro_batch_of(plan, batch)
        key = self._parts_key(plan, precision)
        return Layout(plan, precision, key, 1 if micro >= batch else 2, *self._signatures(plan, key))

    def _parts_key(self, plan: MemoryPlan, precision: str) -> str:
        """What the blocks', embedding's and loss's parts depend on: the plan but its per-block actions (with
        `neighbours`, them too), the allocator and the cap, and the optimizer's pools unless the optimizer hooks
        the backward."""
        per_block = set() if self.neighbours else {"checkpointing", "offload"}
        data = plan.model_dump(mode="json", exclude={*per_block, "allocator", "max_mem", "allow_lossy", "compile",
                                                     "activation_memory_budget"})
        if not self._hooks_backward(plan):
            for policy in plan.pool_policies():
                if policy.pool in OPTIMIZER_POOLS:
                    data.pop(policy.section, None)
        return json.dumps({"plan": data, "precision": precision}, sort_keys=True)

    def _hooks_backward(self, plan: MemoryPlan) -> bool:
        """Whether the plan's optimizer acts inside the backward (a parameter's post-accumulate-grad hook)."""
        key = tuple(policy.model_dump_json() for policy in plan.pool_policies()) + (plan.micro_batch,)
        if key not in self.hooked:
            planned = self.estimator._optimizing(plan)
            planned.install()
            try:
                self.hooked[key] = any(getattr(p, "_post_accumulate_grad_hooks", None) for p in self.params)
            finally:
                planned.remove()
        return self.hooked[key]

    def _kind(self, block) -> tuple:
        """A block's class and parameters (as built: no plan is applied between traces), made once."""
        key = ("kind", block.name)
        if key not in self._around:
            self._around[key] = (type(block.module).__qualname__, parameter_signature(block.module))
        return self._around[key]

    def block_parameters(self, block) -> list:
        """A block's parameters, listed once."""
        key = ("parameters", block.name)
        if key not in self._around:
            self._around[key] = list(block.module.parameters())
        return self._around[key]

    def _parameter_hooks(self, plan: MemoryPlan, blocks) -> dict[int, tuple[bool, ...]]:
        """Per block, which of its parameters the plan's optimizer hooks in the backward (an offloaded
        fraction's: the first parameters by bytes)."""
        planned = self.estimator._optimizing(plan)
        planned.install()
        try:
            return {b.index: tuple(bool(getattr(p, "_post_accumulate_grad_hooks", None)) for p in self.block_parameters(b))
                    for b in blocks}
        finally:
            planned.remove()

    def _signatures(self, plan: MemoryPlan, key: str) -> tuple[list[tuple], list[tuple[int, int]]]:
        """Per block its signature and its window: the blocks traced beside its representative (module
        docstring): its region where a region of blocks is checkpointed as one, and two blocks on either
        side where offload moves its tensors (its signature holds theirs, and where the model ends)."""
        blocks = self.blocks(plan)
        count, policy = len(blocks), plan.checkpointing
        chosen = set(policy.chosen(blocks))
        regions = {j: (region[0], region[-1]) for region in policy.regions(blocks) for j in region} \
            if policy.spans_blocks else {}
        moved = set(plan.offload.chosen(blocks)) if plan.offload.moves else set()
        action = ("region",) if policy.spans_blocks else \
            ("recompute", tuple(sorted(policy.kept_ops() or ())), policy.kept_product_stride())
        hooks = self._parameter_hooks(plan, blocks) if self._hooks_backward(plan) else {}
        inputs = self.inputs.get(key, {})
        own = [(*self._kind(block), inputs.get(block.index), action if block.index in chosen else ("keep",),
                block.index in moved, hooks.get(block.index, ())) for block in blocks]
        reach = max(2 if plan.offload.moves else 0, self.neighbours)
        windows = [(min(regions.get(i, (i, i))[0], i - reach), max(regions.get(i, (i, i))[1], i + reach))
                   for i in range(count)]
        signatures = [(i - lo, tuple(own[j] if 0 <= j < count else None for j in range(lo, hi + 1)))
                      for i, (lo, hi) in enumerate(windows)]
        return signatures, [(max(lo, 0), min(hi, count - 1)) for lo, hi in windows]

    def _represent(self, layout: Layout) -> None:
        """Trace what the plan's blocks need and is not traced yet; a first trace of a parts key learns
        what each block is given, which may show kinds it had not told apart (then one more trace)."""
        for _ in range(3):
            wanted = self._wanted(layout)
            if wanted is None:
                break
            self._trace(layout, *wanted)
        else:
            raise NotComposable("its blocks' inputs changed between traces")
        self._place(layout)
        layout.update = self._update(layout)

    def _place(self, layout: Layout) -> None:
        """Give a layout whose blocks are all represented its representatives and the trace of its head."""
        layout.reps = [self.represented[(layout.key, signature)] for signature in layout.signatures]
        layout.absolute = self.absolute[layout.key]

    def _wanted(self, layout: Layout, assumed: frozenset | set = frozenset()) -> tuple[MemoryPlan, set[int], set[int]] | None:
        """The next trace the layout needs (the plan to trace, its real blocks, the blocks it represents), or None
        where every block is represented (or `assumed` to be: (parts key, signature) pairs of traces to come)."""
        missing = [i for i, signature in enumerate(layout.signatures)
                   if (layout.key, signature) not in self.represented and (layout.key, signature) not in assumed]
        if not missing:
            return None
        first = {}
        for i in missing:
            first.setdefault(layout.signatures[i], i)
        traced, chosen = self._with_companion(layout, set(first.values()))
        signatures, windows = self._signatures(traced, layout.key)
        if layout.key not in self.inputs and self.frozen:
            # kinds not yet told apart by their inputs, and frozen parameters (an adapter's base) may give
            # the first of them an input that needs no gradient: the next of each is traced too
            chosen |= {i + 1 for i in chosen if i + 1 < len(signatures) and signatures[i + 1] == signatures[i]}
        real = {j for i in chosen for j in range(windows[i][0], windows[i][1] + 1)}
        return traced, real, chosen

    def next_trace(self, plan: MemoryPlan, precision: PrecisionName) -> tuple | None:
        """The first trace pricing `plan` would make now, named as `Tracer` is asked for it, with what it is
        given: ("step", key, plan to trace, precision, real blocks) or ("update", key, plan, precision, the
        parameters accumulated, micro-batches); None where it needs none, or is not composed. A search hands the
        traces of plans it will price next to a second process with it (autotune/probes/beside.py)."""
        return self.traces_ahead([(plan, precision)])[0]

    def traces_ahead(self, plans: list[tuple[MemoryPlan, PrecisionName]]) -> list[tuple | None]:
        """Per plan, the first trace pricing it would make (as `next_trace` names it) once the plans before it are
        priced, in this order: what their traces will represent is taken as traced. None where it needs none, or
        is not composed (its pricing says why); also after a plan whose parts key has no trace yet, for the later
        plans of that key, since that first trace learns what the blocks are given, which may tell their
        signatures apart differently."""
        assumed, unsettled, updates, ahead = set(), set(), set(), []
        for plan, precision in plans:
            try:
                self.estimator.check(plan, precision)
                layout = self._layout(plan, precision)
                ahead.append(None if layout.key in unsettled else self._first_wanted(layout, assumed, updates))
            except (NotComposable, ValueError, EstimateUnavailable):  # pricing it says why: no trace to name
                ahead.append(None)
                continue
            if ahead[-1] is not None and ahead[-1][0] == "step" and layout.key not in self.inputs:
                unsettled.add(layout.key)
        return ahead

    def _first_wanted(self, layout: Layout, assumed: set, updates: set) -> tuple | None:
        """`traces_ahead` for one layout, adding what its trace will represent to `assumed` (its update to
        `updates`)."""
        wanted = self._wanted(layout, assumed)
        if wanted is not None:
            traced, real, chosen = wanted
            signatures, _ = self._signatures(traced, layout.key)
            assumed.update((layout.key, signatures[i]) for i in chosen)
            return "step", trace_key(layout.key, traced, real), traced, layout.precision, frozenset(real)
        if any((layout.key, signature) not in self.represented for signature in layout.signatures):
            return None  # its blocks are represented by traces to come: its update's key is read off them
        self._place(layout)
        key = self._update_key(layout)
        if key in self.updates or key in updates:
            return None
        updates.add(key)
        return "update", ("update", *key), layout.plan, layout.precision, frozenset(key[-1]), layout.micro_batches

    def _with_companion(self, layout: Layout, chosen: set[int]) -> tuple[MemoryPlan, set[int]]:
        """The plan to trace, and its blocks to make real: the layout's own; where its blocks are kept or
        recomputed one by one and only one of the two is traced, a block with the other action beside them
        (the same trace then serves every plan that keeps some blocks and recomputes the rest)."""
        plan, blocks = layout.plan, self.blocks(layout.plan)
        policy = plan.checkpointing
        if plan.offload.moves or policy.spans_blocks or policy.kept_ops() is not None or len(blocks) < 2 or \
                self.neighbours:  # a companion would be a neighbour, and change the signature it is traced for
            return plan, chosen
        recomputed = set(policy.chosen(blocks))
        kept, redone = chosen - recomputed, chosen & recomputed
        if kept and redone:
            return plan, chosen
        companion = next((j for j in [max(chosen) + 1, *range(len(blocks))] if 0 <= j < len(blocks) and j not in chosen),
                         None)
        if companion is None:
            return plan, chosen
        layers = sorted(redone | ({companion} if kept else set()))
        checkpointing = LayerListCheckpointing(policy="layers", layers=layers) if layers else NoCheckpointing()
        return plan.model_copy(update={"checkpointing": checkpointing}), chosen | {companion}

    def trace_s(self) -> float:
        """What a trace has taken here (the median; 0 before the first): a caller with a deadline starts none
        with less time left (autotune/search/solver.py)."""
        return statistics.median(self.traced_s) if self.traced_s else 0.0

    def _trace(self, layout: Layout, traced: MemoryPlan, real: set[int], chosen: set[int]) -> None:
        started = time.monotonic()
        trace = self.tracer.step(trace_key(layout.key, traced, real), self.estimator, traced, layout.precision,
                                 frozenset(real), self.templates)
        self.traces += 1
        self.traced_s.append(time.monotonic() - started)
        if trace.problems:
            raise NotComposable("; ".join(trace.problems))
        if layout.key not in self.inputs:
            self.inputs[layout.key] = trace.signatures
            self.absolute[layout.key] = trace
            layout.signatures, layout.windows = self._signatures(layout.plan, layout.key)
        signatures, _ = self._signatures(traced, layout.key)
        for i in sorted(chosen):
            self.represented.setdefault((layout.key, signatures[i]), (trace, i))

    def _update(self, layout: Layout) -> Trace:
        """The update's trace for the plan's optimizer, after the gradients its blocks accumulate."""
        key = self._update_key(layout)
        if key not in self.updates:
            started = time.monotonic()
            self.updates[key] = self.tracer.update(("update", *key), self.estimator, layout.plan, layout.precision,
                                                   set(key[-1]), layout.micro_batches)
            self.traces += 1
            self.traced_s.append(time.monotonic() - started)
            if self.updates[key].problems:
                raise NotComposable("; ".join(self.updates[key].problems))
        return self.updates[key]

    def _update_key(self, layout: Layout) -> tuple:
        """What the update's trace depends on: the optimizer the plan asks for (`Estimator.optimizer_key`: not
        the loss's split nor autocast's cast cache, which only the forward and backward see), the micro-batches
        run and the parameters whose gradients the backward accumulates (read off the representatives)."""
        accumulated = set()
        blocks = self.blocks(layout.plan)
        for i, (trace, t) in enumerate(layout.reps):
            for mine, theirs in zip(self.block_parameters(blocks[i]), self.block_parameters(blocks[t]), strict=True):
                if self.param_index[id(theirs)] in trace.accumulated:
                    accumulated.add(self.param_index[id(mine)])
        in_blocks = {id(p) for b in blocks for p in self.block_parameters(b)}
        accumulated |= {i for i in layout.absolute.accumulated if id(self.params[i]) not in in_blocks}
        return (self.estimator.optimizer_key(layout.plan), layout.micro_batches, frozenset(accumulated))


class Tracer:
    """Makes a composer's traces, each named by a key that says all it depends on (`trace_key`): here, in this
    process. A search's second process (autotune/probes/beside.py) may have made one already: a subclass
    answers with it, which composes the same (what a trace holds beyond the key, the relays' learning of their
    output layouts, lands in parts no composition reads)."""

    def step(self, key: tuple, estimator: PartsEstimator, plan: MemoryPlan, precision: PrecisionName,
             real: frozenset[int], templates: dict) -> Trace:
        return trace_step(estimator, plan, precision, set(real), templates)

    def update(self, key: tuple, estimator: PartsEstimator, plan: MemoryPlan, precision: PrecisionName,
               accumulated: set[int], micro_batches: int) -> Trace:
        return trace_update(estimator, plan, precision, accumulated, micro_batches)


def trace_key(parts_key: str, traced: MemoryPlan, real: set[int]) -> tuple:
    """What a block trace depends on: the parts key (`Composer._parts_key`), the traced plan's per-block actions
    and its real blocks."""
    actions = traced.model_dump_json(include={"checkpointing", "offload"})
    return ("step", parts_key, actions, tuple(sorted(real)))


def trace_cost(request: tuple | None) -> int:
    """What the trace `Composer.next_trace` names costs, in blocks traced real: an update's counted as two (about
    its time beside a transformer block's), none as nothing. Orders plans to price (autotune/probes/priced.py)."""
    if request is None:
        return 0
    return len(request[4]) if request[0] == "step" else 2


def _not_composed(plan: MemoryPlan, estimator, ranks: bool = False) -> str | None:
    """Why a plan is not composed from parts, or None (`ranks`: a rank's composer, which composes them)."""
    if plan.adaptive:
        return "memory.adaptive switches plans per batch length"
    if (plan.sharding is not None or estimator.world_size > 1) and not ranks:
        return "the step of one of several ranks"
    if not hasattr(torch._C._autograd, "_get_sequence_nr"):
        return f"torch {torch.__version__} does not number autograd nodes where parts can read it"
    return None
