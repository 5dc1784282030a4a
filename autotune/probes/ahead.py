"""Plans composed ahead in a forked copy of the tuner, on the core the second pricer leaves idle.

Past its last traces, a predicted search of a large model prices plan after plan whose parts are all traced
(autotune/search/tuner.py `_price_ready`: each a composition, a tenth of a second for an 8B), one after
another on one core, while the second pricer (beside.py) has nothing to trace. When the tuner knows which of
them it prices next, a fork of this process composes them from the last, while this one goes from the
first and takes each answer the copy has made (or is making: it waits for it).

A fork holds this process's traces as they are at that moment, and a plan ready then is composed from those
alone: a trace made later sets no part a composition of it reads (`Composer` keeps the first trace of each
block signature). So the copy answers what this process would have answered, to the byte; the search decides
as it would alone, sooner. The copy traces nothing (its tracer refuses: a plan that would need a trace is
answered here), logs nothing, touches no study and ends with `os._exit`; should it fail or go silent, this
process prices what is left itself.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe

from ckrun.runner.predict.compose import Tracer

log = logging.getLogger(__name__)

LEAST_PLANS = 4  # fewer plans than this are composed here: a fork and its copied pages cost about one plan
WAIT_S = 30.0  # the most this process waits for a plan the copy is composing before it composes it itself


def forks() -> bool:
    return hasattr(os, "fork") and hasattr(os, "waitpid")


class Ahead:
    """The tuner's end of one forked copy composing a list of plans (module docstring)."""

    def __init__(self, keys: list[str], price: Callable[[int], tuple]):
        """`keys`: the plans' keys in the order the tuner prices them; `price(i)` answers the i-th plan, in the
        copy (what it returns is sent back as it is)."""
        self.keys = keys
        self.answers: dict[str, tuple] = {}
        self.here: set[str] = set()  # the plans this process composed itself
        self.current: str | None = None  # being composed there now
        self.done = False
        reader, writer = Pipe(duplex=False)
        self.pid = os.fork()
        if self.pid == 0:  # the copy
            reader.close()
            _compose(writer, keys, price)
        writer.close()
        self.connection = reader

    def take(self, key: str) -> tuple | None:
        """The copy's answer for `key`, waited for where it is composing it now; None where this process composes
        it (the copy has not reached it). Once the copy reaches a plan composed here, the two have met: it is
        stopped."""
        self._drain(0.0)
        while key not in self.answers and key == self.current and not self.done:
            if not self._drain(WAIT_S):
                log.warning("pricing: a forked copy composing plans ahead sent nothing for %g s; this process "
                            "composes them itself", WAIT_S)
                self.stop()
        if key in self.answers:
            return self.answers.pop(key)
        self.here.add(key)
        return None

    def stop(self) -> None:
        if not self.done:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._end()

    def _drain(self, timeout: float) -> bool:
        """Read what the copy sent; False where nothing came within `timeout`."""
        got = False
        try:
            while not self.done and self.connection.poll(timeout if not got else 0.0):
                kind, key, *answer = self.connection.recv()
                got = True
                if kind == "started":
                    self.current = key
                    if key in self.here:
                        self.stop()
                else:
                    self.answers[key] = answer[0]
                    self.current = None
        except (EOFError, OSError):
            self._end()
            return True
        return got

    def _end(self) -> None:
        self.done, self.current = True, None
        self.connection.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _compose(connection: Connection, keys: list[str], price: Callable[[int], tuple]) -> None:
    """In the copy: answer the plans from the last, each announced before it is composed; never returns."""
    code = 0
    try:
        logging.disable(logging.CRITICAL)  # the tuner logs what it takes; a lock held at the fork is never taken
        for i in reversed(range(len(keys))):
            connection.send(("started", keys[i]))
            connection.send(("answer", keys[i], price(i)))
    except BaseException:  # noqa: BLE001 - whatever it was, the tuner composes what is left
        code = 1
    finally:
        os._exit(code)


class NoTracing(Tracer):
    """The copy's tracer: a plan that needs a trace is not ready, and is answered by the tuner."""

    def step(self, *args):
        raise RuntimeError("a forked copy composes ready plans only")

    def update(self, *args):
        raise RuntimeError("a forked copy composes ready plans only")
