"""Which rank this process is, joining the group, and the few collectives the trainer needs.

torchrun (ours through `--nproc`, or one the user started) puts RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/MASTER_PORT in the environment; srun's tasks get them from SLURM's variables
(runner/parallel/slurm.py); a process without them is the only rank. A rank dies with whatever
started it (runner/parallel/supervise.py). The global batch is a pure function of (seed, step) (runner/builders/data.py), so a
rank's part of it is a pure function of (seed, step, rank): resume and any micro-batch see the
same samples on every world size.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..environment import check_torchrun
from ..problems import InputError, Place, Problem
from ..recipe.recipe import Recipe, largest_divisor_at_most
from .mesh import build_mesh, data_coordinate, node_problem
from .slurm import adopt
from .supervise import die_with_parent

log = logging.getLogger(__name__)

TIMEOUT = timedelta(minutes=10)  # a rank that died is found by torchrun long before this


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # a process group is up: collectives and DCP checkpoints apply
    data: tuple[int, int] | None = None  # (data-parallel index, groups); None: every rank sees its own samples
    mesh: object = field(default=None, compare=False, repr=False)  # the joined ranks' DeviceMesh (parallel/mesh.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the global batch this rank trains on: the ranks of one tensor-parallel group
        share one, as they split the same samples' layers."""
        return self.rank if self.data is None else self.data[0]

    @property
    def data_size(self) -> int:
        """How many shares the global batch splits into (the data-parallel groups)."""
        return self.world_size if self.data is None else self.data[1]

    def share(self, batch_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's samples in the global batch."""
        per_group = batch_size // self.data_size
        return self.data_rank * per_group, (self.data_rank + 1) * per_group


SINGLE = Ranks()


def from_environment() -> Ranks:
    """The ranks torchrun (or srun) announced, or SINGLE outside them."""
    if adopt(os.environ):
        log.info("srun: task %s of %s joins one group at %s:%s (SLURM's variables)", os.environ["RANK"],
                 os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    check_torchrun(os.environ)  # WORLD_SIZE alone, RANK=x: one line naming the variable, not an internal error
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def join(recipe: Recipe, source: str = "<recipe>") -> Ranks:
    """Join the process group torchrun set up (when the recipe distributes), after checking that the
    recipe fits the world size, and lay the ranks out as the strategy's device mesh; SINGLE when there
    is nothing to join."""
    ranks = from_environment()
    strategy = recipe.distributed
    check_layout(recipe, ranks.world_size, source)  # strategy none on many ranks among the rest
    if not strategy.mesh_dims(ranks.world_size):  # one process: nothing to join
        return SINGLE
    if "WORLD_SIZE" not in os.environ:
        log.info("distributed.strategy %s, but no torchrun environment: training as one process without it "
                 "(start ranks with --nproc N or torchrun)", strategy.label())
        return SINGLE
    check_world(recipe, ranks.world_size, source)
    log.debug("rank %d dies with its parent: %s", ranks.rank, die_with_parent())
    backend = _backend(recipe)
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=TIMEOUT)
    if not ranks.is_main:
        logging.getLogger("ckrun").setLevel(logging.WARNING)  # one log, rank 0's; problems still show
    mesh = build_mesh(strategy, ranks.world_size, "cuda" if backend == "nccl" else "cpu")
    joined = Ranks(ranks.rank, ranks.world_size, ranks.local_rank, joined=True,
                   data=data_coordinate(strategy, ranks.rank, ranks.world_size), mesh=mesh)
    _log_joined(joined, recipe, backend)
    return joined


def _log_joined(ranks: Ranks, recipe: Recipe, backend: str) -> None:
    dims = recipe.distributed.mesh_dims(ranks.world_size)
    spread = node_problem(dims, int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world_size)))
    if spread and ranks.is_main:
        log.warning("distributed: %s", spread)
    log.info("rank %d of %d joined (%s backend, mesh %s): %s; %d samples of the global batch %d each", ranks.rank,
             ranks.world_size, backend, " x ".join(f"{name} {size}" for name, size in dims.items()),
             recipe.distributed.describe(ranks.world_size), recipe.train.batch_size // ranks.data_size,
             recipe.train.batch_size)


def _backend(recipe: Recipe) -> str:
    """nccl when the ranks train on GPUs, gloo on CPU (FSDP2 and DCP both run on gloo)."""
    wanted = recipe.train.device
    on_gpu = wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu else "gloo"


def check_layout(recipe: Recipe, world_size: int, source: str = "<recipe>") -> None:
    """The strategy must lay out `world_size` ranks (hsdp's shard and tp's tensor divide it; none is one)."""
    problem = recipe.distributed.world_problem(world_size)
    if problem:
        raise InputError([Problem(Place(source), recipe.distributed.layout_key, problem)])


def check_world(recipe: Recipe, world_size: int, source: str = "<recipe>") -> None:
    """A distributing strategy must lay out `world_size` ranks, the global batch must split evenly over
    its data-parallel groups, and the micro-batch must divide a group's share. A recipe of strategy
    none is checked as the tuner lays it out for `--nproc` (ddp or fsdp: every rank a share)."""
    distributes = bool(recipe.distributed.mesh_dims(max(world_size, 2)))
    if distributes:
        check_layout(recipe, world_size, source)
    groups = recipe.distributed.data_parallel(world_size) if distributes else world_size
    batch = recipe.train.batch_size
    ranks = f"{world_size} ranks" if groups == world_size else f"{groups} data-parallel groups of {world_size} ranks"
    if batch % groups:
        fits = [n for n in range(1, min(batch, 64) + 1) if batch % n == 0]
        raise InputError([Problem(Place(source), "train.batch_size", f"{batch} does not split over {ranks}; "
                                  f"use a multiple of {groups} or a rank count that divides it "
                                  f"({', '.join(map(str, fits[-6:]))})")])
    share, micro = batch // groups, recipe.memory.micro_batch
    if micro is not None and share % micro:
        raise InputError([Problem(Place(source), "memory.micro_batch", f"{micro} does not divide a rank's share "
                                  f"{share} (train.batch_size {batch} over {ranks}); use "
                                  f"{largest_divisor_at_most(share, micro)}")])
    if micro is not None and micro < share and recipe.memory.optimizer_step.updates_in_backward:
        raise InputError([Problem(Place(source), "memory.optimizer_step", f"in_backward updates each parameter as "
                                  f"soon as its gradient is accumulated, but memory.micro_batch {micro} makes "
                                  f"{share // micro} micro-batches of a rank's share {share} (train.batch_size "
                                  f"{batch} over {ranks}) and the first would update the weights the others still "
                                  "need; leave memory.micro_batch out, or use policy after")])


def leave(ranks: Ranks) -> None:
    if ranks.joined and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def reduce_step_record(record: dict, loss: torch.Tensor, ranks: Ranks, batch_size: int) -> dict:
    """A step's record for the whole group: the global loss, global samples/s (the slowest rank's
    time), the highest peak over the ranks. Every rank calls it; all get the same record."""
    if not ranks.joined:
        return record
    losses = loss.detach().reshape(1).float()
    # each rank's loss is its data-parallel group's share of the global mean times the groups; the ranks
    # of a tensor group hold the same one, so the sum over all ranks is world_size times the mean
    torch.distributed.all_reduce(losses)
    worst = torch.tensor([record["step_time_s"], float(record["peak_mem_bytes"])], dtype=torch.float64,
                         device=losses.device)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    seconds, peak = worst.tolist()
    return {**record, "loss": losses.item() / ranks.world_size, "step_time_s": seconds,
            "samples_per_s": batch_size / seconds, "peak_mem_bytes": int(peak), "world_size": ranks.world_size}


def any_rank(flag: bool, ranks: Ranks) -> bool:
    """Whether `flag` holds on any rank (collective: every rank calls it); `flag` alone outside a group."""
    if not ranks.joined:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int64)
    if torch.distributed.get_backend() == "nccl":
        value = value.cuda()
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def barrier(ranks: Ranks) -> None:
    if ranks.joined:
        torch.distributed.barrier()
