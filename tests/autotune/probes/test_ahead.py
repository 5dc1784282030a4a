"""A forked copy composing plans ahead (autotune/probes/ahead.py): the tuner gets each plan's answer as it would
have made it, from the copy or made here, and no copy outlives its list."""

import os
import time

import pytest

from ckrun.autotune.probes.ahead import Ahead, forks

pytestmark = pytest.mark.skipif(not forks(), reason="a forked copy needs os.fork")

KEYS = [f"plan-{i}" for i in range(8)]


def _answer(i: int) -> tuple:
    return ("answer", KEYS[i], i * i)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_every_plan_gets_its_own_answer_from_the_copy_or_from_here():
    ahead = Ahead(KEYS, _answer)
    got, taken = [], 0
    for i, key in enumerate(KEYS):
        time.sleep(0.05)  # this process is slower than the copy: it takes the copy's answers from the far end
        answer = ahead.take(key)
        taken += answer is not None
        got.append(answer if answer is not None else _answer(i))
    assert got == [_answer(i) for i in range(len(KEYS))]
    assert taken >= len(KEYS) // 2  # the copy went from the last while this process went from the first
    assert ahead.done and _gone(ahead.pid)  # met, stopped and reaped


def test_the_copy_is_stopped_where_it_reaches_a_plan_composed_here():
    def slow(i: int) -> tuple:
        time.sleep(0.2)
        return _answer(i)

    ahead = Ahead(KEYS, slow)
    for key in KEYS[:6]:
        assert ahead.take(key) in (None, slow(KEYS.index(key)))
    deadline = time.monotonic() + 10
    while not ahead.done and time.monotonic() < deadline:
        ahead.take("a plan not in the list")
        time.sleep(0.05)
    assert ahead.done and _gone(ahead.pid)


def test_a_copy_that_fails_leaves_every_plan_to_this_process():
    def failing(i: int) -> tuple:
        raise RuntimeError("a forked copy composes ready plans only")

    ahead = Ahead(KEYS, failing)
    assert [ahead.take(key) for key in KEYS] == [None] * len(KEYS) or ahead.done
    deadline = time.monotonic() + 10
    while not ahead.done and time.monotonic() < deadline:
        ahead.take(KEYS[-1])
    assert ahead.done and _gone(ahead.pid)


def test_stop_kills_and_reaps_a_copy_mid_list():
    ahead = Ahead(KEYS, lambda i: time.sleep(30) or _answer(i))
    ahead.stop()
    assert ahead.done and _gone(ahead.pid)
