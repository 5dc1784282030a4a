"""`ckrun tune --nproc N`: what changes when the tuned recipe trains as N ranks.

The cap holds per rank (per GPU), so a probe measures a group of N ranks (autotune/probes/rank_probe.py)
and reads the highest peak over them. The space gains the `sharding` knob (autotune/space/sharding.py:
ddp, fsdp, hsdp, tp and FSDP2's knobs) and splits each rank's share of the batch into
micro-batches. The winner trains as N ranks, started as `ckrun RECIPE --nproc N` starts them;
tuned.yaml says so in its comment.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ckrun.runner.problems import EXIT_OVER_CAP, CkrunError, InputError, Place, Problem
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.train.loop import MemoryCapExceeded, RunResult

from ..space.facts import Device


class RanksEnded(CkrunError):
    """The ranks' training ended with a status of its own (bad input, a non-finite loss, a bug); each
    rank has already said why in one line, so `tune` ends with that status and says nothing more."""

    def __init__(self, exit_code: int):
        self.exit_status = exit_code
        super().__init__(f"the ranks' training ended with exit status {exit_code}")

    def lines(self) -> list[str]:
        return []


class RanksOverCap(MemoryCapExceeded):
    """A rank's step went over the cap; the rank said where, and the next plan takes over."""

    def __init__(self, cap: int):
        self.cap, self.peak, self.step = cap, 0, 0
        RuntimeError.__init__(self, "a rank went over the memory cap in training (its line above says at which step)")


def check_ranks(recipe: Recipe, source: str, nproc: int) -> None:
    """--nproc: a rank count the recipe's global batch splits over, and not already under torchrun."""
    from ckrun.runner.parallel.ranks import check_world

    if nproc < 1:
        raise InputError([Problem(Place("--nproc"), "", f"needs a rank count of 1 or more, got {nproc}")])
    if nproc == 1:
        return
    if "WORLD_SIZE" in os.environ:
        raise InputError([Problem(Place("--nproc"), "", "ckrun tune already runs under torchrun (WORLD_SIZE is set); "
                                  "run it as one process: it starts each probe's ranks itself")])
    # micro_batch is the tuner's to choose: only the layout (a pinned hsdp or tp) and the global batch must split
    check_world(recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"micro_batch": None})}),
                nproc, source)


def check_devices(device: Device, nproc: int) -> None:
    if device.kind == "cuda" and device.count < nproc:
        raise InputError([Problem(Place("--nproc"), "", f"{nproc} ranks need {nproc} GPUs, but this machine has "
                                  f"{device.count}; give at most --nproc {device.count}")])


def ranks_comment(nproc: int) -> str | None:
    """tuned.yaml's line on how to start it."""
    if nproc == 1:
        return None
    return f"tuned for {nproc} ranks, the cap per rank (each rank's peak measured, the highest one held to it)"


def rank_training(nproc: int) -> dict:
    """train_with_fallback's keyword arguments: the winner trains as `nproc` ranks."""
    if nproc == 1:
        return {}

    def train_ranks(recipe: Recipe, source: str, resume: bool = False) -> RunResult:
        from ckrun.runner.train.run.ownership import launch_owned

        code = launch_owned(recipe, source, [source, *(["--resume"] if resume else [])], nproc, resume)
        if code == EXIT_OVER_CAP:
            raise RanksOverCap(int(recipe.memory.max_mem or 0))
        stopped = {128 + signal.SIGINT: signal.SIGINT, 128 + signal.SIGTERM: signal.SIGTERM}.get(code)
        if code and stopped is None:
            raise RanksEnded(code)
        return _run_result(recipe, int(stopped) if stopped else None)

    return {"train_fn": train_ranks}


def _run_result(recipe: Recipe, stopped_by: int | None) -> RunResult:
    """What rank 0's metrics.jsonl says of the run (the ranks' records are reduced: the highest peak)."""
    from ckrun.runner.train.output.directory import METRICS, read_metrics_lines

    path = Path(recipe.output.dir) / METRICS
    records = [r for r in (read_metrics_lines(path)[0] if path.exists() else []) if "loss" in r]
    steps = records[-1]["step"] if records else 0
    return RunResult(steps_done=steps, losses=[r["loss"] for r in records],
                     peak_mem_bytes=max((r.get("peak_mem_bytes") or 0 for r in records), default=0),
                     samples_per_s=[r["samples_per_s"] for r in records if r.get("samples_per_s")],
                     stopped_by=stopped_by, total_steps=recipe.train.steps or steps, output_dir=path.parent)
