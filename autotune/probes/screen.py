"""The tuner's side of the model child (autotune/probes/model_child.py): the model's facts, and screening.

The user's code runs only in that child, never in the tuner, and every answer is awaited with a
wall-clock limit (`--probe-timeout`, the same as a probe's). On a timeout, or when the child dies
(a segfault, `os._exit`, the kernel's OOM killer), its whole process group is killed and:
- while the facts are read: `tune` stops with one line naming model.name (a model that cannot even
  be built on the meta device cannot be searched; every probe would build it too);
- while the estimator builds (its warm-up step runs the forward): screening is off, every plan is
  probed, and the report says why;
- while one plan is predicted: that plan is probed unscreened, the report says why, and the next
  prediction starts a fresh child; after MAX_FAULTS such faults screening is off.

On CUDA the child predicts on fake tensors with the GPUs hidden from it: a CUDA context of its own
(0.5-0.8 GB) would sit on the card beside every probe, in its time and, where NVML cannot tell
processes apart, in its measured context. Only the solver's timing run needs the card: it gets a
child of its own that sees the GPU, stopped once the solver has answered, before any probe runs.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.predict.cuda_extras import CAPABILITY_ENV
from ckrun.runner.problems import InputError, Place, Problem
from ckrun.runner.recipe.recipe import Recipe

from .probe import exit_words, kill_group
from .warm import note_launch
from ..space.candidate import Candidate
from ..space.knobs import describe
from ..search.study import Prediction
from .warm import Cold, Forked, WarmServer, start_child

log = logging.getLogger(__name__)

MAX_FAULTS = 2  # predictions that hang or kill the child before screening is turned off for the rest
POLL_S = 0.05
CHILD_ENV = "CKRUN_MODEL_CHILD"  # test hook: a module to run instead of ckrun.autotune.probes.model_child (same protocol)


class ModelChild:
    """One model child at a time for a tune; its files go to DIR/probes/model/, its output to model.log."""

    def __init__(self, recipe: Recipe, probes: Path, device_kind: str, timeout_s: float, screen: bool, nproc: int = 1,
                 time_facts=None, warm: WarmServer | None = None):
        self.warm = warm  # a CPU tune's warm server forks this child (autotune/probes/warm.py)
        self.recipe, self.probes, self.device_kind, self.nproc = recipe, probes, device_kind, nproc
        self.timeout_s, self.screen = timeout_s, screen
        self.time_facts = time_facts  # ckrun.runner.predict.hardware.DeviceFacts: predictions carry step times
        self.directory = probes / "model"
        self.log_path = self.directory / "model.log"
        self.process: Cold | Forked | None = None
        self.requests = 0  # answer numbers go on across restarts: an old answer is never read as a new one

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, gpu: bool = False) -> None:
        """Start a child; with `gpu` (the solver's timing run) it sees the GPUs, else they are hidden."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("answer-*.json"), self.directory / "facts.json",
                      self.directory / "ready.json"]:
            stale.unlink(missing_ok=True)  # left by a killed tuner or the child before a restart
        recipe_path = self.directory / "recipe.json"
        write_atomic(recipe_path, self.recipe.model_dump_json(indent=1))
        timing = []
        if self.time_facts is not None:
            write_atomic(self.directory / "time_facts.json", self.time_facts.model_dump_json(indent=1))
            timing = ["--time-facts", str(self.directory / "time_facts.json")]
        argv = [str(recipe_path), str(self.directory), "--parent", str(os.getpid()), "--device", self.device_kind,
                "--nproc", str(self.nproc), *([] if self.screen else ["--facts-only"]), *timing]
        warm = self.warm if not gpu else None
        self.process = start_child(os.environ.get(CHILD_ENV, "ckrun.autotune.probes.model_child"), argv, self.log_path,
                                   self.environment(gpu), warm, requests=True)
        note_launch(self.probes, "model", None, self.process.pid)

    def environment(self, gpu: bool) -> dict[str, str]:
        """Ours; on CUDA without `gpu`, the GPUs hidden and the card's capability (which sizes the
        predicted cuBLAS workspaces) passed on from the device child's answer."""
        env = dict(os.environ)
        if self.device_kind != "cuda" or gpu:
            return env
        env["CUDA_VISIBLE_DEVICES"] = ""
        try:
            capability = json.loads((self.probes / "device.result.json").read_text(encoding="utf-8"))["capability"]
        except (OSError, ValueError, KeyError):
            capability = None  # no device child ran (a test's fake): the estimate assumes Hopper and says so
        if capability:
            env[CAPABILITY_ENV] = capability
        return env

    def facts(self) -> dict:
        return self._await("facts.json", "building the model on the meta device")

    def ready(self) -> dict:
        return self._await("ready.json", "running the estimator's warm-up step (the model's forward and backward "
                                         "on fake tensors)")

    def ask(self, candidate: Candidate) -> dict:
        number, self.requests = self.requests, self.requests + 1
        request = {"id": number, **candidate.request()}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is gone: _await says how it ended
        return self._await(f"answer-{number}.json", f"predicting {describe(candidate)}")

    def ask_frontier(self, frontier: dict) -> dict:
        """The solver's plans (see model_child); the same protocol and time limit as a prediction."""
        number, self.requests = self.requests, self.requests + 1
        try:
            self.process.stdin.write(json.dumps({"id": number, "frontier": frontier}) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the child is gone: _await says how it ended
        return self._await(f"answer-{number}.json", "solving per-block plans")

    def stop(self) -> int | None:
        """Kill the child's whole group (the user's code may have started processes), reap it, and
        return its exit status."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        kill_group(process.pid)  # before reaping: the group id names only this child's processes
        code = process.reap()
        try:
            process.stdin.close()
        except OSError:
            pass  # the pipe broke with the child
        return code

    def _await(self, name: str, doing: str) -> dict:
        """The answer in `name`, or a `timeout` / `died` answer after which the child is gone."""
        path, deadline = self.directory / name, time.monotonic() + self.timeout_s
        while not path.exists():
            ended = self.process.exited()
            if ended and not path.exists():  # exited: an answer written just before counts
                code = self.stop()
                return {"status": "died", "reason": f"the model process {exit_words(code)} while {doing}; "
                                                    f"see {self.log_path}"}
            if not ended and time.monotonic() > deadline:
                self.stop()
                return {"status": "timeout", "reason": f"{doing} timed out after {self.timeout_s:g} s and was "
                                                       f"killed (--probe-timeout); see {self.log_path}"}
            time.sleep(POLL_S)
        return json.loads(path.read_text(encoding="utf-8"))


def read_facts(child: ModelChild, source: str) -> dict:
    """The model's facts; any failure ends `tune` with one line naming the key (model.name for a fault
    in the user's code), and the user's code checked first (its factory's arguments, eval.metrics) with
    a line per problem. A library model (transformers, torchvision) without screening is built here on
    the meta device, as only library code runs then; otherwise the child builds it."""
    recipe = child.recipe
    if child.screen or recipe.model.source == "python" or (recipe.eval is not None and recipe.eval.metrics):
        child.start()
        facts = child.facts()
    else:
        from .model_child import facts_answer

        facts = facts_answer(child.recipe, child.nproc)
    if facts["status"] == "ok":
        return facts
    child.stop()
    if facts.get("problems"):
        raise InputError([Problem(Place(source), key, message) for key, message in facts["problems"]])
    key = facts.get("key") or "model.name"
    what = "" if facts["status"] == "bad_input" else "the model's code failed: "
    raise InputError([Problem(Place(source), key, f"{what}{facts['reason']}")])


class Screening:
    """What a predictor that screens plans says of itself: whether it is off and why, and the estimate's
    warnings, each said once."""

    def __init__(self):
        self.off: str | None = None  # why screening is off
        self.warnings: list[str] = []

    def _turn_off(self, reason: str) -> None:
        self.off = reason
        log.warning("screening: off (%s): every new plan is probed", reason)

    def _warn(self, warnings: list[str]) -> None:
        for warning in warnings:
            if warning not in self.warnings:
                self.warnings.append(warning)
                log.warning("screening: the estimate may be low: %s", warning)


class IsolatedPredictor(Screening):
    """Predicted peaks for screening, from the model child; a fault costs one plan its screening."""

    def __init__(self, child: ModelChild, context_bytes: int = 0):
        super().__init__()
        self.child, self.context_bytes = child, context_bytes
        self.faults: list[str] = []
        self._ready = False

    def __call__(self, candidate: Candidate) -> Prediction | None:
        if self.off or not self._started():
            return None
        answer = self.child.ask(candidate)
        if answer["status"] == "ok":
            self._warn(answer.get("warnings", []))
            return Prediction(answer["peak_bytes"] + self.context_bytes, time=answer.get("time"))
        if answer["status"] == "unavailable":
            log.info("screening: no prediction for %s (%s): it is probed", describe(candidate), answer["reason"])
            return None
        if answer["status"] in ("died", "timeout"):
            self.faults.append(answer["reason"])
            self._ready = False  # the child is gone: the next prediction starts another
            if len(self.faults) >= MAX_FAULTS:
                self._turn_off(f"{len(self.faults)} predictions hung or killed the model process")
        log.warning("screening: %s: %s; the plan is probed unscreened", describe(candidate), answer["reason"])
        return Prediction(None, f"unscreened: {answer['reason']}")

    def frontier(self, frontier: dict) -> dict:
        """The solver's answer, or one with `status` and `reason` saying why there is none. On CUDA
        it is asked of a child that sees the GPU, stopped afterwards (see the module's docstring)."""
        # only a real timing run needs the card; predicted block times (tune --predict) reuse this child
        gpu = self.child.device_kind == "cuda" and frontier.get("timed_steps", 1) > 0
        if gpu:
            self._restart()
        if self.off or not self._started(gpu):
            return {"status": "unavailable", "reason": f"no estimator ({self.off})"}
        answer = self.child.ask_frontier(frontier)
        if answer["status"] in ("died", "timeout") or gpu:
            self._restart()  # the next prediction starts another child (on CUDA: one without a context)
        return answer

    def _restart(self) -> None:
        self.child.stop()
        self._ready = False

    def _started(self, gpu: bool = False) -> bool:
        """A child with the estimator built; False (and screening off) when the model cannot get there."""
        if self._ready:
            return True
        if not self.child.running:
            self.child.start(gpu)
            facts = self.child.facts()
            if facts["status"] != "ok":
                self._turn_off(facts["reason"])
                return False
        ready = self.child.ready()
        if ready["status"] != "ok":
            fault = ready["status"] in ("died", "timeout", "crash")
            self._turn_off(f"{'the model failed' if fault else 'the estimator cannot model this recipe'}: "
                           f"{ready['reason']}")
            self.child.stop()
            return False
        self._ready = True
        return True

    @property
    def time_facts(self):
        """The device the child's predictions price step times on (ckrun.runner.predict.hardware.DeviceFacts)."""
        return self.child.time_facts

    def summary(self) -> dict:
        """What report.json says about screening."""
        state = "off" if self.off else "on"
        return {"state": state, "reason": self.off or "", "faults": list(self.faults), "warnings": list(self.warnings)}
