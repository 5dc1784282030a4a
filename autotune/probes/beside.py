"""A second pricer: a process beside the tuner that makes traces for its composer on the machine's other core.

A predicted search of a large model spends most of its time tracing (runner/predict/compose.py: a trace is a
fake step of a few real blocks, a second or two for an 8B), one trace after another on one core. This process
builds the same fake model and makes traces the tuner will want, while the tuner composes and traces others:

- the solver's per-block plans (autotune/search/frontier.py) are solved here while the tuner chooses its
  starting points (its time was the search's until then), every trace it makes sent to the tuner too;
- the plans a walk of the search will price next (autotune/search/descent.py), in the order the tuner
  prices them (the cheapest to trace first: `PricedPredictor.prefetch`), are handed over, the last first,
  each as the first trace pricing it would make once those before it are priced (`Composer.traces_ahead`);
  the tuner prices from the first, and takes each trace of a plan it reaches that is made here (or being
  made: it waits for it), making the rest itself (those not started are cancelled).

Nothing the tuner decides depends on what this process did: the tuner asks for the traces it would make
alone, and takes one made here only where it serves that key (`serves`: the same key, or a block trace of the
same parts and actions with more blocks real), which composes the same wherever it was made; so a search
prices the same plans to the byte with it or without it (the solver's own traces apart: they stay here), and
only its wall time changes. Should this process die or stop answering, the tuner says so in a line and
makes its traces itself.

    python -m ckrun.autotune.probes.beside RECIPE.json --parent PID --device cpu|cuda [--time-facts FACTS.json]

Its stdin is a socket: `multiprocessing.connection` messages (pickled tuples). Tuner -> here: ("step", key,
plan JSON, precision, real blocks), ("update", key, plan JSON, precision, parameters accumulated,
micro-batches), ("cancel", key), ("frontier", request). Here -> tuner: ("broken", reason) where the
model cannot be built; ("started", key) before each trace asked for; ("trace", key,
Trace) for each trace made (the solver's unasked); ("failed", key, reason); ("frontier", answer).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.compose import Tracer
from ckrun.runner.problems import first_line

from .probe import kill_group
from .warm import note_launch

log = logging.getLogger(__name__)

SWITCH_ENV = "CKRUN_BESIDE"  # "on" / "off": overrides `wanted`'s rule (the tests' hook)
FROM_PARAMETERS = 1_000_000_000  # a model this large is searched with dozens of traces of a second or more
WAIT_S = 300.0  # the most the tuner waits for one trace or the solver's answer before it works alone


def wanted(parameters: int, nproc: int) -> str | None:
    """Why a predicted search gets a second pricer, or None where it does not (one CPU, ranks, a small model)."""
    switch = os.environ.get(SWITCH_ENV)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if switch == "off" or nproc > 1 or cpus < 2 or (switch != "on" and parameters < FROM_PARAMETERS):
        return None
    return (f"{cpus} CPUs, and a model of {parameters / 1e9:.1f}B parameters is searched with dozens of traces "
            f"of a second or more" if switch != "on" else f"{cpus} CPUs, and {SWITCH_ENV}=on")


class Beside:
    """The tuner's end of the second pricer (module docstring)."""

    def __init__(self, recipe, device_kind: str, time_facts, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        recipe_path, self.log_path = directory / "beside-recipe.json", directory / "beside.log"
        write_atomic(recipe_path, recipe.model_dump_json(indent=1))
        argv = [str(recipe_path), "--parent", str(os.getpid()), "--device", device_kind]
        if time_facts is not None:
            write_atomic(directory / "beside-facts.json", time_facts.model_dump_json(indent=1))
            argv += ["--time-facts", str(directory / "beside-facts.json")]
        ours, theirs = socket.socketpair()
        with open(self.log_path, "a", encoding="utf-8") as log_file:  # -P: see runner/recipe/load.py
            self.process = subprocess.Popen([sys.executable, "-P", "-m", __name__, *argv], stdin=theirs.fileno(),
                                            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        note_launch(directory, "beside", None, self.process.pid)  # a test checks no child outlived the tuner
        self.connection = Connection(ours.detach())
        self.made: dict[tuple, object] = {}  # key -> a trace made there, not yet taken
        self.ahead: dict[tuple, object] = {}  # key -> a trace the tuner made ahead while it waited (`take`)
        self.queued: dict[tuple, tuple] = {}  # asked for, not yet started: key -> (plan, precision, ...), in order
        self.current: tuple | None = None  # being made now
        self.answer: dict | None = None  # the solver's
        self.broken: str | None = None  # why the tuner works alone now
        self.taken = 0  # traces the tuner took from here

    def ask(self, requests: list[tuple]) -> None:
        """Make these traces, in this order: (kind, key, plan, precision, what else it is given), as
        `Composer.traces_ahead` names them."""
        self._drain()
        for kind, key, plan, precision, *given in requests:
            if key in self.made or key in self.ahead or key in self.queued or key == self.current:
                continue
            if self._send((kind, key, plan.model_dump_json(), precision, *given)):
                self.queued[key] = (plan, precision, *given)

    def take(self, key: tuple, make: Callable[[MemoryPlan, str, frozenset[int]], object] | None):
        """A trace that serves `key` (`serves`), made there or by `make` (plan, precision, real blocks: the tuner's
        own tracing) ahead of time; where one is being made there, the tuner makes the nearest trace it asked
        for meanwhile (the next plan it prices, as the other process goes from the last), else waits. None:
        none made (those asked for that would serve and were not started are cancelled): the tuner makes it."""
        self._drain()
        while True:
            for store in (self.ahead, self.made):
                found = next((made for made in store if serves(made, key)), None)
                if found is not None:
                    self.taken += store is self.made
                    return store.pop(found)
            if self.current is None or not serves(self.current, key) or self.broken is not None:
                break
            nearest = next((k for k in reversed(self.queued) if k[0] == "step" and not serves(k, key)), None)
            if nearest is not None and make is not None:
                self._make_ahead(nearest, self._cancel(nearest), make)
            else:
                self._receive(WAIT_S, _named(key))
            self._drain()
        for queued in [k for k in self.queued if serves(k, key)]:
            self._cancel(queued)
        return None

    def _cancel(self, key: tuple) -> tuple | None:
        """Take a request back that was not started (what it asked for), or None."""
        request = self.queued.pop(key, None)
        if request is not None:
            self._send(("cancel", key))
        return request

    def _make_ahead(self, key: tuple, request: tuple, make) -> None:
        try:
            self.ahead[key] = make(*request)
        except Exception:  # noqa: BLE001 - made before its plan is priced: pricing it meets the failure where it belongs
            log.debug("pricing: a trace made ahead failed; its plan's pricing makes it again", exc_info=True)

    def solve(self, request: dict) -> bool:
        """Start the solver here (autotune/search/solver.py `frontier`); False where this process cannot."""
        self.answer = None
        return self._send(("frontier", request))

    def solved(self) -> dict | None:
        """The solver's answer, waited for; None where this process broke first (the tuner solves itself)."""
        while self.answer is None and self.broken is None:
            self._receive(WAIT_S, "the solver's per-block plans")
        return self.answer

    def close(self) -> None:
        if self.process.poll() is None:
            kill_group(self.process.pid)
        self.process.wait()
        self.connection.close()

    # --- the channel ---------------------------------------------------------------------------------

    def _send(self, message: tuple) -> bool:
        if self.broken is not None:
            return False
        try:
            self.connection.send(message)
            return True
        except OSError as err:
            self._break(f"it is gone ({err})")
            return False

    def _drain(self) -> None:
        while self.broken is None and self._receive(0.0, ""):
            pass

    def _receive(self, timeout: float, waiting_for: str) -> bool:
        """Handle one message within `timeout`; False where none came (past a wait: the process is given up)."""
        try:
            if not self.connection.poll(timeout):
                if timeout:
                    self._break(f"it sent nothing for {timeout:g} s while the tuner waited for {waiting_for}")
                return False
            message = self.connection.recv()
        except (EOFError, OSError) as err:
            self._break(f"it ended ({type(err).__name__}); see {self.log_path}")
            return False
        self._handle(message)
        return True

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "started":
            self.queued.pop(message[1], None)
            self.current = message[1]
        elif kind == "trace":
            self.made.setdefault(message[1], message[2])
        elif kind == "frontier":
            self.answer = message[1]
        elif kind == "broken":
            self._break(message[1])
        if kind in ("trace", "failed") and message[1] == self.current:
            self.current = None

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            log.warning("pricing: the second pricer stopped (%s): this process makes its traces from here on", why)
            self.current, self.queued = None, {}
            self.close()


def _named(key: tuple) -> str:
    """A trace's key in words, for the line that says what the tuner waited for."""
    return f"the trace of {key[2]} on blocks {list(key[3])}" if key[0] == "step" else "an update's trace"


def serves(made: tuple, wanted: tuple) -> bool:
    """Whether a trace made for key `made` serves one asked for as `wanted` (`compose.trace_key`): the same key,
    or a block trace of the same parts and per-block actions whose real blocks include the wanted ones. A
    representative's parts depend on the blocks of its window only, all real in both: so the tuner records what
    it asked for (the wanted blocks as representatives), whichever of the two traces it took."""
    if made == wanted:
        return True
    return made[0] == wanted[0] == "step" and made[1:3] == wanted[1:3] and set(made[3]) >= set(wanted[3])


# --- the process beside ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from .child import die_with_parent, recipe_from_json

    args = _parser().parse_args(argv)
    die_with_parent(args.parent)
    connection = Connection(os.dup(0))
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    recipe = recipe_from_json(Path(args.recipe).read_text(encoding="utf-8"))
    try:
        composer = _composer(recipe, args.device, args.time_facts, connection)
    except Exception as err:  # the tuner builds the same model: it says what is wrong, this only says it broke
        connection.send(("broken", f"the fake model could not be built here: {first_line(err)}"))
        return 1
    _serve(composer, connection)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}")
    parser.add_argument("recipe", help="the recipe as JSON")
    parser.add_argument("--parent", type=int, required=True, help="the tuner's pid; its death ends this process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device predicted for")
    parser.add_argument("--time-facts", metavar="FILE", help="a device's facts (JSON): step times on it")
    return parser


def _composer(recipe, device: str, facts_path: str | None, connection: Connection):
    from ckrun.runner.predict.compose import Composer
    from ckrun.runner.predict.hardware import load_facts
    from ckrun.runner.predict.parts import PartsEstimator

    facts = load_facts(Path(facts_path)) if facts_path else None
    return Composer(PartsEstimator(recipe, device, facts), tracer=Sending(connection))


def _serve(composer, connection: Connection) -> None:
    """Work through the tuner's requests in the order given, cancelled ones left out, until it hangs up."""
    queue: deque[tuple] = deque()
    while True:
        try:
            while not queue or connection.poll(0):
                _file(connection.recv(), queue)
        except EOFError:
            return
        request = queue.popleft()
        if request[0] == "frontier":
            connection.send(("frontier", _frontier(composer, request[1])))
        else:
            _made(composer, connection, *request)


def _file(message: tuple, queue: deque) -> None:
    if message[0] == "cancel":
        for request in [r for r in queue if r[0] != "frontier" and r[1] == message[1]]:
            queue.remove(request)
    else:
        queue.append(message)


def _made(composer, connection: Connection, kind: str, key: tuple, plan_json: str, precision: str, *given) -> None:
    """One trace asked for: a block trace (given its real blocks) or an update's (the parameters accumulated, the
    micro-batches), sent by the tracer as it is made."""
    connection.send(("started", key))
    plan = MemoryPlan.model_validate_json(plan_json)
    try:
        if kind == "step":
            composer.tracer.step(key, composer.estimator, plan, precision, frozenset(given[0]), composer.templates)
        else:
            composer.tracer.update(key, composer.estimator, plan, precision, set(given[0]), given[1])
    except Exception as err:  # the tuner makes this trace itself and meets the same failure where it belongs
        connection.send(("failed", key, first_line(err)))


def _frontier(composer, request: dict) -> dict:
    from ..search.solver import answer_request

    try:
        return answer_request(composer, request)
    except ValueError as err:
        return {"status": "unavailable", "reason": first_line(err)}


class Sending(Tracer):
    """Here: every trace made goes to the tuner as it is made (the heap frozen after each: the collector would
    walk the fake model and its traces, millions of objects, again and again)."""

    def __init__(self, connection: Connection):
        self.connection = connection

    def step(self, key, *args):
        return self._sent(key, super().step(key, *args))

    def update(self, key, *args):
        return self._sent(key, super().update(key, *args))

    def _sent(self, key: tuple, trace):
        self.connection.send(("trace", key, trace))
        gc.freeze()
        return trace


class Taking(Tracer):
    """The tuner's: a trace made there (or here, ahead, while it waited) is taken where one serves the key asked
    for (`Beside.take`); else this process makes it."""

    def __init__(self, beside: Beside):
        self.beside = beside

    def step(self, key, estimator, plan, precision, real, templates):
        def make(plan_ahead: MemoryPlan, precision_ahead: str, real_ahead: frozenset[int]):
            return super(Taking, self).step(None, estimator, plan_ahead, precision_ahead, real_ahead, templates)

        trace = self.beside.take(key, make)
        return trace if trace is not None else super().step(key, estimator, plan, precision, real, templates)

    def update(self, key, *args):
        trace = self.beside.take(key, None)
        return trace if trace is not None else super().update(key, *args)


if __name__ == "__main__":
    from .child import finish

    finish(main())
