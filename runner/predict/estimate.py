"""Predict a step's peak memory without allocating it: the real training step on fake tensors.

`Estimator(recipe, device)` builds the model, optimizer and a batch of the recipe's shapes once
on fake tensors (sizes and dtypes, no data: seconds even for large models), runs one untracked
warm-up step so the optimizer state exists as in every later step, then `estimate(plan)` applies
the plan, runs `ckrun.runner.train.step.run_step` (the training code itself: micro-batches, autocast,
clipping, optimizer step) under `LiveBytesTracker`, and removes the plan again.

CPU: the peak is the tracker's live tensor bytes, which is exactly what training on CPU reports.
CUDA (with or without a GPU here): the step runs on fake CPU tensors with CUDA's attention
kernels, autocast fp32 ops, fused AdamW and activation offload reproduced (`cuda_model`), and the
order of allocations is replayed through a model of the caching allocator to predict reserved
bytes, which is what a cap on the card limits (`reserved`).

Where the step runs an op whose fake kernel is known to allocate less than the real one
(`fake_gaps.FAKE_GAPS`, e.g. an LSTM's oneDNN workspace), the estimate says so in `warnings`.

Time: given a device's facts (`hardware.DeviceFacts`), the same fake step is also priced op by
op (`roofline.OpClock`, a second dispatch mode beside the tracker) and `Estimate.time` holds the
step's predicted time, throughput, MFU and HFU (`step_time`). One pass gives both numbers.

A step of many micro-batches runs only its first two on fake tensors: every later micro-batch
starts from the state the second started from (gradients exist, the same activations come and
go), so it repeats the second's peak exactly (a property test compares both over generated
recipes and plans) and its time; the update runs once after them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from ..builders.data import Batch
from ..builders.adapters import lora_note
from ..builders.sources import stand_in_batch
from ..memory.apply import apply_plan, check_combination
from ..memory.blocks import find_blocks, undo_all, wrap_forward
from ..memory.offload import ActivationOffload, CopyTransport
from ..memory.optimizers import PlannedOptimizer, accumulates_in_float32, build_planned_optimizer
from ..memory.tracker import LiveBytesTracker
from ..memory.weights import KeptCopies, copies_kept
from ..plan.memory_plan import MemoryPlan, NoOffload, NoOptimizerOffload, gradients_final
from ..recipe.recipe import Precision as PrecisionName, Recipe
from ..train.step import Precision, label_count, run_step
from ..problems import CkrunError, KeyedError
from ..units import format_bytes
from .cuda_model import CudaOnCpu, in_cuda_mode
from .compiled_updates import compiled_updates
from .shapes import batch_to_fake, build_for_shapes, weight_init_skipped
from .fake_gaps import FakeGapWatch, FakeKernelFixes
from .device_facts import DeviceFacts
from .real_paths import real_mask_paths
from .reserved import cuda_reserve
from .roofline import OpClock, StepWork
from .routing import BalancedRouting
from .step_time import StepShape, StepTime, step_time

CPU = torch.device("cpu")
HOST = torch.device("meta")  # where offloaded activations land in an estimate (fake host memory)
MICRO_BATCHES_RUN = 2  # the first micro-batch, then one that every later one repeats (module docstring)
DEFAULT_OPTIMIZER = {"optimizer_offload": NoOptimizerOffload()}  # apply_plan's part of a plan: the optimizer is built here


class EstimateUnavailable(CkrunError, RuntimeError):
    """The step cannot run on fake tensors (the model reads tensor values, or an op has no fake kernel)."""


@dataclass(frozen=True)
class Estimate:
    peak_bytes: int
    """What a memory cap is compared with: live tensor bytes on CPU, predicted reserved bytes on CUDA."""
    breakdown: dict[str, int]
    """Bytes per category at the peak (tracker categories; on CUDA also `allocator_cache`); sums to peak_bytes."""
    notes: list[str] = field(default_factory=list)
    """What the number includes or leaves out, one line each."""
    live_peak_bytes: int = 0
    """The most tensor bytes live at once (before the allocator's rounding and caching)."""
    device: str = "cpu"
    warnings: list[str] = field(default_factory=list)
    """Where the estimate is known to be low: ops whose fake kernels allocate less than the real ones."""
    time: StepTime | None = None
    """The step's predicted time on the named device; None when no device facts were given."""
    work: StepWork | None = field(default=None, repr=False, compare=False)
    """What the step's ops did (device-independent): `time_on` prices it on another device."""
    shape: StepShape | None = field(default=None, repr=False, compare=False)
    pool_peaks: dict[str, int] = field(default_factory=dict)
    """The most bytes each tracker category holds at any moment of the step: not at once, so they may sum past
    the peak (the breakdown is the moment of the peak, when gradients may not exist yet)."""

    def time_on(self, facts: DeviceFacts) -> StepTime:
        """The same step's time on another device (the peak is this estimate's)."""
        if self.work is None or self.shape is None:
            raise ValueError("this estimate was made without device facts: it recorded no work to price")
        return step_time(self.work, self.shape, facts)

    def record(self) -> dict:
        return {"device": self.device, "peak_bytes": self.peak_bytes, "live_peak_bytes": self.live_peak_bytes,
                "breakdown": dict(self.breakdown), "pool_peaks": dict(self.pool_peaks), "notes": list(self.notes),
                "warnings": list(self.warnings),
                "time": self.time.record() if self.time else None}


def estimate_peak(recipe: Recipe, device: str = "cpu", facts: DeviceFacts | None = None) -> Estimate:
    """The predicted peak of one training step of `recipe` with its own memory plan and precision
    (and its time on the device `facts` describe, when given)."""
    return Estimator(recipe, device, facts).estimate()


class Estimator:
    """A recipe's model built once on fake tensors; `estimate(plan)` is cheap enough to call per plan."""

    world_size = 1  # ranks the step's samples are one share of (predict/ranks.py)
    data_parallel = None  # groups among them that see different samples (tensor parallelism: fewer); None: all
    ddp_gradient_bytes = 0  # gradients DDP all-reduces after the last micro-batch (predict/ranks.py)

    def __init__(self, recipe: Recipe, device: str = "cpu", facts: DeviceFacts | None = None):
        if recipe.model.lora is not None and recipe.model.lora.quantize_base:
            raise EstimateUnavailable("model.lora.quantize_base: bitsandbytes' 4-bit layers do not run on fake "
                                      "tensors; measure the recipe on its GPU (`ckrun tune` without --predict)")
        self.recipe, self.facts = recipe, facts
        self.cuda = torch.device(device).type == "cuda"
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(f"cannot estimate for device {device!r}; use cpu or cuda")
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.kept_copies = KeptCopies()  # memory.weights bf16's copies of the fake parameters (`_applied`)
        with unavailable_on_fake_errors("building the model"), self.fake_mode:
            with self._device_behaviour(MemoryPlan()):
                torch.manual_seed(recipe.train.seed)
                with weight_init_skipped():
                    model = self._build_model()
            # outside the step's dispatch modes, which change no op of a split: FSDP2 chunks every parameter
            # once per rank, several ops each (a 70B shape over 64 ranks: 5 CPU seconds of the modes' overhead)
            self.model = self._prepare(model)
            self.model.train()
        self.routed = BalancedRouting(self.model)  # eager experts' routing, assumed (predict/routing.py); the model is its own
        self.batch, self.batch_only = batch_to_fake(self._stand_in_batch(), self.fake_mode)
        gaps = FakeGapWatch()  # watched once, in the warm-up: a plan changes how often ops run, not which
        self._optimizers: dict[tuple, PlannedOptimizer] = {}  # each optimizer a plan asks for, warmed up once
        self.optimizer = self._optimizing(recipe.memory, gaps).optimizer
        self.warnings = gaps.warnings()

    def _build_model(self) -> torch.nn.Module:
        """The model on fake tensors (inside the fake mode); predict/given.py copies a model it is given."""
        return build_for_shapes(self.recipe.model)

    def _stand_in_batch(self) -> Batch:
        """A real batch of the step's shapes, made outside the fake mode: synthetic data indexes and masks by value."""
        return stand_in_batch(self.recipe, self.model)

    def _optimizing(self, plan: MemoryPlan, watch=None) -> PlannedOptimizer:
        """The optimizer `plan` asks for (fused AdamW on a CUDA target, as the trainer builds it; torchao's;
        the host offload's, with the meta device as its host), after one untracked warm-up step that
        creates its state, as every later step finds it."""
        key = self.optimizer_key(plan)
        if key in self._optimizers:
            return self._optimizers[key]
        whole = MemoryPlan(weights=plan.weights, allow_lossy=True)  # the one part of a plan the state depends on
        with unavailable_on_fake_errors("the warm-up step"), self.fake_mode, self._device_behaviour(plan), self._applied(whole):
            planned = build_planned_optimizer(self.model, self.recipe.train, plan,
                                              torch.device("cuda" if self.cuda else "cpu"), key[-1], host=HOST)
            try:
                with watch or contextlib.nullcontext():
                    self._warm_up(plan, whole, planned)
            finally:
                planned.remove()
                planned.release()
        self._optimizers[key] = planned
        return planned

    def optimizer_key(self, plan: MemoryPlan) -> tuple:
        """What the optimizer a plan asks for depends on: plans with one key share one (warmed up once)."""
        return (plan.weights.holds_bf16, plan.optimizer_state.label(), plan.optimizer_step.label(),
                plan.optimizer_offload.label(), accumulates_in_float32(plan, self.recipe.train),
                gradients_final(plan, self.recipe.step_facts()))

    def _warm_up(self, plan: MemoryPlan, whole: MemoryPlan, planned: PlannedOptimizer) -> None:
        """One whole step, untracked, that creates the optimizer's state (runner/predict/parts.py steps the
        optimizer alone)."""
        # bf16 weights, and the device's bf16 copies of host masters, run under bf16 autocast
        half = plan.weights.holds_bf16 or plan.optimizer_offload.masters_on_host
        self._step(self.recipe.train.batch_size, "bf16" if half else "fp32", whole,
                   planned.stepper)  # creates the state, through the hooks a step runs

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """The built model as the step runs it; predict/ranks.py shards it here (FSDP), before the optimizer."""
        return model

    def estimate(self, plan: MemoryPlan | None = None, precision: PrecisionName | None = None,
                 watch=None) -> Estimate:
        """`watch(run)`, when given, is a context manager entered around the step, given the `FakeRun`
        whose tracker and clock record it (per-block costs read the tracker from hooks it installs)."""
        plan = self.recipe.memory if plan is None else plan
        precision = precision or self.recipe.precision
        micro = micro_batch_of(plan, self.recipe.train.batch_size)
        self.check(plan, precision)  # bad plans raise ValueError
        run = self.fake_step(plan, precision, lambda run: self._step(micro, precision, plan, run.planned.stepper,
                                                                      run.applied.head), watch)
        estimate = self._result(run.tracker, run.baseline, plan, precision, run.planned)
        estimate.notes.extend(self.routed.notes())
        estimate.warnings.extend(self.warnings)
        if run.clock is not None:
            shape = self._shape(micro, precision)
            estimate = replace(estimate, work=run.clock.work, shape=shape, time=step_time(run.clock.work, shape, self.facts))
        return estimate

    def check(self, plan: MemoryPlan, precision: PrecisionName) -> None:
        """A ValueError when `plan` cannot run here with `precision` (memory.apply's check_combination)."""
        facts = replace(self.recipe.step_facts(), precision=precision)
        check_combination(plan, torch.device("cuda" if self.cuda else "cpu"), facts)

    def fake_step(self, plan: MemoryPlan, precision: PrecisionName, step, watch=None,
                  record_labels: bool = False) -> FakeRun:
        """`step(run)` on the fake model with `plan` applied, inside the tracker (and with device facts the
        op clock): the optimizer the plan asks for installed, what existed before counted as the baseline.
        `step` is the training step's work (the estimate's `_step`; per part: runner/predict/parts.py)."""
        run = FakeRun(LiveBytesTracker(CPU, record_events=self.cuda, record_labels=record_labels),
                      OpClock(self.world_size, self.recipe.tf32, self._moded_blocks(plan)) if self.facts else None,
                      self._optimizing(plan))
        planned = run.planned
        with self.fake_mode, self._device_behaviour(plan) as run.fixes, self._applied(plan, run.clock) as run.applied:
            planned.hold()  # before the tracker counts the parameters: the bf16 copies of host masters
            run.tracker.track(self.model, planned.optimizer, [*self.batch.tensors(), *self.batch_only])
            run.baseline = len(run.tracker.events or ())
            planned.install()
            try:
                with unavailable_on_fake_errors("the training step"), run.tracker, \
                        (run.clock or contextlib.nullcontext()), (watch(run) if watch else contextlib.nullcontext()):
                    step(run)
                work = host_work(planned, self.recipe.train.batch_size // micro_batch_of(plan, self.recipe.train.batch_size))
                if run.clock is not None and work:  # the host's share of the update, priced at its AdamW rate
                    run.clock.host_update(work)
            finally:
                planned.remove()
                run.tracker.close()
                planned.release()
        return run

    # --- running ---------------------------------------------------------------------------------

    def _step(self, micro_batch: int, precision: PrecisionName, plan: MemoryPlan, stepper, head=None) -> None:
        """The first MICRO_BATCHES_RUN micro-batches of the step, then its update (module docstring).
        fp16's GradScaler reads found-inf flags (.item()), which fake tensors do not have; it only
        adds a few scalars, so the estimate runs without it."""
        batch = self.batch.slice(0, MICRO_BATCHES_RUN * micro_batch)  # views: the whole batch stays counted
        run_step(self.model, stepper, batch, micro_batch, Precision(precision, "cpu", plan.weights.autocast_cache()),
                 None, self.recipe.train.grad_clip, label_total=label_count(self.batch.labels), head=head)

    def _shape(self, micro_batch: int, precision: PrecisionName) -> StepShape:
        tokens = self.batch.inputs.get("input_ids")
        return StepShape(micro_batches=self.recipe.train.batch_size // micro_batch,
                         samples=self.recipe.train.batch_size, precision=precision, world_size=self.world_size,
                         tokens_per_sample=int(tokens.shape[1]) if tokens is not None and tokens.dim() > 1 else None,
                         ddp_gradient_bytes=self.ddp_gradient_bytes, data_parallel=self.data_parallel,
                         tf32=self.recipe.tf32)

    @contextlib.contextmanager
    def _device_behaviour(self, plan: MemoryPlan):
        """What the step does on the target device and not on fake CPU tensors, for `plan`; yields the fake
        kernels' mends (`FakeKernelFixes`), whose `seen` names the gaps left unmended."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(real_mask_paths())  # the attention paths a real step takes
            # oneDNN LSTM's workspace, a half-precision BatchNorm's float32 statistics, experts' grouped kernel in fp32
            fixes = stack.enter_context(FakeKernelFixes(self.cuda))
            stack.enter_context(compiled_updates(self.cuda, any(p.library for p in plan.pool_policies())))  # torchao's update
            if self.cuda:
                stack.enter_context(CudaOnCpu())
            yield fixes

    @contextlib.contextmanager
    def _applied(self, plan: MemoryPlan, clock: OpClock | None = None):
        """The plan on the model for one step: checkpointing via apply_plan, offload with training's
        `ActivationOffload` whose copies are synchronous and land on the meta device (no streams);
        with a clock, the markers that tell it where the step is."""
        undos = []
        try:
            blocks = find_blocks(self.model, plan.blocks) if plan.checkpointing.recomputes or plan.offload.moves \
                else None
            if clock is not None:  # innermost, inside any checkpoint: a recompute is seen as one
                undos += self._clock_markers(clock, plan)
            if self.cuda and plan.checkpointing.recomputes:  # inside the checkpoint: its recompute too
                undos += [wrap_forward(block.module, in_cuda_mode) for block in blocks]
            # the CUDA-only parts are the estimator's own: the activations' copies here, the optimizer's in _optimizing
            with copies_kept(self.kept_copies):  # bf16 weights: each parameter's fake copy made once, not per step
                applied = apply_plan(self.model, plan.model_copy(update={"offload": NoOffload(), **DEFAULT_OPTIMIZER}), CPU)
            undos.append(applied.remove)
            if plan.offload.moves:  # outside the checkpoint, as apply_plan stacks them
                # training's own offloader and schedule; only the copies are fake (host = meta)
                offload = ActivationOffload(CPU, int(plan.offload.min_bytes), CopyTransport(CPU, HOST))
                undos += [wrap_forward(blocks[i].module, offload.wrapper, blocks[i].module)
                          for i in plan.offload.chosen(blocks)]
            yield applied
        finally:
            undo_all(undos)()

    def _moded_blocks(self, plan: MemoryPlan) -> frozenset[int]:
        """Blocks whose ops selective checkpointing's Python dispatch mode handles (a host cost per op)."""
        if not plan.checkpointing.caches_ops:
            return frozenset()
        return frozenset(plan.checkpointing.chosen(find_blocks(self.model, plan.blocks)))

    def _clock_markers(self, clock: OpClock, plan: MemoryPlan) -> list:
        """The model's forward starts a micro-batch; each block's forward names its block (a model
        without blocks the finder recognises is timed whole)."""
        handle = self.model.register_forward_pre_hook(lambda *_: clock.start_micro_batch())
        undos = [handle.remove]
        try:
            blocks = find_blocks(self.model, plan.blocks)
        except ValueError:
            return undos
        return undos + [wrap_forward(block.module, clock.in_block, block.index) for block in blocks]

    # --- reporting -------------------------------------------------------------------------------

    def _weights_held(self, plan: MemoryPlan, precision: str) -> str:
        """What the weights' bytes are, one line (a split model's says what its rank holds: per_rank.py)."""
        if plan.optimizer_offload.masters_on_host:
            return ("weights: bf16 copies of the nn.Linear weights (2 B a parameter) and float32 embeddings, norms "
                    "and tied or split heads on the device; the float32 masters on the host (memory.optimizer_offload "
                    "master), no cast copies")
        return plan.weights.holds(precision)

    def _result(self, tracker: LiveBytesTracker, baseline: int, plan: MemoryPlan, precision: str,
                planned: PlannedOptimizer) -> Estimate:
        live = tracker.peak_bytes
        breakdown, pool_peaks = tracker.breakdown_at_peak, tracker.category_peaks
        notes = [f"one step of batch {self.recipe.train.batch_size} in micro-batches of "
                 f"{micro_batch_of(plan, self.recipe.train.batch_size)}, {precision}, after the optimizer state exists",
                 self._weights_held(plan, precision), *pool_notes(plan, precision, self.cuda),
                 *_moment_note(breakdown, pool_peaks)]
        optimizer_host = getattr(planned.optimizer, "host_bytes", lambda: 0)()
        if optimizer_host:
            notes.append(f"memory.optimizer_offload {plan.optimizer_offload.label()}: {format_bytes(optimizer_host)} "
                         "of parameter copies, gradient buffers and optimizer state in pinned host memory")
        if plan.compile:
            notes.append("memory.compile: estimated as eager; compiled code usually needs less"
                         + (" (activation_memory_budget is not modelled: measure it)"
                            if plan.activation_memory_budget is not None else ""))
        if plan.compression.lossy:
            notes.append(f"memory.compression {plan.compression.label()}: lossy; training logs its gradient error "
                         "against the exact plan at start, and `ckrun tune` records it per probe")
        if precision == "fp16":
            notes.append("fp16: the GradScaler's few scalar tensors are left out")
        if self.recipe.model.lora is not None:
            notes.append(lora_note(self.model, self.recipe.model.lora))
        if not self.cuda:
            return Estimate(live, breakdown, notes, live, "cpu", pool_peaks=pool_peaks)
        reserve = cuda_reserve(tracker.events, baseline, live, plan, self.facts)
        breakdown["cublas_workspaces"] = reserve.workspace_bytes
        breakdown["allocator_cache"] = reserve.reserved_bytes - live - reserve.workspace_bytes
        notes += reserve.notes
        host = tracker.peak_by_device.get(str(HOST), 0) - optimizer_host
        if plan.offload.moves and host > 0:
            notes.append(f"offload: up to {format_bytes(host)} of saved activations in pinned host memory")
        return Estimate(reserve.reserved_bytes, breakdown, notes, live, "cuda", pool_peaks=pool_peaks)


def _moment_note(breakdown: dict[str, int], pool_peaks: dict[str, int]) -> list[str]:
    """Why a pool the step fills reads 0 B at the peak: the peak comes before backward makes gradients (the
    activations of the whole forward pass are live), and they are made as activations are freed."""
    if breakdown.get("gradients") or not pool_peaks.get("gradients"):
        return []
    return [f"the breakdown is the moment of the peak, before backward has made any gradient (the forward pass's "
            f"activations all live): gradients are 0 B there and reach {format_bytes(pool_peaks['gradients'])} later, "
            "as backward frees the activations (each pool's own most is in the column beside)"]


@dataclass
class FakeRun:
    """One fake step as `Estimator.fake_step` ran it: what recorded it and what it ran with."""

    tracker: LiveBytesTracker
    clock: OpClock | None
    planned: PlannedOptimizer
    baseline: int = 0
    """The tracker's events that existed before the step (parameters, optimizer state, the batch)."""
    applied: object = None
    """The plan as apply_plan put it on the model (memory.apply.AppliedPlan)."""
    fixes: FakeKernelFixes | None = None
    """The fake kernels' mends the step ran under; their `seen` names the gaps they left."""


def host_work(planned: PlannedOptimizer, micro_batches: int) -> int:
    """The host's work in a step (memory.optimizer_offload: parameters updated there, and under master the
    micro-batches' gradients added up, in AdamW-element equivalents), priced at the host's AdamW rate."""
    return getattr(planned.optimizer, "host_work", lambda _: 0)(micro_batches)


def pool_notes(plan: MemoryPlan, precision: str, cuda: bool) -> list[str]:
    """What the estimate's numbers mean for the plan's optimizer and loss, one line each (the weights':
    `Estimator._weights_held`)."""
    notes = []
    lossy = [policy.label() for policy in plan.pool_policies() if policy.lossy]
    if lossy:
        notes.append(f"{', '.join(lossy)}: lossy; training logs how far the weights' update moved from exact AdamW "
                     "over its first steps, and `ckrun tune` records it per probe")
    if cuda and any(policy.library for policy in plan.pool_policies()):
        notes.append("torchao's update is torch.compile'd into fused kernels on CUDA, counted as in place (no "
                     "temporaries beyond their own scratch)")
    if plan.optimizer_step.updates_in_backward:
        notes.append("memory.optimizer_step in_backward: gradients live only from their accumulation to their "
                     "parameter's update, inside the backward")
    if plan.loss.splits_head:
        notes.append(f"memory.loss {plan.loss.label()}: one piece's logits (and their float32 copy and gradient) "
                     "live at a time, recomputed in the backward")
    return notes


def micro_batch_of(plan: MemoryPlan, batch_size: int) -> int:
    micro = plan.micro_batch or batch_size
    if batch_size % micro:
        raise KeyedError("memory.micro_batch", f"memory.micro_batch {micro} does not divide train.batch_size {batch_size}")
    return micro


@contextlib.contextmanager
def unavailable_on_fake_errors(stage: str):
    """Errors of running on fake tensors -> EstimateUnavailable with a one-line reason."""
    try:
        yield
    except DataDependentOutputException as err:
        raise EstimateUnavailable(f"{stage}: the model reads tensor values ({err.func}), which fake tensors "
                                  "do not have; measure the plan instead") from err
    except DynamicOutputShapeException as err:
        raise EstimateUnavailable(f"{stage}: an output's shape depends on tensor values ({err.func}); "
                                  "measure the plan instead") from err
    except UnsupportedOperatorException as err:
        raise EstimateUnavailable(f"{stage}: {err.func} has no fake-tensor implementation") from err
    except (RuntimeError, NotImplementedError) as err:
        if isinstance(err, EstimateUnavailable):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise EstimateUnavailable(f"{stage}: {type(err).__name__}: {first}") from err
