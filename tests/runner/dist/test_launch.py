"""Which rank's ending `ckrun --nproc` reports: the cause, not the ranks the agent stopped because of it."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from runner.dist.launch import _first_failure_status

CAUSES = [2, 3, 4, 5, -signal.SIGKILL, -signal.SIGSEGV]  # a rank's own status, or a signal from outside
CONSEQUENCES = [1, -signal.SIGTERM]  # a peer vanished (gloo), or the agent stopping the survivors


@given(causes=st.lists(st.sampled_from(CAUSES), min_size=1, max_size=3),
       consequences=st.lists(st.sampled_from(CONSEQUENCES), max_size=3), second=st.integers(0, 2))
def test_the_status_is_a_cause_whenever_a_rank_had_one(causes, consequences, second):
    codes = [*consequences, *causes]  # consequences first in rank order, all in the same second
    failures = {rank: SimpleNamespace(exitcode=code, timestamp=second) for rank, code in enumerate(codes)}
    status = _first_failure_status(SimpleNamespace(failures=failures))
    assert status in {128 - c if c < 0 else c for c in causes}
