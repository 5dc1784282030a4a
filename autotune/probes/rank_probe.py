"""A probe of `ckrun tune --nproc N`: one candidate measured by N ranks, a torchrun group of its own.

The probe child (autotune/probes/child.py) becomes the group's agent: it starts N ranks through torchrun's
launcher (`ckrun.runner.parallel.launch.start_ranks`, a fresh rendezvous on a free port, so no two probes
ever share a process group), each rank being the same child module under torchrun's environment.
Every rank measures the steps together with the others (the trainer reduces a step's record over
the ranks: the slowest rank's time, the highest peak) and writes RESULT.rank-K.json. The agent
then writes the one RESULT.json the tuner reads.

When a rank fails, its peers fail after it (a collective that lost a peer, or torchrun's SIGTERM),
so the result names the rank whose failure was the cause: over the cap or out of memory first,
then bad input, then a rank killed without reporting (a segfault, the kernel's OOM killer), then a
crash, and last the ranks torchrun stopped with SIGTERM because another had failed.

Kills: the tuner kills the agent's process group on a timeout; torchrun starts each rank in a
session of its own, so each rank also watches the agent (`die_with_parent`) and every rank notes
its pid in probes.log, where the tuner finds the groups to kill after a timeout.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from pydantic import ValidationError

from ckrun.runner.disk.files import write_atomic

from ..records import ProbeResult

# why a probe failed, most likely cause first: a peer's crash usually follows another rank's failure
_CAUSE_ORDER = {"over_cap": 0, "oom": 0, "bad_input": 1, "killed": 2, "crash": 3, "stopped": 4, "silent": 5}


def rank_result_path(result: Path, rank: int) -> Path:
    return result.with_name(f"{result.stem}.rank-{rank}.json")


def rank_command(module: str, recipe: str, result: str, trial: int, warmup: int, timed: int, nproc: int) -> list[str]:
    """What each rank runs: the probe child again, watching this agent."""
    return ["-m", module, "probe", recipe, result, "--parent", str(os.getpid()), "--trial", str(trial),
            "--warmup", str(warmup), "--timed", str(timed), "--nproc", str(nproc)]


def run_group(command: list[str], result: Path, nproc: int) -> ProbeResult:
    """As the agent: run the ranks, wait for them, and combine what each reported."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ckrun.runner.parallel.launch import start_ranks

    for rank in range(nproc):
        rank_result_path(result, rank).unlink(missing_ok=True)  # a killed probe's files are not this one's
    exit_codes: dict[int, int] = {}
    try:
        start_ranks(command, nproc)
    except ChildFailedError as err:
        exit_codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
    return combine({rank: _read(rank_result_path(result, rank)) for rank in range(nproc)}, exit_codes)


def _read(path: Path) -> ProbeResult | None:
    try:
        return ProbeResult.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValidationError):
        return None  # the rank died before its atomic write


def combine(results: dict[int, ProbeResult | None], exit_codes: dict[int, int]) -> ProbeResult:
    """The group's result: rank 0's when every rank measured, else the failure that caused the others."""
    if all(result is not None and result.status == "ok" for result in results.values()):
        return results[0].model_copy(update={"world_size": len(results)})
    failed = [r for r, result in results.items() if result is None or result.status != "ok"]
    rank = min(failed, key=lambda r: (_CAUSE_ORDER[_cause(results[r], exit_codes.get(r))], r))
    result = results[rank]
    if result is None:
        return ProbeResult.failed("died", f"rank {rank} of {len(results)} {_silent_words(exit_codes.get(rank))} "
                                          "before reporting; see the probe's log")
    return result.model_copy(update={"reason": f"rank {rank} of {len(results)}: {result.reason or result.status}",
                                     "world_size": len(results)})


def _cause(result: ProbeResult | None, exit_code: int | None) -> str:
    if result is None:  # SIGTERM is how torchrun stops the survivors of a failed rank: a consequence
        if exit_code == -signal.SIGTERM:
            return "stopped"
        return "killed" if exit_code is not None and exit_code < 0 else "silent"
    return result.status if result.status in _CAUSE_ORDER else "crash"


def _silent_words(exit_code: int | None) -> str:
    from .probe import exit_words

    return "ended" if exit_code is None else exit_words(exit_code)


def write_rank_result(result: Path, rank: int, measured: ProbeResult) -> int:
    """A rank's own result file; the exit status tells torchrun whether to stop the other ranks."""
    write_atomic(rank_result_path(result, rank), measured.to_json())
    return 0 if measured.status == "ok" else 1
