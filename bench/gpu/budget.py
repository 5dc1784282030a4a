"""A call's time budget, enforced inside the campaign's scripts (facts 4 min, plans 7, tune 8).

A lent GPU gives at most 10 minutes a command and 30 minutes of device time a session, machine
starts included: a script that overran its share would cost the next call its chance. So every
script takes `--budget-s`, starts a piece of work only when the time it usually takes is left,
gives each subprocess at most what is left, and, for work that runs in its own process and cannot
be interrupted (a compile, a step), arms a watchdog that writes what was measured and leaves at
the deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable


class Budget:
    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.started = time.monotonic()
        self.deadline = self.started + self.seconds

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def spent(self) -> float:
        return time.monotonic() - self.started

    def allows(self, seconds: float) -> bool:
        """Whether work expected to take `seconds` can start and end in time."""
        return self.left() >= seconds

    def limit(self, wanted: float, keep: float = 0.0) -> float:
        """A subprocess's time limit: `wanted`, or what is left after `keep` seconds for what follows."""
        return max(1.0, min(wanted, self.left() - keep))

    def arm(self, at_deadline: Callable[[], None], code: int = 124) -> threading.Thread:
        """At the deadline: call `at_deadline` (write what was measured), then leave with `code`
        (124, as `timeout` does), whatever the main thread is doing."""
        def watch() -> None:
            time.sleep(self.left())
            try:
                at_deadline()
            finally:
                os._exit(code)

        thread = threading.Thread(target=watch, name="budget-watchdog", daemon=True)
        thread.start()
        return thread

    def record(self) -> dict:
        return {"budget_s": self.seconds, "spent_s": round(self.spent(), 1)}
