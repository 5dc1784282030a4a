"""`ckrun estimate --nproc N`: the peak of one rank's step, predicted on fake tensors in one process.

Each rank runs the step on its share of the global batch (train.batch_size / N), so that is the
batch the prediction runs. On top of it:
- fsdp: the model is really sharded, by FSDP2's own `fully_shard` (per block, then the root, with
  the recipe's sharding knobs and mixed precision), over torch's fake process group of N ranks
  (collectives are no-ops, shapes are real), on fake tensors. The tracker then counts what rank 0
  holds: 1/N of parameters, gradients and optimizer state, plus the blocks' gathered parameters and
  unsharded gradients while they are in flight, as FSDP2 allocates them.
- ddp: the whole model per rank, plus DDP's gradient buckets (one more copy of the gradients, into
  which it reduces).
The fake process group is a torch testing API; where a torch lacks it, fsdp prediction says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from ..parallel.ranks import check_world
from ..parallel.wrap import shard
from ..recipe import Recipe
from ..units import format_bytes
from .estimate import Estimate, EstimateUnavailable, Estimator
from .hardware import DeviceFacts


def per_rank(nproc: int, source: str = "<recipe>"):
    """An estimator factory, `(recipe, device) -> object with .estimate()`, for one of `nproc` ranks."""

    def make(recipe: Recipe, device: str, facts: DeviceFacts | None = None):
        return _RankEstimate(recipe, device, nproc, source, facts)

    return make


class _RankEstimate:
    def __init__(self, recipe: Recipe, device: str, nproc: int, source: str, facts: DeviceFacts | None = None):
        check_world(recipe, nproc, source)  # the batch must split, as --nproc demands
        self.recipe, self.device, self.nproc, self.source, self.facts = recipe, device, nproc, source, facts
        share = recipe.train.model_copy(update={"batch_size": recipe.train.batch_size // nproc})
        self.share = recipe.model_copy(update={"train": share})

    def estimate(self) -> Estimate:
        strategy = self.recipe.distributed.strategy
        if strategy == "fsdp" and self.nproc > 1:
            with fake_process_group(self.nproc) as mesh:
                estimate = _ShardedEstimator(self.share, self.device, mesh, self.source, self.facts).estimate()
        else:
            estimator = Estimator(self.share, self.device, self.facts)
            estimator.world_size = self.nproc
            if strategy == "ddp" and self.nproc > 1:
                estimator.ddp_gradient_bytes = _gradient_bytes(self.share)
            estimate = estimator.estimate()
            if strategy == "ddp" and self.nproc > 1:
                estimate = _add_gradient_buckets(estimate, estimator.ddp_gradient_bytes)
        estimate.notes.insert(0, f"one of {self.nproc} ranks ({strategy}): its share of {self.share.train.batch_size} "
                                 f"samples of the global batch {self.recipe.train.batch_size}")
        return estimate


class _ShardedEstimator(Estimator):
    def __init__(self, recipe: Recipe, device: str, mesh, source: str, facts: DeviceFacts | None = None):
        self.mesh, self.source = mesh, source
        self.world_size = mesh.size()
        super().__init__(recipe, device, facts)

    def _prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        shard(model, self.recipe, torch.device("cpu"), self.source, self.mesh)
        return model


def _gradient_bytes(recipe: Recipe) -> int:
    from .estimate import _build_for_shapes

    with torch.device("meta"):
        model = _build_for_shapes(recipe.model)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _add_gradient_buckets(estimate: Estimate, buckets: int) -> Estimate:
    """DDP reduces gradients through flat buckets of its own, as large as the gradients, for the whole run."""
    notes = [*estimate.notes, f"ddp: {format_bytes(buckets)} of gradient buckets, held for the whole run"]
    return replace(estimate, peak_bytes=estimate.peak_bytes + buckets, live_peak_bytes=estimate.live_peak_bytes + buckets,
                   breakdown={**estimate.breakdown, "gradient_buckets": buckets}, notes=notes)


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks in this one process, this being rank 0, and its mesh."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        raise EstimateUnavailable("this torch has no fake process group to predict FSDP with") from None
    if dist.is_initialized():
        raise EstimateUnavailable("a process group is already up; predict FSDP outside a distributed run")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
