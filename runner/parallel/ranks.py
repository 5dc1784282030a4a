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
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..problems import InputError, Place, Problem
from ..recipe import Recipe, largest_divisor_at_most
from .slurm import adopt
from .supervise import die_with_parent

log = logging.getLogger(__name__)

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
TIMEOUT = timedelta(minutes=10)  # a rank that died is found by torchrun long before this


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    joined: bool = False  # a process group is up: collectives and DCP checkpoints apply

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, batch_size: int) -> tuple[int, int]:
        """[start, stop) of this rank's samples in the global batch."""
        per_rank = batch_size // self.world_size
        return self.rank * per_rank, (self.rank + 1) * per_rank


SINGLE = Ranks()


def from_environment() -> Ranks:
    """The ranks torchrun (or srun) announced, or SINGLE outside them."""
    if adopt(os.environ):
        log.info("srun: task %s of %s joins one group at %s:%s (SLURM's variables)", os.environ["RANK"],
                 os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    missing = [key for key in ENV_KEYS if key not in os.environ]
    if missing:
        raise RuntimeError(f"torchrun environment incomplete: {', '.join(missing)} unset")
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def join(recipe: Recipe, source: str = "<recipe>") -> Ranks:
    """Join the process group torchrun set up (when the recipe distributes), after checking that the
    recipe fits the world size; SINGLE when there is nothing to join."""
    ranks = from_environment()
    strategy = recipe.distributed.strategy
    if ranks.world_size > 1 and strategy == "none":
        raise InputError([Problem(Place(source), "distributed.strategy", f"torchrun started {ranks.world_size} ranks "
                                  "but distributed.strategy is none (each would train alone); set ddp or fsdp")])
    if strategy == "none":
        return SINGLE
    if "WORLD_SIZE" not in os.environ:
        log.info("distributed.strategy %s, but no torchrun environment: training as one process without it "
                 "(start ranks with --nproc N or torchrun)", strategy)
        return SINGLE
    check_world(recipe, ranks.world_size, source)
    log.debug("rank %d dies with its parent: %s", ranks.rank, die_with_parent())
    backend = _backend(recipe)
    if backend == "nccl":
        torch.cuda.set_device(ranks.local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, timeout=TIMEOUT)
    if not ranks.is_main:
        logging.getLogger("runner").setLevel(logging.WARNING)  # one log, rank 0's; problems still show
    log.info("rank %d of %d joined (%s backend, %s): %d samples of the global batch %d each", ranks.rank,
             ranks.world_size, backend, strategy, recipe.train.batch_size // ranks.world_size, recipe.train.batch_size)
    return Ranks(ranks.rank, ranks.world_size, ranks.local_rank, joined=True)


def _backend(recipe: Recipe) -> str:
    """nccl when the ranks train on GPUs, gloo on CPU (FSDP2 and DCP both run on gloo)."""
    wanted = recipe.train.device
    on_gpu = wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available())
    return "nccl" if on_gpu else "gloo"


def check_world(recipe: Recipe, world_size: int, source: str = "<recipe>") -> None:
    """The global batch must split evenly over the ranks, and the micro-batch must divide a rank's share."""
    batch = recipe.train.batch_size
    if batch % world_size:
        fits = [n for n in range(1, min(batch, 64) + 1) if batch % n == 0]
        raise InputError([Problem(Place(source), "train.batch_size", f"{batch} does not split over {world_size} ranks; "
                                  f"use a multiple of {world_size} or a rank count that divides it "
                                  f"({', '.join(map(str, fits[-6:]))})")])
    share, micro = batch // world_size, recipe.memory.micro_batch
    if micro is not None and share % micro:
        raise InputError([Problem(Place(source), "memory.micro_batch", f"{micro} does not divide a rank's share "
                                  f"{share} (train.batch_size {batch} over {world_size} ranks); use "
                                  f"{largest_divisor_at_most(share, micro)}")])


def leave(ranks: Ranks) -> None:
    if ranks.joined and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def reduce_step_record(record: dict, loss: torch.Tensor, ranks: Ranks, batch_size: int) -> dict:
    """A step's record for the whole group: the global loss, global samples/s (the slowest rank's
    time), the highest peak over the ranks. Every rank calls it; all get the same record."""
    if not ranks.joined:
        return record
    losses = loss.detach().reshape(1).float()
    torch.distributed.all_reduce(losses)  # each rank's loss is its share of the global mean
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
