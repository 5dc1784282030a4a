"""The campaign's time: the device-minutes a lent GPU comes with, how one call spends them, and the
budget every step keeps to by itself.

A lent GPU comes with 15 minutes of device time a session, everything counted: each machine start
(1-2 minutes), the transfers, the command, idle time while warm. The campaign is one call of at most
9 minutes with the machine's start included (issue 35), so that a second, shorter call still fits
if the first leaves time. The figures below are that accounting; `bench/gpu/campaign.py` splits the
command's share among its steps, and a test checks that the sum fits before any GPU is asked for.

Inside a step: `Budget` starts a piece of work only when the time it usually takes is left, gives
each subprocess at most what is left, and arms a watchdog that writes what was measured and leaves
at the deadline. `write_json` replaces a results file whole, so a call killed mid-write still brings
back the previous complete one.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

SESSION_S = 900  # device time a session's lent GPU comes with, all calls together (device README, 2026-11)
CALL_S = 540  # issue 35: the whole campaign in one call of at most 9 minutes, the machine's start included
MACHINE_START_S = 120  # a fresh machine: "1-2 minutes" (device README); the long end
TRANSFERS_S = 20  # the working tree with .whl (about 12 MiB) there, $OUT's files back
BACKSTOP_S = 10  # call.sh's `timeout` beyond the campaign's own deadline: only a hung campaign reaches it
COMMAND_S = CALL_S - MACHINE_START_S - TRANSFERS_S - BACKSTOP_S  # 390: what call.sh's campaign may spend
RUN_TIMEOUT_S = COMMAND_S + BACKSTOP_S  # the device tool's timeout_s for the call: 400
INSTALL_S = 15  # call.sh installing the carried wheels (measured there and taken off the campaign's budget)
IDLE_S = 30  # a machine stays warm this long after a call, on the session's time
REACTION_S = 60  # reading the first call's summary before asking for the second
SECOND_CALL_S = SESSION_S - CALL_S - IDLE_S - REACTION_S - TRANSFERS_S - BACKSTOP_S  # 240, on the warm machine
DRY_RUN_S = 1500  # the dry run's budget: toy steps on a busy 2-core CPU, no device time to account for
DEADLINE_EXIT = 3  # the campaign's exit status when its watchdog ended it at the deadline (`timeout`'s is 124)


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

    def arm(self, at_deadline: Callable[[], None], code: int = 124) -> threading.Event:
        """At the deadline: call `at_deadline` (write what was measured), then leave with `code`
        (124, as `timeout` does), whatever the main thread is doing; unless the work is done first:
        set the returned event (`disarm`), or the process that called on would be ended later."""
        done = threading.Event()

        def watch() -> None:
            if done.wait(self.left()):
                return
            try:
                at_deadline()
            finally:
                os._exit(code)

        threading.Thread(target=watch, name="budget-watchdog", daemon=True).start()
        return done

    def record(self) -> dict:
        return {"budget_s": self.seconds, "spent_s": round(self.spent(), 1)}


def write_json(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(temporary, path)  # a call killed mid-write still leaves the previous complete file
