"""`ckrun RECIPE --nproc N`: start N ranks on this machine with torchrun's own launcher.

This is what `torchrun --standalone --nproc-per-node N -m ckrun run RECIPE ...` does (the
elastic agent, a c10d rendezvous on a free local port), called in-process through
`torch.distributed.launcher.elastic_launch` so that ckrun, not torchrun, says how the run ended.
Under srun with one task per node (runner/parallel/slurm.py) each task starts its node's N ranks and
the nodes meet at a static rendezvous on the step's first host, as `torchrun --nnodes M
--node-rank SLURM_NODEID --rdzv-backend static` would.
- exit status: the first rank that failed gives its own (2 bad input, 3 over the cap, 4 non-finite
  loss, 5 cannot write, 1 a bug); a rank killed by a signal gives 128 + that signal;
- signals: SIGINT/SIGTERM/SIGHUP to ckrun reach every rank (the agent passes them on); each rank
  stops after the step in flight, the ranks agree on which, and the status is 130/143.
Nothing here trains: the ranks are fresh `python -m ckrun run ...` processes that join the
group themselves (runner/parallel/ranks.py), exactly as under a torchrun the user started.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid

from .slurm import Step
from .supervise import LAUNCHER_ENV

log = logging.getLogger(__name__)


def rank_command(argv: list[str], verbose: bool = False) -> list[str]:
    """What each rank runs: this ckrun's `run` verb with the same recipe, overrides and flags (-P: the working
    directory is not searched before ckrun's own modules; the user's folders come after, see ckrun/__init__.py)."""
    return ["-P", "-m", "ckrun", *(["-v"] if verbose else []), "run", *argv]


def start_ranks(command: list[str], nproc: int, step: Step | None = None) -> None:
    """Run `python COMMAND` as `nproc` ranks of a group of their own (a fresh rendezvous on a free
    local port; under srun, this node's ranks of the step's group) and wait for them; raises what
    elastic_launch raises (ChildFailedError, SignalException)."""
    from torch.distributed.launcher.api import elastic_launch

    threads = max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # torchrun's own default, said once instead of warned
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # each rank dies with this process (runner/parallel/supervise.py)
    config = _config(nproc, step)
    where = (f"node {step.node} of {step.nodes} (srun, meeting at {config.rdzv_endpoint}"
             if config.max_nodes > 1 else "this machine (torchrun, standalone rendezvous")
    log.info("starting %d ranks on %s; %s CPU thread(s) each)", nproc, where, os.environ["OMP_NUM_THREADS"])
    _quiet_agent()
    elastic_launch(config, sys.executable)(*command)


def _config(nproc: int, step: Step | None):
    from torch.distributed.launcher.api import LaunchConfig

    common = {"nproc_per_node": nproc, "max_restarts": 0, "monitor_interval": 0.1, "start_method": "spawn"}
    if step is None or step.nodes == 1:
        return LaunchConfig(min_nodes=1, max_nodes=1, run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                            rdzv_endpoint="localhost:0", **common)
    return LaunchConfig(min_nodes=step.nodes, max_nodes=step.nodes, run_id=f"ckrun-{step.job or 'srun'}",
                        rdzv_backend="static", rdzv_endpoint=f"{step.address}:{step.port}",
                        rdzv_configs={"rank": step.node}, **common)


def launch(argv: list[str], nproc: int, verbose: bool = False, step: Step | None = None) -> int:
    """Run `ckrun run ARGV` as `nproc` ranks; returns the exit status the whole run ends with."""
    return group_status(rank_command(argv, verbose), nproc, step)


def group_status(command: list[str], nproc: int, step: Step | None = None) -> int:
    """start_ranks, its ending as an exit status: 0, the failed rank's own, or 128 + a signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        start_ranks(command, nproc, step)
        status = 0
    except ChildFailedError as err:
        status = _first_failure_status(err)
    except SignalException as err:  # the agent has already passed the signal on and waited for the ranks
        status = 128 + int(err.sigval)
        _close_rendezvous(err)
    return status


def _close_rendezvous(err: BaseException) -> None:
    """After a signal torch's agent leaves its rendezvous open (an elastic job could rejoin it) and its
    keep-alive thread running. When this frame drops the last reference to the handler while that
    thread is inside its keep-alive call, the handler is freed in the thread, and its finalizer joins
    the thread from itself: a "cannot join current thread" traceback after ckrun's own last line.
    So the handler, found in the frames the signal unwound (a WorkerSpec's rdzv_handler), is shut
    down here, in this thread, while it is still referenced."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    trace = err.__traceback__
    while trace is not None:
        for value in list(trace.tb_frame.f_locals.values()):
            handler = getattr(value, "rdzv_handler", None)
            if isinstance(handler, RendezvousHandler):
                with contextlib.suppress(Exception):  # nothing left to rejoin: only its thread matters
                    handler.shutdown()
                return
        trace = trace.tb_next


def _first_failure_status(err) -> int:
    """The exit status of the rank whose failure caused the others'. Timestamps are whole seconds, so
    they rarely tell; what a rank died of does: a ranks' own status (2-5) or an outside signal is a
    cause, an internal error (1: often gloo's "connection reset" when a peer vanished) may be a
    consequence, and SIGTERM is what the agent sends the survivors once one rank has failed."""
    def as_cause(item):
        rank, failure = item
        consequence = 2 if failure.exitcode == -signal.SIGTERM else 1 if failure.exitcode == 1 else 0
        return consequence, failure.timestamp, rank

    rank, failure = min(err.failures.items(), key=as_cause)
    code = failure.exitcode
    if code < 0:  # killed by a signal, as subprocess reports it
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        print(f"ckrun: rank {rank} was killed by {name}; the other ranks were stopped "
              "(`--resume` continues from the newest complete checkpoint)", file=sys.stderr)
        return 128 - code
    return code


def _quiet_agent() -> None:
    """The agent logs every rank's failure as a multi-line report; the rank's own line says it already."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)



def check_launch(recipe, source: str, nproc: int, step: Step | None = None) -> None:
    """`--nproc N`: what can be checked once is checked here, so a bad recipe is one line, not one per rank."""
    from ..problems import InputError, Place, Problem
    from .ranks import check_world
    from .slurm import check_node_launch

    if nproc < 1:
        raise InputError([Problem(Place("--nproc"), "", f"needs a rank count of 1 or more, got {nproc}")])
    if "WORLD_SIZE" in os.environ:
        raise InputError([Problem(Place("--nproc"), "", "ckrun already runs under torchrun (WORLD_SIZE is set); "
                                  "leave out --nproc and let torchrun start the ranks")])
    if not recipe.distributed.mesh_dims(max(nproc, 2)):  # a strategy with no rank layout: one process
        raise InputError([Problem(Place(source), "distributed.strategy", f"--nproc {nproc} needs ddp, fsdp, hsdp or "
                                  "tp to share the work (none would train the same model N times); set "
                                  "distributed.strategy")])
    if step is not None and step.tasks > 1:
        check_node_launch(step, nproc)
    check_world(recipe, nproc * (step.nodes if step is not None else 1), source)
