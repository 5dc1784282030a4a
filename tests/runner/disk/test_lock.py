"""The lock a directory's owner holds (runner/disk/lock.py): a live holder is refused with its record and
nothing is written; a holder that has ended is reported, then taken over; another host's holder is
judged by its heartbeat, since its processes cannot be seen from here."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ckrun.runner.disk.lock as lock_module
from ckrun.runner.disk.lock import DirLock, LockHeld, LockRefused
from ckrun.runner.disk.lock_holder import Holder, boot_id, start_ticks
from ckrun.runner.problems import InputError

HOLD = """
import sys, time
from ckrun.runner.disk.lock import DirLock
lock = DirLock(sys.argv[1], "`ckrun` run", "is training into it")
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _lock(tmp_path) -> DirLock:
    return DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it")


def _record(tmp_path, **fields) -> None:
    holder = {"host": socket.gethostname(), "pid": 1, "started": time.time(), "what": "`ckrun` run", **fields}
    (tmp_path / "run.lock").write_text(json.dumps(holder) + "\n")


def _ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_live_holder_is_refused_with_its_pid_and_nothing_is_written(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run.lock")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (tmp_path / "run.lock").read_bytes(), (tmp_path / "run.lock").stat().st_mtime_ns
        with pytest.raises(LockHeld, match=rf"another `ckrun` run \(pid {holder.pid}\) is training into it since"):
            _lock(tmp_path).acquire()
        assert (tmp_path / "run.lock").read_bytes() == before[0]
    finally:
        holder.kill()
        holder.wait()
    with _lock(tmp_path) as lock:  # killed: the kernel dropped its flock, and its pid has ended
        assert lock.holder().pid == os.getpid()
    assert (tmp_path / "run.lock").read_text() == ""  # released cleanly: an empty record


def test_a_record_left_by_an_ended_or_reused_pid_is_reported_and_taken_over(tmp_path, caplog):
    left = [{"pid": _ended_pid()},  # the pid runs no more
            {"pid": os.getppid(), "ticks": -1},  # the pid runs another process now
            {"pid": os.getppid(), "boot": "another boot"}]  # the host rebooted since
    for fields in left:
        _record(tmp_path, **fields)
        with caplog.at_level(logging.WARNING, logger="ckrun.runner.disk.lock"), _lock(tmp_path):
            pass
        assert "which has ended (killed before it could let go); taking it over" in caplog.text
        caplog.clear()


def test_a_live_process_named_in_a_free_lock_is_not_taken_over(tmp_path):
    parent = os.getppid()
    _record(tmp_path, pid=parent, ticks=start_ticks(parent), boot=boot_id())
    with pytest.raises(LockHeld, match="it runs, though it no longer locks"):
        _lock(tmp_path).acquire()


def test_another_hosts_record_is_judged_by_its_heartbeat(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.3)
    _record(tmp_path, host="node7", pid=4242)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.1):
            os.utime(tmp_path / "run.lock")

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        with pytest.raises(LockHeld, match=r"\(pid 4242 on node7\).*cannot see node7's processes.*beats"):
            _lock(tmp_path).acquire()
    finally:
        stop.set()
    beating.join()  # its last touch done: a sleep instead let a late one land in the next window on a busy machine
    with caplog.at_level(logging.WARNING, logger="ckrun.runner.disk.lock"), _lock(tmp_path):
        pass
    assert "pid 4242 on node7" in caplog.text and "did not beat for 1 s" in caplog.text


def test_the_holder_beats_while_it_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.1)
    with _lock(tmp_path):
        first = (tmp_path / "run.lock").stat().st_mtime_ns
        # waited for, not timed: a busy machine may run the heartbeat's thread late, never not at all
        deadline = time.monotonic() + 30
        while (tmp_path / "run.lock").stat().st_mtime_ns == first and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "run.lock").stat().st_mtime_ns != first


def test_records_old_and_foreign():
    assert Holder.parse("") is None and Holder.parse("1234\n") is None  # the tune lock's old record: flock alone
    with pytest.raises(ValueError, match="not a record ckrun writes"):
        Holder.parse("not json")
    newer = {"host": "h", "pid": 7, "started": 1.0, "what": "w", "added_later": 1}
    assert Holder.parse(json.dumps(newer)) == Holder("h", 7, 1.0, "w")  # a newer ckrun's fields are ignored


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_is_killed(tmp_path):
    """A data-loader worker is forked: were the descriptor it copies still open, it would hold the
    flock after a kill -9 of the run until it noticed."""
    # the child says it runs (its fork hooks have run) before the holder is killed: not a race with its start
    forking = ('import os\nif os.fork() == 0:\n    os.write(1, b"child\\n")\n    time.sleep(600)\n'
               'os.write(1, b"held\\n")')  # one write each: the two processes share the pipe
    held = subprocess.Popen([sys.executable, "-c", HOLD.replace('print("held", flush=True)', forking),
                             str(tmp_path / "run.lock")], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, start_new_session=True)
    try:
        assert {held.stdout.readline().strip(), held.stdout.readline().strip()} == {"held", "child"}
        held.kill()  # the holder; its forked child sleeps on
        held.wait()
        with _lock(tmp_path):
            pass
    finally:
        os.killpg(held.pid, 9)


# --- what sits at the lock's path is ckrun's, or nothing is written (issue 32) ----------------------


def _refused(tmp_path, match: str) -> None:
    with pytest.raises(LockRefused, match=match):
        DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True).acquire()


def test_a_symbolic_link_is_never_followed(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data\n")
    (tmp_path / "run.lock").symlink_to(precious)
    _refused(tmp_path, r"run.lock is a symbolic link, not a lock file ckrun made; .* remove or rename it$")
    assert precious.read_text() == "the user's data\n"
    (tmp_path / "run.lock").unlink()
    (tmp_path / "run.lock").symlink_to(tmp_path / "nowhere")  # dangling: creating it would write outside
    _refused(tmp_path, "is a symbolic link")
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_directory_or_fifo_is_refused(tmp_path, kind):
    make = {"directory": os.mkdir, "FIFO": os.mkfifo}[kind]
    make(tmp_path / "run.lock")
    _refused(tmp_path, f"run.lock is a {kind}, not a lock file ckrun made")


def test_a_hard_link_or_a_file_of_the_users_is_never_emptied(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's data\n")
    os.link(precious, tmp_path / "run.lock")
    _refused(tmp_path, r"run.lock has 2 names \(a hard link\)")
    (tmp_path / "run.lock").unlink()
    (tmp_path / "run.lock").write_text("the user's notes\n")
    _refused(tmp_path, r"is not a lock ckrun wrote \(it holds \"the user's notes\", .*remove it if no ckrun")
    assert precious.read_text() == "the user's data\n"
    assert (tmp_path / "run.lock").read_text() == "the user's notes\n"


@given(pid=st.one_of(st.integers(), st.text(max_size=5), st.floats(), st.none(), st.booleans(), st.lists(st.integers())),
       host=st.one_of(st.text(max_size=8), st.integers(), st.none()))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_record_is_judged_or_refused_in_words(tmp_path, monkeypatch, pid, host):
    # pid -1 used to signal every process (alive: blocked forever), "abc" was an internal error
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.05)  # another host's record waits 3 heartbeats
    record = json.dumps({"host": host, "pid": pid, "started": time.time(), "what": "`ckrun` run"})
    (tmp_path / "run.lock").write_text(record)
    lock = DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True)
    try:
        lock.acquire()
    except LockRefused as err:
        assert "is not a lock ckrun wrote" in str(err) and (tmp_path / "run.lock").read_text() == record
    except LockHeld as err:
        assert "another `ckrun` run (pid" in str(err)
    else:
        lock.release()
        assert isinstance(pid, int) and pid > 0 and isinstance(host, str) and host


def test_a_bad_heartbeat_variable_is_one_line(tmp_path, monkeypatch):
    for value in ("abc", "nan", "-1", "0", "inf"):
        monkeypatch.setenv("CKRUN_LOCK_HEARTBEAT_S", value)
        with pytest.raises(InputError) as error:
            _lock(tmp_path).acquire()
        assert str(error.value) == (f"environment: CKRUN_LOCK_HEARTBEAT_S: must be a number of seconds above 0, not "
                                    f"{value!r}; set one, or unset it for the default 5")
        assert not (tmp_path / "run.lock").exists()


def test_deleting_the_lock_file_lets_no_second_holder_in(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.1)
    caplog.set_level(logging.WARNING, logger="ckrun.runner.disk.lock")
    with DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True):
        (tmp_path / "run.lock").unlink()
        with pytest.raises(LockHeld, match="^another process is training into it$"):
            DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True).acquire()
        assert not (tmp_path / "run.lock").exists()  # the refused one created nothing
        deadline = time.monotonic() + 60  # waited for, not timed: a busy machine runs the heartbeat late
        while "written again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "was deleted while this run held the directory; written again" in caplog.text
        with pytest.raises(LockHeld, match=rf"another `ckrun` run \(pid {os.getpid()}\) is training into it"):
            DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True).acquire()
    with DirLock(tmp_path / "run.lock", "`ckrun` run", "is training into it", whole_directory=True):
        pass  # released: free again
