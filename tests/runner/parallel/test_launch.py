"""Which rank's ending `ckrun --nproc` reports: the cause, not the ranks the agent stopped because of it."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from ckrun.runner.parallel.launch import _first_failure_status

CAUSES = [2, 3, 4, 5, -signal.SIGKILL, -signal.SIGSEGV]  # a rank's own status, or a signal from outside
CONSEQUENCES = [1, -signal.SIGTERM]  # a peer vanished (gloo), or the agent stopping the survivors


@given(causes=st.lists(st.sampled_from(CAUSES), min_size=1, max_size=3),
       consequences=st.lists(st.sampled_from(CONSEQUENCES), max_size=3), second=st.integers(0, 2))
def test_the_status_is_a_cause_whenever_a_rank_had_one(causes, consequences, second):
    codes = [*consequences, *causes]  # consequences first in rank order, all in the same second
    failures = {rank: SimpleNamespace(exitcode=code, timestamp=second) for rank, code in enumerate(codes)}
    status = _first_failure_status(SimpleNamespace(failures=failures))
    assert status in {128 - c if c < 0 else c for c in causes}



# SIGTERM to a launcher whose rank sleeps, the race widened: the agent's rendezvous keep-alive thread
# beats every second and spends 1.5 s in each beat, so the launcher lets go of the handler mid-beat
AFTER_SIGTERM = """
import os, signal, threading, time
from pathlib import Path
import ckrun.runner.parallel.launch as launch
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

beat = DynamicRendezvousHandler._keep_alive
DynamicRendezvousHandler._keep_alive = lambda self: (beat(self), time.sleep(1.5))
config = launch._config
launch._config = lambda nproc, step: (lambda c: (c.rdzv_configs.update(keep_alive_interval=1), c)[1])(config(nproc, step))

def term_once_a_rank_runs():
    me = str(os.getpid())
    while not any(stat.read_text().rsplit(")", 1)[1].split()[1] == me for stat in Path("/proc").glob("[0-9]*/stat")
                  if stat.exists()):
        time.sleep(0.1)
    time.sleep(2)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=term_once_a_rank_runs, daemon=True).start()
print(launch.group_status(["-c", "import time; time.sleep(600)"], 1), flush=True)
time.sleep(3)  # a beat or two: where the handler would have been freed
"""


def test_a_signal_to_the_launcher_ends_without_a_torch_traceback():
    """Issue 25, defect 6: after SIGTERM torch's agent leaves its rendezvous handler open, its
    keep-alive thread beating; freed in that thread, its finalizer joined the thread from itself and
    printed a 'cannot join current thread' traceback after ckrun's status line."""
    import os
    import sys

    import children
    from conftest import ROOT

    done = children.run([sys.executable, "-c", AFTER_SIGTERM], env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "143", done.stderr
    assert "Traceback" not in done.stderr and "cannot join" not in done.stderr, done.stderr
