"""The suite's bound on child processes: a child that uses CPU is waited for however long it takes;
one that uses none for the stall time is a hang, killed, and the test fails saying so."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import children

BUSY = "import time\nend = time.monotonic() + 3\nwhile time.monotonic() < end: pass\nprint('done')"


def test_a_slow_child_that_works_is_waited_for_past_the_stall_time():
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    out, _ = children.wait(process, stall_s=1)
    assert out.strip() == "done" and time.monotonic() - started >= 3


def test_a_child_that_sleeps_past_the_stall_time_is_a_hang():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="used no CPU for 2 s: hung"):
        children.wait(process, stall_s=2)
    assert time.monotonic() - started < 30 and process.poll() is not None


def test_the_cpu_of_grandchildren_counts():
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY!r}])"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out, _ = children.wait(process, stall_s=1.5)
    assert out.strip() == "done"
