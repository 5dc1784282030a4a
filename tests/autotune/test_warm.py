"""The warm server (autotune/probes/warm.py): a forked child is `python -m MODULE ARGS` as a fresh one would
be (its own session, its log, the request's environment, working directory and stdin, its exit
status), and a killed tuner takes the server and its children down."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from ckrun.autotune.probes.warm import WarmServer, start_child
from tune_helpers import HERE, survivors, wait_for


@pytest.fixture
def server(tmp_path):
    warm = WarmServer(tmp_path, ["json"])  # nothing heavy: the mechanics, not the imports, are under test
    warm.start()
    yield warm
    warm.stop()


def _env(**more):
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **more}


def _finish(child, timeout=60.0):
    wait_for(child.exited, timeout)
    return child.reap()


def test_a_forked_child_runs_the_module_as_main_with_the_requests_setting(server, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    out, log_path = tmp_path / "seen.json", tmp_path / "child.log"
    child = start_child("warm_target", [str(out), "--code", "7", "--read", "1"], log_path, _env(WARM_TEST="yes"),
                        server, requests=True)
    child.stdin.write("a request line\n")
    child.stdin.flush()
    assert _finish(child) == 7
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"][1:] == [str(out), "--code", "7", "--read", "1"]
    assert (seen["cwd"], seen["env"], seen["stdin"]) == (str(work), "yes", "a request line")
    assert seen["sid"] == seen["pid"] == child.pid  # the leader of a session of its own: a kill takes its group
    assert seen["ppid"] == server.process.pid
    assert "warm_target ran" in log_path.read_text()


@pytest.mark.parametrize("number", [signal.SIGKILL, signal.SIGSEGV])
def test_a_child_killed_by_a_signal_reports_it_as_popen_would(server, tmp_path, number):
    child = start_child("warm_target", [str(tmp_path / "seen.json"), "--signal", str(int(number))],
                        tmp_path / "child.log", _env(), server)
    assert _finish(child) == -number


def test_the_parent_watch_follows_the_server_and_a_killed_tuner_takes_every_child_down(tmp_path):
    """The tuner SIGKILLed: the server sees its socket close and leaves; the child's --parent watch
    (given the tuner's pid, replaced by the server's) then kills the child's group."""
    tuner = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from ckrun.autotune.probes.warm import WarmServer, start_child
        server = WarmServer(Path({str(tmp_path)!r}), ["json"])
        server.start()
        child = start_child("warm_target", [{str(tmp_path / 'seen.json')!r}, "--parent", str(os.getpid()),
                            "--sleep", "600"], Path({str(tmp_path / 'child.log')!r}), dict(os.environ), server)
        print(server.process.pid, child.pid, flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", tuner], stdout=subprocess.PIPE, text=True, env=_env())
    server_pid, child_pid = map(int, process.stdout.readline().split())
    wait_for(lambda: (tmp_path / "seen.json").exists())
    assert survivors([child_pid])  # alive while the tuner is
    process.kill()
    process.wait()
    wait_for(lambda: not survivors([child_pid, server_pid]), timeout=30)


def test_a_dead_server_means_cold_starts(server, tmp_path):
    os.kill(server.process.pid, signal.SIGKILL)
    wait_for(lambda: server.process.poll() is not None)
    out = tmp_path / "seen.json"
    child = start_child("warm_target", [str(out)], tmp_path / "child.log", _env(), server)
    assert _finish(child) == 0
    assert not server.alive and json.loads(out.read_text())["ppid"] == os.getpid()  # started as a fresh process


def test_the_children_of_a_stopped_server_are_reaped_and_none_is_left(server, tmp_path):
    children = [start_child("warm_target", [str(tmp_path / f"{n}.json"), "--sleep", "0.2"], tmp_path / "c.log",
                            _env(), server) for n in range(3)]
    assert [_finish(child) for child in children] == [0, 0, 0]
    pids = [server.process.pid, *(child.pid for child in children)]
    server.stop()
    time.sleep(0.1)
    assert not survivors(pids)


def test_a_server_that_dies_under_a_running_child_is_noticed(server, tmp_path):
    """The child's --parent watch takes it down with the server; the tuner sees it gone, not a timeout."""
    out = tmp_path / "seen.json"
    child = start_child("warm_target", [str(out), "--parent", "0", "--sleep", "600"], tmp_path / "child.log", _env(),
                        server)
    wait_for(out.exists)
    os.kill(server.process.pid, signal.SIGKILL)
    assert _finish(child, timeout=30) == -9  # no status from a dead server: counted as killed
    assert not survivors([child.pid])


def test_a_preload_that_fails_leaves_the_server_serving(tmp_path):
    """MODULE:NAME gets NAME too (transformers' modeling modules load on that); one that cannot be
    imported is the children's to report, in their own logs, not the server's end."""
    from ckrun.autotune.probes.warm import preload_for
    from ckrun.runner.recipe.recipe import ModelSpec

    assert preload_for(ModelSpec(source="transformers", name="BertForMaskedLM"))[0] == "transformers:BertForMaskedLM"
    warm = WarmServer(tmp_path, ["json:dumps", "no_such_module_anywhere", "json:no_such_name"])
    warm.start()
    try:
        child = start_child("warm_target", [str(tmp_path / "seen.json")], tmp_path / "c.log", _env(), warm)
        assert _finish(child) == 0 and warm.alive
        assert json.loads((tmp_path / "seen.json").read_text())["ppid"] == warm.process.pid
    finally:
        warm.stop()
