"""`ckrun estimate --nproc N`: the peak of one rank's step, predicted on fake tensors in one process.

Each rank runs the step on its data-parallel group's share of the global batch (train.batch_size /
`data_parallel(N)`: N for ddp, fsdp and hsdp, N / tensor for tp), so that is the batch the prediction
runs. On top of it:
- fsdp, hsdp, tp: the model is really split, by the trainer's own code (runner/parallel/wrap.py:
  `parallelize_module` on the mesh's tp dimension, FSDP2's `fully_shard` per block and then the root
  over its data-parallel part, with the recipe's sharding knobs and mixed precision), over torch's
  fake process group of N ranks laid out as the strategy's device mesh (collectives are no-ops,
  shapes are real), on fake tensors. The tracker then counts what rank 0 holds: its shards of
  parameters, gradients and optimizer state, the blocks' gathered parameters and unsharded gradients
  while they are in flight as FSDP2 allocates them, and the split layers' pieces of activations
  beside the whole ones a tensor group's ranks each hold.
  On top of the fake step, one block's unsharded gradients (fp32, what FSDP2 reduce-scatters): the fake
  group finishes each reduce-scatter at once, while gloo and NCCL may still hold one block's buffer
  when the next block's gradients arrive (measured in 4 of 5 runs at 2 ranks: the estimate was 4.5%
  low, with no warning), so it is counted and said: an estimate is an upper bound, never low by chance.
- ddp: the whole model per rank, plus DDP's gradient buckets (one more copy of the gradients, into
  which it reduces).
The fake process group is a torch testing API; where a torch lacks it, the prediction says so.

A plan's step is composed from parts (runner/predict/rank_parts.py: a few real blocks traced on the split
model, the others relays), so its cost does not grow with depth; where a plan does not compose, the whole
rank's step is run, and the estimate's notes say so (`RankPredictor(compose=False)` runs every step whole:
the reference tests/runner/predict/test_rank_parts.py holds the composition to).

`tune --predict --nproc N` asks for many plans of one recipe: `RankPredictor` makes what no plan changes
once and keeps it (the fake group; a mesh per strategy; per layout, `layout_key`, the estimator with its
split fake model and warmed-up optimizer, and the gradient bytes counted on it), and applies each plan to the
kept model as `Estimator.estimate` does for one process. reshard_after_forward is set on the kept model
per plan (FSDP2's `set_reshard_after_forward`, the state `fully_shard` gives for the same value), so
`fsdp` and `fsdp:keep` share one build. A generated test holds that a kept predictor answers every
plan, in any order, exactly as one built for that plan alone (tests/runner/predict/test_rank_reuse.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import replace

import torch

from ..parallel.mesh import TENSOR_DIM, build_mesh
from ..parallel.ranks import check_world
from ..memory.weights import apply_weights
from ..parallel.wrap import place_on_mesh, root_reshards
from ..plan.memory_plan import Sharding
from ..recipe.recipe import Recipe
from ..units import format_bytes
from .estimate import Estimate, EstimateUnavailable, Estimator
from .device_facts import DeviceFacts
from .parts import PartsEstimator
from .rank_parts import RankComposer


def per_rank(nproc: int, source: str = "<recipe>"):
    """An estimator factory, `(recipe, device) -> object with .estimate()`, for one of `nproc` ranks."""

    def make(recipe: Recipe, device: str, facts: DeviceFacts | None = None):
        return _OneRank(RankPredictor(nproc, device, facts, source), recipe)

    return make


class _OneRank:
    """`ckrun estimate --nproc N`: one recipe, its fake group up only while it is estimated."""

    def __init__(self, predictor: RankPredictor, recipe: Recipe):
        check_world(recipe, predictor.nproc, predictor.source)  # before anything is built, as --nproc demands
        self.predictor, self.recipe = predictor, recipe

    def estimate(self) -> Estimate:
        with self.predictor:
            return self.predictor.estimate(self.recipe)


class RankPredictor:
    """One of `nproc` ranks, predicted for many recipes that differ in their plan, precision and strategy
    (`tune --predict --nproc N`'s trials). What no plan changes is made once and kept (module docstring):
    the fake process group; a strategy's device mesh; per layout (`layout_key`: the strategy, memory.sharding,
    memory.blocks and, for FSDP2's mixed precision, the precision) the estimator, with its fake model split
    over the mesh and its optimizer warmed up (DDP's gradient bytes counted on it). A plan is then applied to the
    kept model and removed again, as `Estimator.estimate` does for one process. Use it as a context manager:
    leaving it takes the fake group down."""

    def __init__(self, nproc: int, device: str, facts: DeviceFacts | None = None, source: str = "<recipe>",
                 compose: bool = True):
        """`compose`: each plan's step composed from parts (runner/predict/rank_parts.py), else run whole."""
        self.nproc, self.device, self.facts, self.source, self.compose = nproc, device, facts, source, compose
        self.estimators: dict[str, Estimator] = {}
        self.composers: dict[str, RankComposer] = {}
        self.meshes: dict[str, object] = {}
        self._group = contextlib.ExitStack()

    def __enter__(self) -> RankPredictor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop the kept estimators and meshes, and take the fake process group down."""
        self.estimators.clear()
        self.composers.clear()
        self.meshes.clear()
        self._group.close()

    def estimate(self, recipe: Recipe) -> Estimate:
        check_world(recipe, self.nproc, self.source)  # the layout must fit and the batch split, as --nproc demands
        share, strategy = rank_share(recipe, self.nproc), recipe.distributed
        self._check_offload(share)
        if strategy.shards and self.nproc > 1:
            estimator = self.estimator(share)
            _set_reshard(estimator.model, share.memory)
            with _meshes_outside_fake_mode(), self._dropped_on_failure(share):
                estimate = self._step(estimator, share)
            if _fully_sharded(estimator.model):  # tp alone reduce-scatters nothing
                estimate = _add_reduce_in_flight(estimate, _unit_gradient_bytes(estimator.model, share.memory.blocks))
        else:
            estimator = self.estimator(share)
            if self._buckets(share):  # counted on the kept model between plans, in the dtype the plan holds
                estimator.ddp_gradient_bytes = _gradient_bytes(estimator.model, share.memory)
            with self._dropped_on_failure(share):
                estimate = self._step(estimator, share)
            if estimator.ddp_gradient_bytes:
                estimate = _add_gradient_buckets(estimate, estimator.ddp_gradient_bytes)
        estimate.notes.insert(0, f"one of {self.nproc} ranks ({strategy.label()}): its share of "
                                 f"{share.train.batch_size} samples of the global batch {recipe.train.batch_size}")
        return estimate

    def _check_offload(self, share: Recipe) -> None:
        """FSDP2's CPU offload, judged against the target: a GPU run may use it, but its step cannot be run
        here (its pinned host copies have no fake-tensor kernel), so it is refused before anything is
        built, saying so; a CPU target is told it has no device to offload from (wrap.shard's line)."""
        knobs = share.memory.sharding
        if not (share.distributed.shards and knobs is not None and knobs.offload == "cpu"):
            return
        if torch.device(self.device).type == "cuda":
            raise EstimateUnavailable("memory.sharding.offload cpu (FSDP2's CPU offload) is not predicted: its "
                                      "pinned host copies cannot run on fake tensors; measure it on the GPU "
                                      "(`ckrun tune` without --predict)")

    def _step(self, estimator: Estimator, share: Recipe) -> Estimate:
        """The rank's step for `share`'s plan: composed from parts (falling back to the whole step, said in a
        note, where it does not compose), or run whole."""
        if not self.compose:
            return estimator.estimate(share.memory, share.precision)
        key = layout_key(share)
        if key not in self.composers:
            self.composers[key] = RankComposer(estimator, share.distributed.shards and self.nproc > 1)
        return self.composers[key].estimate(share.memory, share.precision)

    def estimator(self, share: Recipe) -> Estimator:
        """The kept estimator of `share`'s layout, built (and its model split) the first time it is asked for."""
        key = layout_key(share)
        if key not in self.estimators:
            self.estimators[key] = self._build(share)
        return self.estimators[key]

    @contextlib.contextmanager
    def _dropped_on_failure(self, share: Recipe):
        """A step that failed half-way may leave its model mid-step (FSDP2's blocks gathered, hooks half
        run): its layout is built anew for the next plan rather than trusted."""
        try:
            yield
        except BaseException:
            self.estimators.pop(layout_key(share), None)
            self.composers.pop(layout_key(share), None)
            raise

    def _build(self, share: Recipe) -> Estimator:
        if share.distributed.shards and self.nproc > 1:
            with _meshes_outside_fake_mode():
                sharded = _ShardedParts if self.compose else _ShardedEstimator
                return sharded(share, self.device, self._mesh(share.distributed), self.source, self.facts)
        estimator = (PartsEstimator if self.compose else Estimator)(share, self.device, self.facts)
        estimator.world_size = self.nproc
        return estimator

    def _buckets(self, share: Recipe) -> bool:
        return self.nproc > 1 and bool(share.distributed.mesh_dims(self.nproc))

    def _mesh(self, strategy):
        """The strategy's mesh over the fake group, which comes up with the first mesh asked for."""
        if not self.meshes:
            self._group.enter_context(fake_process_group(self.nproc))
        if strategy.label() not in self.meshes:
            self.meshes[strategy.label()] = build_mesh(strategy, self.nproc, "cpu")
        return self.meshes[strategy.label()]



def rank_share(recipe: Recipe, nproc: int) -> Recipe:
    """`recipe` at the batch one rank trains on: its data-parallel group's share of the global batch."""
    groups = recipe.distributed.data_parallel(nproc) if recipe.distributed.mesh_dims(nproc) else nproc
    share = recipe.train.model_copy(update={"batch_size": recipe.train.batch_size // groups})
    return recipe.model_copy(update={"train": share})


def layout_key(recipe: Recipe) -> str:
    """What the built estimator of a rank depends on: the whole recipe but the memory plan, less the
    precision where nothing is sharded (the estimate takes it per plan; FSDP2's mixed precision is fixed
    when it shards), plus the plan's parts that `place_on_mesh` reads: memory.blocks, of memory.sharding
    the offload (reshard_after_forward is set per plan: `_set_reshard`), and for FSDP2 whether the
    weights are held in bf16 (its shards are made in their dtype)."""
    data = recipe.model_dump(mode="json", exclude={"memory"})
    if not recipe.distributed.shards:
        data.pop("precision")
    sharding = recipe.memory.sharding or Sharding()
    kept = sharding.model_dump(mode="json", exclude={"reshard_after_forward"} if _reshard_settable() else None)
    memory = {"blocks": recipe.memory.blocks, "sharding": kept}
    if recipe.distributed.shards:  # FSDP2 shards the parameters in the dtype they are held in
        memory["bf16_weights"] = recipe.memory.weights.holds_bf16
        if not _reshard_settable():
            memory["root_reshards"] = root_reshards(recipe.memory)
    return json.dumps({**data, "memory": memory}, sort_keys=True)


def _set_reshard(model: torch.nn.Module, plan) -> None:
    """The plan's reshard_after_forward on every FSDP2 unit of a kept model, the state `fully_shard` gives
    when passed the same values (wrap.shard passes the plan's to every block, `root_reshards` to the root)."""
    if _reshard_settable() and hasattr(model, "set_reshard_after_forward"):  # tp alone shards nothing
        model.set_reshard_after_forward((plan.sharding or Sharding()).reshard_after_forward, recurse=True)
        model.set_reshard_after_forward(root_reshards(plan), recurse=False)


def _gradient_bytes(model: torch.nn.Module, plan) -> int:
    """The trainable parameters' gradients, as DDP's buckets hold them: in the dtype `plan` holds the weights in."""
    bf16 = plan.weights.holds_bf16
    return sum(p.numel() * (2 if bf16 and p.is_floating_point() else p.element_size())
               for p in model.parameters() if p.requires_grad)


@functools.cache
def _reshard_settable() -> bool:
    """Whether this torch's FSDP2 modules take reshard_after_forward after sharding (else it is part of the layout)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_reshard_after_forward")


class _ShardedEstimator(Estimator):
    def __init__(self, recipe: Recipe, device: str, mesh, source: str, facts: DeviceFacts | None = None):
        self.mesh, self.source = mesh, source
        self.world_size = mesh.size()
        self.data_parallel = recipe.distributed.data_parallel(self.world_size)
        super().__init__(recipe, device, facts)

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        apply_weights(model, self.recipe.memory.weights)  # as the trainer's plan holds them before they are split
        return place_on_mesh(model, self.recipe, self.mesh, torch.device("cpu"), self.source)

    def _weights_held(self, plan, precision: str) -> str:
        """FSDP2's mixed precision gathers each unit's weights already in `precision`, so autocast casts none."""
        if precision == "fp32" or plan.weights.holds_bf16 or not _fully_sharded(self.model):
            return super()._weights_held(plan, precision)  # fp32, bf16 weights, or tp alone (autocast casts)
        kept = plan.sharding is not None and not plan.sharding.reshard_after_forward
        between = "kept from its forward to its backward" if kept else "freed after its forward and gathered again for its backward"
        return (f"weights: this rank's fp32 shards (4 B a parameter of its share) for the optimizer; FSDP2 gathers "
                f"each block's weights in {precision} (its mixed precision; autocast casts none), {between}")


class _ShardedParts(_ShardedEstimator, PartsEstimator):
    """The split fake model the parts of a rank's step are traced on (runner/predict/rank_parts.py): its
    optimizer state made by one update alone, not by a whole step."""


def _fully_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _meshes_outside_fake_mode():
    """FSDP2 over a tensor-parallel model builds a mesh of both dimensions while sharding (torch's
    DeviceMesh._concatenate), and a mesh finds its rank's coordinates with nonzero() on its rank
    tensor, whose output shape fake tensors cannot know. So a mesh is built with the fake mode set
    aside: a few real ints per mesh, nothing of the model."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    init = DeviceMesh.__init__

    def real_init(mesh, *args, **kwargs):
        with unset_fake_temporarily():
            init(mesh, *args, **kwargs)

    DeviceMesh.__init__ = real_init
    try:
        yield
    finally:
        DeviceMesh.__init__ = init


def _unit_gradient_bytes(model: torch.nn.Module, blocks) -> int:
    """One FSDP unit's unsharded gradients as reduce-scattered (fp32: ckrun reduces in fp32), counted on the
    rank's split model: the largest block's, or the whole model's when it has no repeated blocks (then it
    is one unit)."""
    from ..memory.blocks import find_blocks

    try:
        units = [block.module for block in find_blocks(model, blocks)]
    except ValueError:
        units = [model]
    return max(sum(_rank_piece(p) for p in unit.parameters() if p.requires_grad) for unit in units) * 4


def _rank_piece(parameter: torch.Tensor) -> int:
    """Its elements a rank reduce-scatters: split over the mesh's tensor dimension where tensor parallelism
    shards it (a colwise or rowwise layer's weight, a colwise bias), whole otherwise (FSDP's own shards are
    unsharded gradients at the reduce-scatter)."""
    mesh = getattr(parameter, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if TENSOR_DIM not in names:
        return parameter.numel()
    dim = names.index(TENSOR_DIM)
    return parameter.numel() // (mesh.size(dim) if parameter.placements[dim].is_shard() else 1)


def _add_reduce_in_flight(estimate: Estimate, in_flight: int) -> Estimate:
    notes = [*estimate.notes, f"fsdp: {format_bytes(in_flight)} for one block's gradients still in their "
                              "reduce-scatter when the next block's arrive (the collective's timing decides; counted)"]
    return replace(estimate, peak_bytes=estimate.peak_bytes + in_flight, live_peak_bytes=estimate.live_peak_bytes + in_flight,
                   breakdown={**estimate.breakdown, "reduce_in_flight": in_flight}, notes=notes)


def _add_gradient_buckets(estimate: Estimate, buckets: int) -> Estimate:
    """DDP reduces gradients through flat buckets of its own, as large as the gradients, for the whole run."""
    notes = [*estimate.notes, f"ddp: {format_bytes(buckets)} of gradient buckets, held for the whole run"]
    return replace(estimate, peak_bytes=estimate.peak_bytes + buckets, live_peak_bytes=estimate.live_peak_bytes + buckets,
                   breakdown={**estimate.breakdown, "gradient_buckets": buckets}, notes=notes)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks in this one process, this being rank 0 (meshes over it:
    runner/parallel/mesh.py's `build_mesh`, as the trainer lays out each strategy)."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise EstimateUnavailable("this torch has no fake process group to predict a split model with") from None
    if dist.is_initialized():
        raise EstimateUnavailable("a process group is already up; predict a split model outside a distributed run")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
