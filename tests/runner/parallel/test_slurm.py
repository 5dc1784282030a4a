"""SLURM on one machine, its variables faked: `srun ckrun RECIPE` (one task per GPU) and `srun
--ntasks-per-node=1 ckrun RECIPE --nproc N` (one task per node) form one group of 2 CPU ranks (gloo),
not independent copies (issue 25, defect 2); the hostlist syntax, the port and which processes are
srun's tasks, as Lightning's SLURMEnvironment reads them."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import children
from conftest import ROOT, read_metrics
from ckrun.runner.parallel.slurm import adopt, allocation_hint, check_node_launch, expand_hostlist, job_port, srun_step
from ckrun.runner.disk.lock import DirLock
from ckrun.runner.problems import InputError

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "model.config.dropout=0.0", "data.seq_len=16", "data.vocab_size=64",
        "train.batch_size=8", "train.device=cpu", "train.steps=4", "output.checkpoint_every=2",
        "train.optimizer={name: sgd, lr: 0.5}", "precision=fp32", "distributed.strategy=ddp"]


@pytest.mark.parametrize(("text", "hosts"), [
    ("gpu01", ["gpu01"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[9-11],b,c[5]", ["a9", "a10", "a11", "b", "c5"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("host0 host1", ["host0", "host1"]),
])
def test_a_hostlist_expands_in_order_with_its_padding(text, hosts):
    assert expand_hostlist(text) == hosts


@given(st.lists(st.tuples(st.sampled_from(["gpu", "node-a", "x"]), st.integers(0, 120), st.integers(0, 5),
                          st.integers(1, 4)), min_size=1, max_size=4))
def test_ranges_expand_to_every_number_they_name(ranges):
    text = ",".join(f"{name}[{low:0{width}d}-{low + span:0{width}d}]" for name, low, span, width in ranges)
    expected = [f"{name}{n:0{width}d}" for name, low, span, width in ranges for n in range(low, low + span + 1)]
    assert expand_hostlist(text) == expected


def _step_env(**extra) -> dict:
    return {"SLURM_JOB_ID": "4107736", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "3",
            "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]", **extra}


def test_an_srun_task_becomes_a_rank_of_one_group_at_the_first_host():
    environ = _step_env()
    step = adopt(environ)
    assert step.tasks_per_node == 4 and job_port(environ) == 15000 + 7736
    assert {k: environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "MASTER_ADDR": "gpu07", "MASTER_PORT": "22736"}


@pytest.mark.parametrize("environ", [
    {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"},  # the batch script itself: no step started
    _step_env(SLURM_JOB_NAME="interactive"),  # a shell from `srun --pty`, as Lightning leaves it
    _step_env(WORLD_SIZE="2"),  # torchrun under srun: torchrun's variables win
    _step_env(SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_STEP_NUM_NODES="1",
              SLURM_STEP_NODELIST="gpu07"),  # a one-task step: one process
])
def test_processes_that_are_not_ranks_of_a_step_are_left_alone(environ):
    before = dict(environ)
    assert adopt(environ) is None and environ == before


def test_nproc_in_the_batch_script_of_several_nodes_says_it_trains_on_one():
    assert "srun --ntasks-per-node=1" in allocation_hint(8, {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "1"})
    assert allocation_hint(8, {"SLURM_JOB_NUM_NODES": "1"}) is None
    assert allocation_hint(8, _step_env(SLURM_JOB_NUM_NODES="2")) is None  # a task of a step: it knows its node


def test_unreadable_or_misshapen_steps_are_one_line():
    with pytest.raises(InputError, match="SLURM_PROCID unset"):
        srun_step({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NODELIST": "a"})
    with pytest.raises(InputError, match="not a SLURM hostlist"):
        srun_step(_step_env(SLURM_STEP_NODELIST="gpu[a-b]"))
    with pytest.raises(InputError, match="--ntasks-per-node=1"):
        check_node_launch(srun_step(_step_env()), 4)  # 8 tasks on 2 nodes, each asking for --nproc 4


def _free_port() -> int:
    """A free port that 15000 + a job id's last four digits can name."""
    while True:
        port = random.randint(15000, 24999)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def _tasks(args: list, count: int, per_node: bool = False) -> list[subprocess.Popen]:
    """`srun -n COUNT ckrun ARGS` as SLURM would start it on this one machine, named 127.0.0.1."""
    port, processes = _free_port(), []
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CKRUN_LAUNCHER_PID")}
    for task in range(count):
        env = {**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": f"9{port - 15000:04d}",
               "SLURM_PROCID": str(task), "SLURM_STEP_NUM_TASKS": str(count), "SLURM_STEP_NODELIST": "127.0.0.1",
               "SLURM_LOCALID": "0" if per_node else str(task), "SLURM_NODEID": str(task) if per_node else "0",
               "SLURM_STEP_NUM_NODES": str(count) if per_node else "1"}
        processes.append(subprocess.Popen([sys.executable, "-m", "ckrun", *map(str, args)], env=env, text=True,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return processes


def _ends(processes) -> list[tuple[int, str]]:
    errs = [children.wait(process)[1] for process in processes]
    return [(process.returncode, err) for process, err in zip(processes, errs, strict=True)]


@pytest.mark.parametrize("per_node", [False, True], ids=["task-per-rank", "task-per-node"])
def test_srun_tasks_train_as_one_group(tmp_path, per_node):
    out = tmp_path / "run"
    extra = ["--nproc", 1] if per_node else []
    ended = _ends(_tasks([STACK, *TINY, f"output.dir={out}", *extra], 2, per_node))
    assert all(code == 0 for code, _ in ended), ended
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # one group: each step once, by rank 0
    assert all(r["world_size"] == 2 for r in records)
    assert json.loads((out / "checkpoints" / "step-00000004" / "trainer.json").read_text())["world_size"] == 2


def test_a_group_refused_its_directory_says_so_once_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with DirLock(out / "run.lock", "`ckrun` run", f"is training into {out}"):
        ended = _ends(_tasks([STACK, *TINY, f"output.dir={out}"], 2))
    assert [code for code, _ in ended] == [2, 2], ended
    lines = [line for _, err in ended for line in err.splitlines() if "output.dir:" in line]
    assert len(lines) == 1 and f"another `ckrun` run (pid {os.getpid()}) is training into" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["run.lock"]
