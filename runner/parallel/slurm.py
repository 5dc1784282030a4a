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
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..environment import check, problem, whole_number
from ..problems import InputError, Place, Problem

INTERACTIVE = ("bash", "interactive")
MOST_HOSTS = 100_000  # a hostlist naming more is a typo ('gpu[1-300000000]' filled memory for minutes)
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


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


def expand_hostlist(text: str, most: int = MOST_HOSTS) -> list[str]:
    """`a[01-03,7],b` -> a01 a02 a03 a7 b: every host of a SLURM hostlist, in order, zero padding kept
    (a range's padding is its low bound's width); several bracket groups in one name multiply. A
    ValueError for a list of more than `most` hosts, counted before any is written out."""
    names = []
    for name in _split_top(text.replace(" ", ",")):
        parts = _GROUP.split(name)  # literal, group, literal, group, ... literal
        groups = [_ranges(part, text) for part in parts[1::2]]
        names.append((parts, groups))
    count = sum(math.prod(sum(high - low + 1 for low, high, _ in group) for group in groups) for _, groups in names)
    if count > most:
        raise ValueError(f"{text[:60]!r} names {count:,} hosts, more than {most:,}: a typo in the node list?")
    hosts = []
    for parts, groups in names:
        choices = [[part] if i % 2 == 0 else _numbers(groups[i // 2]) for i, part in enumerate(parts)]
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


def _ranges(group: str, text: str) -> list[tuple[int, int, int]]:
    """A bracket group's ranges as (low, high, padding width)."""
    ranges = []
    for item in group.split(","):
        low, _, high = item.partition("-")
        if not (low.isascii() and low.isdigit()) or (high and not (high.isascii() and high.isdigit())) \
                or int(high or low) < int(low):
            raise ValueError(f"{text[:60]!r} is not a SLURM hostlist: [{group[:40]}] holds {item[:20]!r}")
        ranges.append((int(low), int(high or low), len(low)))
    return ranges


def _numbers(ranges: list[tuple[int, int, int]]) -> list[str]:
    return [str(n).zfill(width) for low, high, width in ranges for n in range(low, high + 1)]


def job_port(environ: Mapping[str, str]) -> int:
    """MASTER_PORT, else 15000 + the job id's last four digits (Lightning's choice: every task of the
    job computes the same one, and jobs sharing a node rarely collide), else 12910."""
    port = whole_number("MASTER_PORT", 1, 65535, environ, fix="a TCP port")
    if port is not None:
        return port
    job = environ.get("SLURM_JOB_ID", "")
    return 15000 + int(job[-4:]) if job.isascii() and job.isdigit() else 12910


def srun_step(environ: Mapping[str, str] = os.environ) -> Step | None:
    """The srun step this process is a task of; None outside one (or in an interactive job). Each
    variable is checked as a recipe key is: one line naming it (exit 2)."""
    if "SLURM_STEP_NUM_TASKS" not in environ or environ.get("SLURM_JOB_NAME") in INTERACTIVE:
        return None
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"):
        if not environ.get(name, "").strip():
            raise _unreadable(f"{name} unset")
    tasks = whole_number("SLURM_STEP_NUM_TASKS", 1, 1 << 20, environ)
    task = whole_number("SLURM_PROCID", 0, tasks - 1, environ, fix=f"the step has {tasks} task(s), counted from 0")
    nodes = whole_number("SLURM_STEP_NUM_NODES", 1, tasks, environ) or whole_number("SLURM_NNODES", 1, None, environ) or 1
    local = whole_number("SLURM_LOCALID", 0, tasks - 1, environ, default=0)
    node = whole_number("SLURM_NODEID", 0, max(nodes - 1, 0), environ, default=0,
                        fix=f"the step has {nodes} node(s), counted from 0")
    listed = next((key for key in _NODE_LISTS if environ.get(key)), None)
    if listed is None and not environ.get("MASTER_ADDR"):
        raise _unreadable("no node list")
    try:
        address = environ.get("MASTER_ADDR") or expand_hostlist(environ[listed])[0]
    except (ValueError, IndexError) as err:
        raise problem(listed, f"{err or 'names no host'}; srun sets it, so unset it if you set it by hand") from None
    return Step(task, tasks, local, node, nodes, address, job_port(environ), environ.get("SLURM_JOB_ID", ""))


def _unreadable(why: str) -> InputError:
    return InputError([Problem(Place("SLURM"), "", f"srun started this task, but its variables cannot be read "
                               f"({why}); ckrun needs SLURM_PROCID, SLURM_STEP_NUM_TASKS and a node list")])


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


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Every environment variable a run or a tune reads, checked before it starts (one line naming the
    first bad one, exit 2): ckrun's own and torchrun's (runner/environment.py), then SLURM's here."""
    check(environ)
    srun_step(environ)


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

