"""SLURM: `srun ckrun RECIPE` forms one group from SLURM's variables, as a torchrun group would.

Two layouts, as with Lightning's SLURMEnvironment, which this follows:
- one task per GPU (`srun --ntasks-per-node=8 ckrun RECIPE`): every task is a rank. SLURM_PROCID
  is its rank, SLURM_STEP_NUM_TASKS the world size, SLURM_LOCALID its rank on the node;
- one task per node (`srun --ntasks-per-node=1 ckrun RECIPE --nproc 8`): every task is a launcher
  that starts 8 ranks on its node (runner/parallel/launch.py); SLURM_NODEID is the node's rank.
Either way the group meets at the first host of the step's node list (SLURM_STEP_NODELIST, else
SLURM_JOB_NODELIST or SLURM_NODELIST, hostlist syntax expanded: `gpu[01-04,07]`), on port 15000 +
the job id's last four digits (12910 without a job id); MASTER_ADDR and MASTER_PORT, when set, win.

Only tasks srun started are ranks: srun alone sets SLURM_STEP_NUM_TASKS. A batch script itself,
or an salloc shell, has started no step: ckrun there is one process (or `--nproc`'s ranks on this
node). Jobs named `bash` or `interactive` are left alone, as Lightning leaves them (a shell got
with `srun --pty bash` starts its own runs).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..problems import InputError, Place, Problem

INTERACTIVE = ("bash", "interactive")
_GROUP = re.compile(r"\[([^\[\]]*)\]")


@dataclass(frozen=True)
class Step:
    """An srun step's tasks, as SLURM describes them to each."""

    task: int  # SLURM_PROCID
    tasks: int  # SLURM_STEP_NUM_TASKS
    local: int  # SLURM_LOCALID
    node: int  # SLURM_NODEID
    nodes: int  # SLURM_STEP_NUM_NODES
    address: str  # the first host of the step's nodes
    port: int
    job: str

    @property
    def tasks_per_node(self) -> int:
        return self.tasks // max(1, self.nodes)


def expand_hostlist(text: str) -> list[str]:
    """`a[01-03,7],b` -> a01 a02 a03 a7 b: every host of a SLURM hostlist, in order, zero padding kept
    (a range's padding is its low bound's width); several bracket groups in one name multiply."""
    hosts = []
    for name in _split_top(text.replace(" ", ",")):
        parts = _GROUP.split(name)  # literal, group, literal, group, ... literal
        choices = [[part] if i % 2 == 0 else _numbers(part, text) for i, part in enumerate(parts)]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    names, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    return [name for name in [*names, current] if name]


def _numbers(group: str, text: str) -> list[str]:
    numbers = []
    for item in group.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{text!r} is not a SLURM hostlist: [{group}] holds {item!r}")
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return numbers


def job_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT, else 15000 + the job id's last four digits (Lightning's choice: every task of the
    job computes the same one, and jobs sharing a node rarely collide), else 12910."""
    if environ.get("MASTER_PORT"):
        return int(environ["MASTER_PORT"])
    job = environ.get("SLURM_JOB_ID", "")
    return 15000 + int(job[-4:]) if job.isdigit() else 12910


def srun_step(environ: Mapping[str, str] = os.environ) -> Step | None:
    """The srun step this process is a task of; None outside one (or in an interactive job)."""
    if "SLURM_STEP_NUM_TASKS" not in environ or environ.get("SLURM_JOB_NAME") in INTERACTIVE:
        return None
    try:
        nodes = next(environ[key] for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                     if environ.get(key))
        address = environ.get("MASTER_ADDR") or expand_hostlist(nodes)[0]
        return Step(int(environ["SLURM_PROCID"]), int(environ["SLURM_STEP_NUM_TASKS"]),
                    int(environ.get("SLURM_LOCALID", "0")), int(environ.get("SLURM_NODEID", "0")),
                    int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES") or 1), address,
                    job_port(environ), environ.get("SLURM_JOB_ID", ""))
    except (KeyError, StopIteration, ValueError, IndexError) as err:
        raise InputError([Problem(Place("SLURM"), "", f"srun started this task, but its variables cannot be read "
                                  f"({_why(err)}); ckrun needs SLURM_PROCID, SLURM_STEP_NUM_TASKS and a node list")]) \
            from None


def _why(err: Exception) -> str:
    return f"{err.args[0]} unset" if isinstance(err, KeyError) else str(err) or "no node list"


def adopt(environ: os._Environ | dict = os.environ) -> Step | None:
    """One task per GPU: put this task's rank into torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT), so joining and everything that asks which rank this is read one set.
    Nothing when torchrun's are set already, outside an srun step, or for a step of one task."""
    if "WORLD_SIZE" in environ:
        return None
    step = srun_step(environ)
    if step is None or step.tasks == 1:
        return None
    environ.update({"RANK": str(step.task), "WORLD_SIZE": str(step.tasks), "LOCAL_RANK": str(step.local),
                    "LOCAL_WORLD_SIZE": str(step.tasks_per_node), "MASTER_ADDR": step.address,
                    "MASTER_PORT": str(step.port)})
    return step


def check_node_launch(step: Step, nproc: int) -> None:
    """`--nproc N` under srun: one launcher per node, so one task per node."""
    if step.tasks != step.nodes:
        raise InputError([Problem(Place("--nproc"), "", f"srun started {step.tasks} tasks on {step.nodes} node(s); "
                                  f"with --nproc {nproc} each task starts {nproc} ranks on its node, so start one "
                                  "task per node (srun --ntasks-per-node=1), or one task per GPU without --nproc")])


def allocation_hint(nproc: int, environ: Mapping[str, str] = os.environ) -> str | None:
    """`--nproc N` in a batch script of a job of several nodes: the ranks start on this node only."""
    nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or "1"
    if "SLURM_STEP_NUM_TASKS" in environ or not nodes.isdigit() or int(nodes) < 2:
        return None
    return (f"SLURM job of {nodes} nodes, but no srun step: starting {nproc} ranks on this node only; "
            f"`srun --ntasks-per-node=1 ckrun ... --nproc {nproc}` trains on every node")

