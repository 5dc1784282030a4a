"""The tuner's side of a probe: run the child, wait with a wall-clock limit, read its result.

Whatever happens in the child comes back as a `ProbeResult` with a `status` and, when it did not
measure, a one-line `reason`: ok, over_cap, oom, crash, bad_input (the child said so), timeout
(we killed it), died (it exited without a result: a segfault, the kernel's OOM killer). The
child's process group is killed after every probe, so nothing it started outlives the probe.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.memory.allocator import allocator_env
from ckrun.runner.recipe.recipe import Recipe

from ..records import ProbeResult
from .warm import Cold, Forked, WarmServer, note_launch, start_child

log = logging.getLogger(__name__)

CHILD_ENV = "CKRUN_PROBE_CHILD"  # test hook: a module to run instead of ckrun.autotune.probes.child (same arguments)


COLD_COMPILE_S = 300.0  # a cold torch.compile of BERT-large took 1-2 minutes on an H100 (2026-11-22)
# compile's caches, on disk in inductor's per-user folder: the first probe of a plan compiles, the
# next ones (the finalists' re-runs, the same graph at another cap) and the final training load it
COMPILE_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}


@dataclass(frozen=True)
class ProbeSettings:
    timeout_s: float = 600.0
    warmup_steps: int = 2  # steps 1-2 measure the peak (step 2 is the first with optimizer state)
    timed_steps: int = 3
    nproc: int = 1  # --nproc: each probe is a torchrun group of this many ranks (autotune/probes/rank_probe.py)
    compile_timeout_s: float | None = None
    """A probe with memory.compile compiles in its first step; unset: timeout_s + COLD_COMPILE_S."""

    def timeout_for(self, recipe: Recipe) -> float:
        if not recipe.memory.compile:
            return self.timeout_s
        return self.timeout_s + COLD_COMPILE_S if self.compile_timeout_s is None else self.compile_timeout_s


class ProbeRunner:
    """Runs probes for one study; each gets DIR/probes/trial-N.{recipe.json,result.json,log}."""

    def __init__(self, directory: Path, settings: ProbeSettings, warm: WarmServer | None = None):
        self.directory = directory / "probes"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.settings = settings
        self.warm = warm  # forks CPU probes from a process that has imported torch already (autotune/probes/warm.py)

    def probe(self, recipe: Recipe, trial: int) -> ProbeResult:
        stem = self.directory / f"trial-{trial}"
        extra = ["--trial", str(trial), "--warmup", str(self.settings.warmup_steps),
                 "--timed", str(self.settings.timed_steps), "--nproc", str(self.settings.nproc)]
        started = time.monotonic()
        result = ProbeResult.from_json(self._run("probe", recipe, stem, extra, self.settings.timeout_for(recipe), trial))
        result = result.model_copy(update={"probe_s": round(time.monotonic() - started, 2)})
        _warn_if_shared(result, trial)
        return result

    def device(self, recipe: Recipe, timeout_s: float = 300.0) -> dict:
        """The device's facts (`Device.from_json`), or a failed probe's status and reason."""
        return json.loads(self._run("device", recipe, self.directory / "device", [], timeout_s, None))

    def _run(self, what: str, recipe: Recipe, stem: Path, extra: list[str], timeout_s: float,
             trial: int | None) -> str:
        """The child's result file as written, or a failure the tuner saw (`_result`)."""
        recipe_path, result_path, log_path = (stem.with_name(f"{stem.name}.{s}") for s in
                                              ("recipe.json", "result.json", "log"))
        write_atomic(recipe_path, recipe.model_dump_json(indent=1))
        result_path.unlink(missing_ok=True)  # a result left by a killed tuner must not be read as this one's
        argv = [what, str(recipe_path), str(result_path), "--parent", str(os.getpid()), *extra]
        log_path.write_text("", encoding="utf-8")
        # only a CPU tune has a warm server; a compiled probe or a group of ranks starts cold even there
        warm = self.warm if self.settings.nproc == 1 and not recipe.memory.compile else None
        process = start_child(os.environ.get(CHILD_ENV, "ckrun.autotune.probes.child"), argv, log_path, child_env(recipe), warm)
        note_launch(self.directory, what, trial, process.pid)
        code = _wait(process, timeout_s)
        if trial is not None and (code is None or code < 0):
            kill_ranks(self.directory, trial)  # torchrun put each rank in a session of its own
        return _result(result_path, log_path, code, timeout_s)


def _warn_if_shared(result: ProbeResult, trial: int) -> None:
    """A probe must have the GPU to itself: the tuner keeps its own processes off it (its model child
    predicts with the GPUs hidden; this process never starts CUDA), and says so when it was not alone."""
    others = result.other_gpu_processes
    if others:
        log.warning("probe %d was timed while %d other process(es) used its GPU: its time may be off", trial, others)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        log.warning("probe %d: the tuner's own process holds a CUDA context beside the probe", trial)


def child_env(recipe: Recipe) -> dict[str, str]:
    """The probe's environment: ours, with the candidate's allocator settings in place before the child
    even imports torch (the trainer sets them again, logged, before CUDA starts), and compile's disk
    caches on unless the user turned them off."""
    env = {**COMPILE_CACHES, **os.environ}
    if recipe.memory.allocator is not None:
        env.update(allocator_env(recipe.memory.allocator))
    return env


def kill_ranks(directory: Path, trial: int) -> None:
    """Kill the groups of the ranks a probe's agent started, as they noted them in probes.log. Only
    after a timeout or a killed agent: then the ranks may still be running (a hang holding the
    interpreter keeps their own watch from acting), and their pids are seconds old."""
    try:
        lines = (directory / "probes.log").read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    ranks = []
    for line in lines:
        try:
            launch = json.loads(line)
        except ValueError:
            continue  # a line cut by a kill
        if launch.get("what") == "rank" and launch.get("trial") == trial:
            kill_group(int(launch["pid"]))
            ranks.append(int(launch["pid"]))
    _wait_gone(ranks)


def _wait_gone(groups: list[int], timeout_s: float = 10.0) -> None:
    """Killed ranks (and what they started) are not ours to reap, and dying takes a moment: on a GPU
    the next probe must not start while their memory is still held, so wait until no process of
    their groups runs (a zombie holds no memory)."""
    deadline = time.monotonic() + timeout_s
    while groups and _groups_running(set(groups)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _groups_running(groups: set[int]) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):  # no /proc: nothing found, nothing waited for
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone while we looked
        if state not in ("Z", "X") and int(group) in groups:
            return True
    return False


def _wait(process: Cold | Forked, timeout_s: float) -> int | None:
    """The exit status, or None when the probe ran out of time; the process group is gone either way."""
    exited = False
    try:
        exited = _wait_unreaped(process, timeout_s)
    finally:
        # on exit, timeout or Ctrl-C alike, and before reaping: an unreaped leader keeps its pid, so the
        # group id still names only this probe's processes (compile workers, a hung grandchild)
        kill_group(process.pid)
        code = process.reap()
    return code if exited else None


def _wait_unreaped(process: Cold | Forked, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not process.exited():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _result(result_path: Path, log_path: Path, code: int | None, timeout_s: float) -> str:
    if code is None:
        return ProbeResult.failed("timeout", f"timed out after {timeout_s:g} s; the probe was killed "
                                             f"(raise --probe-timeout if steps are this slow)").to_json()
    if result_path.exists():
        return result_path.read_text(encoding="utf-8")
    return ProbeResult.failed("died", f"the probe process {exit_words(code)} before reporting; see {log_path}").to_json()


def exit_words(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (the kernel's OOM killer, or a kill from outside)" if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {code}"
