"""A step's parts: one fake step in which only a few blocks are real, cut where each part begins.

A plan's prediction is composed from parts (runner/predict/compose.py): the blocks of one kind and
action do the same work wherever they sit, so one of them, traced once, stands for all. A trace is
the estimator's own fake step (`Estimator.fake_step`: the plan applied by apply_plan, the training
step's `accumulate`, the tracker and the op clock) with every block but the chosen ones replaced by a
relay (runner/predict/relays.py): an autograd function that takes the block's inputs and returns fresh
outputs of the real block's shapes, and in backward fresh gradients for its inputs, holding nothing. Relays cost a few ops,
so a trace costs the embedding, head and loss and a few real blocks, not the depth of the model.

The trace is cut into parts as it runs:
- forward: the model's forward pre-hook starts a micro-batch ("pre": the embedding), each block's
  forward hooks bracket the block ("blk"); what runs after the last block is "post" (norm, head, loss);
- backward: each op belongs to the part whose forward created the autograd node now running (its
  sequence number: torch numbers nodes in the order they are made); an AccumulateGrad node stays in
  the part it follows; "tail" is what runs and goes once the engine has run every node (the gradient
  seed, the loss summed), "head" before the
  first forward (the loss's denominator), "end" what goes when the step returns;
- a separate trace of the update alone (`trace_update`): the gradients set, then clipping, the
  optimizer's step and the gradients let go, as `runner.train.step.update` runs them.

What each part allocates is numbered in its order (the "ordinal"), and every free and category change
is placed by the part it happens in and how many allocations that part had made. A block's boundaries
are recorded by tensor: the storages of its inputs and outputs, and of the gradients that arrive for
its outputs and leave for its inputs (tensor hooks, which hold no tensor): compose.py joins a real
block's boundary to its real neighbours' through them.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils._python_dispatch import TorchDispatchMode

from ..memory.blocks import BlockList, find_blocks, undo_all, wrap_forward
from ..plan.memory_plan import MemoryPlan
from ..recipe.recipe import Precision as PrecisionName
from ..train.step import Accumulated, Precision, accumulate, label_count, update
from .device_query import DEVICE_QUERY, fake_device
from .estimate import MICRO_BATCHES_RUN, Estimator, FakeRun, host_work, unavailable_on_fake_errors
from .relays import leaf_signature, relay_forward, storage_id

Sid = tuple  # a part: ("head",), ("pre", m, "f"|"b"), ("blk", j, m, "f"|"b"), ("gap", j, m), ("post", m, "f"|"b"),
# ("tail", m), ("update",), ("end",), and ("base",) for what existed before the step
ACCUMULATE_GRAD = 2**64 - 1  # the sequence number torch gives AccumulateGrad nodes (run first when ready)
BASE: Sid = ("base",)


@dataclass
class Stored:
    """One storage a trace saw: its size and device, the part that allocated it and its number there,
    where it was freed (part, allocations that part had made) or None, and its categories."""

    nbytes: int
    device: str
    owner: Sid
    ordinal: int
    freed: tuple[Sid, int] | None = None
    labels: list[tuple[Sid, int, str]] = field(default_factory=list)


@dataclass
class Part:
    """What one part allocated (serials, in order) and the ops it ran (the op clock's records)."""

    sid: Sid
    allocs: list[int] = field(default_factory=list)
    ops: list = field(default_factory=list)
    to_host: list = field(default_factory=list)
    gradients_to_host: list = field(default_factory=list)
    update_copies: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    """(compute ops of its micro-batch's kind this part ran before it, the collective): a rank's step's."""


@dataclass
class Boundary:
    """A block's boundary tensors in one micro-batch, as serials: its input and output leaves, the
    gradients that arrived for its outputs (`dout`) and left for its inputs (`din`), by leaf."""

    inputs: list[int | None] = field(default_factory=list)
    outputs: list[int | None] = field(default_factory=list)
    dout: dict[int, int] = field(default_factory=dict)
    din: dict[int, int] = field(default_factory=dict)


@dataclass
class Trace:
    """One traced step (module docstring)."""

    stores: list[Stored]
    parts: dict[Sid, Part]
    real: frozenset[int]
    micro_batches: int
    boundaries: dict[tuple[int, int], Boundary]
    """(block, micro-batch) -> its boundary tensors."""
    signatures: dict[int, tuple]
    """Block -> what it was given in the first micro-batch (shapes, dtypes, whether they need gradients)."""
    grads: dict[int, int]
    """Parameter index (model.parameters() order) -> the serial of its gradient when the update begins."""
    accumulated: frozenset[int]
    """Parameters whose gradient the backward accumulated (its hooks may have let it go since)."""
    problems: list[str]
    """Why this trace cannot be composed from (an empty list: it can)."""
    copies: dict[int, int] = field(default_factory=dict)
    """A real block's own copy of a shared input (serial, made in a "copies" part) -> the input (`Cutter._own_copies`)."""
    warnings: list[str] = field(default_factory=list)
    host_work: dict[int, int] = field(default_factory=dict)
    """An update's trace: micro-batches per step -> the host's work in the step (`estimate.host_work` of the trace's
    optimizer), for each count the recipe's batch splits into: a table, not the optimizer, so a trace pickles (a
    second process makes some: autotune/probes/beside.py). A block trace's is empty: no composition reads it."""


# --- cutting a step into its parts -------------------------------------------------------------------


class Cutter(TorchDispatchMode):
    """Follows the step from part to part (module docstring) and files the tracker's events and the op
    clock's records under the part they happen in."""

    def __init__(self, run: FakeRun, blocks: BlockList, real: frozenset[int] = frozenset(),
                 regions: list[list[int]] = ()):
        """`regions`: runs of blocks checkpointed as one (sqrt), within which a block is given what the block
        before it returned as it was (the region's replay finds it by identity)."""
        super().__init__()
        self.run, self.blocks, self.last, self.real = run, blocks, len(blocks) - 1, real
        self.region_of = {block: n for n, region in enumerate(regions) for block in region}
        self.copies: dict[int, int] = {}  # a real block's own copy of a shared input (serial) -> the input's
        self.sid: Sid = BASE
        self.micro = 0
        self.in_backward = False
        self.called: set[tuple[int, int]] = set()
        self.starts: list[int] = []  # sequence numbers at which forward parts began
        self.started: list[Sid] = []
        self.stores: list[Stored] = []
        self.parts: dict[Sid, Part] = {}
        self.serial: dict[int, int] = {}  # storage key -> its serial while it lives
        self.events_done = self.labels_done = 0
        self.ops_done = self.to_host_done = self.copies_done = self.gradients_done = self.collectives_done = 0
        self.computed = {"first": 0, "repeat": 0}  # compute ops filed so far, per micro-batch kind (a collective's position)
        self.boundaries: dict[tuple[int, int], Boundary] = {}
        self.signatures: dict[int, tuple] = {}
        self.problems: list[str] = []
        self.accumulated: set[int] = set()
        self.handles = []

    # --- parts ---------------------------------------------------------------------------------

    def enter(self, sid: Sid) -> None:
        self.catch_up()
        if sid == self.sid:
            return
        self.sid = sid
        self.parts.setdefault(sid, Part(sid))

    def mark_forward(self, sid: Sid) -> None:
        """A forward part begins: the autograd nodes made from here on are its."""
        self.enter(sid)
        self.starts.append(torch._C._autograd._get_sequence_nr())
        self.started.append(sid)

    def catch_up(self) -> None:
        """File the tracker's new events and labels, and the clock's new records, under the current part."""
        tracker, part = self.run.tracker, self.parts.get(self.sid)
        events, labels = tracker.events, tracker.labels
        for index in range(self.events_done, len(events)):
            while self.labels_done < len(labels) and labels[self.labels_done][0] <= index:
                self._label(labels[self.labels_done])
            key, nbytes, device = events[index]
            if nbytes > 0:
                self._allocated(key, nbytes, str(device), part)
            elif nbytes < 0:
                self._freed(key)  # (empty storages come and go without bytes: nothing to place)
        self.events_done = len(events)
        while self.labels_done < len(labels):
            self._label(labels[self.labels_done])
        clock = self.run.clock
        if clock is not None and part is not None:
            work = clock.work
            self._file_collectives(part, work)
            part.ops += work.ops[self.ops_done:]
            part.to_host += work.to_host[self.to_host_done:]
            part.update_copies += work.update_copies[self.copies_done:]
            part.gradients_to_host += work.gradients_to_host[self.gradients_done:]
            self.ops_done, self.to_host_done, self.copies_done = len(work.ops), len(work.to_host), len(work.update_copies)
            self.gradients_done = len(work.gradients_to_host)

    def _file_collectives(self, part: Part, work) -> None:
        """The clock's new collectives, each placed by the compute ops of its kind its part ran before it (the
        clock counts them from the micro-batch's start; the composition counts them again: placement.py)."""
        for collective in work.collectives[self.collectives_done:]:
            mine = sum(1 for op in part.ops if op.kind == collective.kind and op.phase != "update")
            part.collectives.append((mine + collective.position - self.computed[collective.kind], collective))
        self.collectives_done = len(work.collectives)
        for op in work.ops[self.ops_done:]:
            if op.phase != "update":
                self.computed[op.kind] += 1

    def _allocated(self, key: int, nbytes: int, device: str, part: Part | None) -> None:
        serial = len(self.stores)
        ordinal = len(part.allocs) + 1 if part is not None else serial + 1
        self.stores.append(Stored(nbytes, device, self.sid, ordinal))
        if part is not None:
            part.allocs.append(serial)
        self.serial[key] = serial

    def _freed(self, key: int) -> None:
        serial = self.serial.pop(key, None)
        if serial is None:
            self.problems.append("a storage was freed that the trace never saw allocated")
            return
        self.stores[serial].freed = (self.sid, self._position())

    def _label(self, label: tuple[int, int, str]) -> None:
        self.labels_done += 1
        _, key, category = label
        serial = self.serial.get(key)
        if serial is not None:
            self.stores[serial].labels.append((self.sid, self._position(), category))

    def _position(self) -> int:
        part = self.parts.get(self.sid)
        return len(part.allocs) if part is not None else 0

    def serial_of(self, tensor) -> int | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        key = storage_id(tensor)
        if key is None:
            self.problems.append("a block's boundary is a tensor subclass (DTensor, ...)")
            return None
        self.catch_up()
        return self.serial.get(key)

    # --- the dispatch mode: which backward part an op belongs to ---------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch._C._current_graph_task_id() != -1:
            if not self.in_backward:
                self.in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
            node = torch._C._current_autograd_node()
            if node is not None and node._sequence_nr() != ACCUMULATE_GRAD:
                self.enter(self._backward_part(node._sequence_nr()))
        elif self.in_backward:
            self.in_backward = False
            self.enter(("tail", self.micro))
        if func is DEVICE_QUERY and (device := fake_device(args)) is not None:
            return device  # the modes below have nothing to do with a read of a device (device_query.py)
        return func(*args, **(kwargs or {}))

    def _backward_ends(self) -> None:
        """The engine has run every node: what goes from here (the gradient seed `backward()` made, the graph
        task's own) is the tail's, not the last node's part, whose allocations differ between a kept and a
        recomputed block (with a frozen embedding that part is the first block's)."""
        self.enter(("tail", self.micro))
        self.in_backward = False

    def _backward_part(self, sequence_nr: int) -> Sid:
        at = bisect.bisect_right(self.starts, sequence_nr) - 1
        forward = self.started[at] if at >= 0 else ("head",)
        if forward[0] in ("pre", "post"):
            return (forward[0], forward[1], "b")
        if forward[0] == "blk":
            return ("blk", forward[1], forward[2], "b")
        return ("gapb", *forward[1:])

    # --- hooks ------------------------------------------------------------------------------------

    def install(self, model: torch.nn.Module) -> None:
        self.handles.append(model.register_forward_pre_hook(self._model_starts, prepend=True))
        for index, param in enumerate(model.parameters()):
            if param.requires_grad:
                self.handles.append(param.register_post_accumulate_grad_hook(
                    functools.partial(lambda i, _: self.accumulated.add(i), index)))
        for block in self.blocks:
            self.handles.append(block.module.register_forward_pre_hook(
                functools.partial(self._block_starts, block.index), with_kwargs=True, prepend=True))
            self.handles.append(block.module.register_forward_hook(
                functools.partial(self._block_ends, block.index), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _model_starts(self, *_):
        if self.sid[0] in ("blk", "gap"):
            self.problems.append("the model's forward is called from inside its blocks")
        self.micro += 1
        self.mark_forward(("pre", self.micro, "f"))

    def _block_starts(self, index: int, _module, args, kwargs):
        if (index, self.micro) in self.called:
            self.problems.append(f"block {index} ran twice in one forward")
        self.called.add((index, self.micro))
        self.mark_forward(("blk", index, self.micro, "f"))
        leaves, tree = tree_flatten((args, kwargs))
        if self.micro == 1:
            self.signatures[index] = leaf_signature(leaves)
        boundary = self.boundaries[(index, self.micro)] = Boundary([self.serial_of(x) for x in leaves])
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(functools.partial(self._gradient, boundary.din, k))
        if index in self.real:
            return self._own_copies(index, leaves, boundary, tree)

    def _own_copies(self, index: int, leaves: list, boundary: Boundary, tree):
        """A real block is given its own copy of each input another holds too, made in a part of its own that
        no plan copies: when the copy goes is when this block lets go of it, whatever the others hold. Such
        inputs are those the model shares between blocks (made by its own code, not a block: position
        embeddings, masks) and the outputs of another real block (a kept predecessor holding its output to
        its backward, as a ReLU that saves it, would hide when a recomputed block lets go of its input)."""
        shared = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
                  and boundary.inputs[k] is not None and self._held_elsewhere(index, leaf, boundary.inputs[k])]
        if not shared:
            return None
        part = self.sid
        self.enter(("copies", index, self.micro))
        for k in shared:
            leaves[k] = leaves[k].clone()
            self.copies[self.serial_of(leaves[k])] = boundary.inputs[k]
        self.enter(part)
        return tree_unflatten(leaves, tree)

    def _held_elsewhere(self, index: int, leaf: torch.Tensor, serial: int) -> bool:
        """Whether input `serial` of real block `index` may be held by other code of the trace than this block:
        the model's own (an input needing no gradient it made) or another real block (its output), but not an
        earlier block of its checkpoint region: nothing holds that but the block given it, and a copy would be
        an input the region keeps."""
        owner = self.stores[serial].owner
        if owner[0] == "blk":
            region = self.region_of.get(index)
            same_region = region is not None and self.region_of.get(owner[1]) == region
            return owner[1] in self.real and owner[1] != index and not same_region
        return owner[0] != "gap" and not leaf.requires_grad

    def _block_ends(self, index: int, _module, _args, _kwargs, output):
        boundary = self.boundaries[(index, self.micro)]
        leaves, _ = tree_flatten(output)
        boundary.outputs = [self.serial_of(x) for x in leaves]
        if any(serial in self.copies for serial in boundary.outputs):  # named by no part a plan copies
            self.problems.append(f"block {index} returns an input it was given its own copy of")
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(functools.partial(self._gradient, boundary.dout, k))
        self.mark_forward(("post", self.micro, "f") if index == self.last else ("gap", index, self.micro))

    def _gradient(self, into: dict[int, int], leaf: int, grad: torch.Tensor):
        serial = self.serial_of(grad)
        if serial is not None:
            into[leaf] = serial


# --- running a trace ---------------------------------------------------------------------------------


class PartsEstimator(Estimator):
    """The estimator whose fake model the parts are traced on. Its optimizers' state is made by one
    update alone, on gradients of every trainable parameter (not by a whole step, which for a deep
    model costs what a whole prediction did): the same state, the same bytes."""

    def _warm_up(self, plan: MemoryPlan, whole: MemoryPlan, planned) -> None:
        _gradients_arrive(self.model, {i for i, p in enumerate(self.model.parameters()) if p.requires_grad})
        done = torch.zeros(())
        update(self.model, planned.stepper, None, self.recipe.train.grad_clip, Accumulated(done, done, None))


def _gradients_arrive(model: torch.nn.Module, accumulated: set[int]) -> None:
    """Set the gradients of the parameters `accumulated` (indices in model.parameters() order) and run their
    post-accumulate-grad hooks, as AccumulateGrad does once the backward has made each."""
    for index, param in enumerate(model.parameters()):
        if index in accumulated:
            param.grad = torch.empty_like(param)
            for hook in list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(param)


def trace_step(estimator: PartsEstimator, plan: MemoryPlan, precision: PrecisionName, real: set[int],
               templates: dict) -> Trace:
    """The step of `plan` with only the blocks `real` real (module docstring), cut into its parts."""
    micro = plan.micro_batch or estimator.recipe.train.batch_size
    blocks = find_blocks(estimator.model, plan.blocks)
    batch = estimator.batch.slice(0, MICRO_BATCHES_RUN * micro)
    cutter = None
    trigger = _trigger(estimator)

    def step(run: FakeRun) -> None:
        accumulated = accumulate(estimator.model, batch, micro, Precision(precision, "cpu", plan.weights.autocast_cache()),
                                 None, label_count(estimator.batch.labels), run.applied.head)
        cutter.enter(("update",))  # empty here: the update is traced alone (trace_update)
        grads.update(_gradient_serials(cutter, estimator.model, run.planned.stepper))
        cutter.enter(("end",))
        del accumulated  # what the step's end lets go

    @contextlib.contextmanager
    def watch(run: FakeRun):
        nonlocal cutter
        regions = plan.checkpointing.regions(blocks) if plan.checkpointing.spans_blocks else []
        cutter = Cutter(run, blocks, frozenset(real), regions)
        cutter.enter(("head",))
        undo = undo_all([wrap_forward(b.module, relay_forward, b.module, templates, trigger) for b in blocks
                         if b.index not in real])
        cutter.install(estimator.model)
        try:
            with cutter:
                yield
        finally:
            cutter.remove()
            undo()
            cutter.catch_up()

    grads: dict[int, int] = {}
    with unavailable_on_fake_errors("a part of the step"):
        run = estimator.fake_step(plan, precision, step, watch, record_labels=True)
    for param in estimator.model.parameters():
        param.grad = None  # no update ran to let them go; the next step starts without them, as after one
    return _trace(cutter, run, frozenset(real), 1 if micro >= estimator.recipe.train.batch_size else MICRO_BATCHES_RUN,
                  grads, run.fixes.warnings())


def trace_update(estimator: PartsEstimator, plan: MemoryPlan, precision: PrecisionName, accumulated: set[int],
                 micro_batches: int) -> Trace:
    """The update alone (clipping, the optimizer's step, the gradients let go), after the gradients of the
    parameters `accumulated` (indices in model.parameters() order) are set and their post-accumulate-grad
    hooks run, as the backward leaves them (what those hooks did is not part of the update: each block's
    part holds it)."""
    grads: dict[int, int] = {}
    cutter = None
    done = _scalar(estimator)

    def step(run: FakeRun) -> None:
        cutter.enter(("head",))
        _gradients_arrive(estimator.model, accumulated)
        cutter.catch_up()
        grads.update(_gradient_serials(cutter, estimator.model, run.planned.stepper))
        if run.clock is not None:  # what the clock counts as the last micro-batch's update
            run.clock.micro, run.clock.backward_seen = micro_batches, True
        cutter.enter(("update",))
        update(estimator.model, run.planned.stepper, None, estimator.recipe.train.grad_clip, Accumulated(done, done, None))
        cutter.enter(("end",))

    @contextlib.contextmanager
    def watch(run: FakeRun):
        nonlocal cutter
        cutter = Cutter(run, BlockList("", []))
        try:
            with cutter:
                yield
        finally:
            cutter.catch_up()

    with unavailable_on_fake_errors("the update"):
        run = estimator.fake_step(plan, precision, step, watch, record_labels=True)
    batch = estimator.recipe.train.batch_size
    hosted = {batch // micro: host_work(run.planned, batch // micro) for micro in range(1, batch + 1) if batch % micro == 0}
    return _trace(cutter, run, frozenset(), micro_batches, grads, [], hosted)


def _gradient_serials(cutter: Cutter, model: torch.nn.Module, stepper) -> dict[int, int | None]:
    """Parameter index -> the serial of what holds its gradient as the backward left it: the gradient, or
    the stepper's own (bf16 weights' float32 sums over micro-batches: runner/memory/accumulation.py)."""
    held = getattr(stepper, "held_gradients", dict)()
    return {index: cutter.serial_of(held.get(p, p.grad)) for index, p in enumerate(model.parameters())
            if p.grad is not None or p in held}


def _trace(cutter: Cutter, run: FakeRun, real: frozenset[int], micro_batches: int, grads: dict, warnings,
           hosted: dict[int, int] | None = None) -> Trace:
    cutter.catch_up()
    problems = list(dict.fromkeys(cutter.problems))
    for sid, part in cutter.parts.items():
        if sid[0] in ("gap", "gapb") and part.allocs:
            problems.append("the model runs code that allocates between its blocks")
    return Trace(cutter.stores, cutter.parts, real, micro_batches, cutter.boundaries, cutter.signatures,
                 {k: v for k, v in grads.items() if v is not None}, frozenset(cutter.accumulated), problems,
                 dict(cutter.copies), list(warnings), hosted or {})


def _trigger(estimator: Estimator) -> torch.Tensor:
    """A leaf that needs a gradient, for a relay whose block has trainable parameters but is given no
    tensor that needs one (its outputs still need gradients); made once, outside any trace."""
    with estimator.fake_mode:
        return torch.zeros((), requires_grad=True)


def _scalar(estimator: Estimator) -> torch.Tensor:
    with estimator.fake_mode:
        return torch.zeros(())
