"""Warm starts for the tuner's children on a CPU: one server process imports torch, transformers and
ckrun's trainer once, then forks each probe and the model child from that state. A probe of a small
model on a 2-core CPU spent 6-7 s of CPU (20 s of wall-clock on a busy machine) importing before its
first step, more than its steps took; a fork costs milliseconds.

A forked child is `python -m MODULE ARGS` (`runpy`, as `-m` runs it) in every way the tuner relies
on: it leads a session of its own (killing its group takes what it started), its output goes to its
log, its environment and working directory are the tuner's at the request, and a crash, an
out-of-memory or a hang costs it alone. Its `--parent` watch watches the server, which leaves as
soon as the tuner does (its end of the socket closes), so a killed tuner still takes its children down.

The server never runs a torch operation before it forks: no thread pool and no CUDA state cross the
fork. It serves CPU tunes of one process without torch.compile only (`warm_enough`): on CUDA the
allocator settings and the hidden GPUs must be in place when the child starts CUDA, a compiled
probe's caches are configured at import, and torchrun starts --nproc ranks itself. A server that
cannot start or dies is logged once and the children start cold, as before.

    python -m ckrun.autotune.probes.warm FD MODULE [MODULE ...]   # FD: its end of a SOCK_SEQPACKET pair; MODULEs preloaded
                                                     # (MODULE:NAME also gets NAME from it)

Messages are JSON, one per packet. Tuner -> server: {"module", "argv", "env", "cwd"} with the
child's log and (optionally) stdin as passed descriptors. Server -> tuner: {"started": PID} for each
request, {"exited": PID, "code": CODE} whenever a child ends (CODE as Popen.returncode: -SIGNAL if killed).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import selectors
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import ckrun
from ckrun.runner.environment import IMPORT_ROOTS_ENV

log = logging.getLogger(__name__)

PACKET = 1 << 20  # a request's environment and arguments fit in far less
START_TIMEOUT_S = 300.0  # the server's imports on a very busy machine; then children start cold
PRELOAD = ("torch", "ckrun.runner.train.measure.probe", "ckrun.runner.predict.estimate", "ckrun.autotune.probes.child", "ckrun.autotune.probes.model_child")
SOURCE_MODULES = {"torchvision": ("torchvision.models",)}


def warm_enough(device_kind: str, nproc: int, compile_: bool = False) -> bool:
    """Whether a child may be forked warm (see the module's docstring for why not otherwise)."""
    return device_kind == "cpu" and nproc == 1 and not compile_


class Cold:
    """A child started as a fresh interpreter (`subprocess.Popen`)."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.pid = process, process.pid
        self.stdin = process.stdin

    def exited(self) -> bool:
        """Ended, not yet reaped: its pid (and so its process group's id) is still its own."""
        return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def reap(self) -> int:
        return self.process.wait()


class Forked:
    """A child forked by the warm server; the server reaps it and reports its status."""

    def __init__(self, server: WarmServer, pid: int, stdin):
        self.server, self.pid, self.stdin = server, pid, stdin

    def exited(self) -> bool:
        """Ended (the server said so), or gone since the server died: its watch then killed it."""
        if self.server.code(self.pid) is not None:
            return True
        if self.server.alive:
            return False
        try:
            os.kill(self.pid, 0)  # reparented when the server died; whoever adopted it reaps it
        except ProcessLookupError:
            return True
        except PermissionError:  # the pid is someone else's now: ours is gone
            return True
        return False

    def reap(self) -> int:
        """Its status; call after killing its group. A server gone meanwhile cannot say: -9, as killed."""
        deadline = time.monotonic() + 30.0
        while (code := self.server.code(self.pid)) is None and self.server.alive and time.monotonic() < deadline:
            time.sleep(0.02)
        return -9 if code is None else code


class WarmServer:
    """The tuner's side: start the server, ask it for children, read their exit statuses."""

    def __init__(self, directory: Path, modules: list[str]):
        self.directory, self.modules = directory, modules
        self.socket: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self.codes: dict[int, int] = {}

    @property
    def alive(self) -> bool:
        return self.socket is not None

    def start(self) -> None:
        """Start the server; it imports in the background while the tuner goes on."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "warm.log", "a", encoding="utf-8") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-P", "-m", __spec__.name, str(theirs.fileno()), *self.modules], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.socket = ours
        note_launch(self.directory, "warm", None, self.process.pid)

    def launch(self, module: str, argv: list[str], log_path: Path, env: dict[str, str],
               stdin: int | None = None) -> int | None:
        """The pid of `python -m module argv` forked warm, or None when the server is gone (it is
        then stopped and the caller starts the child cold)."""
        if not self.alive:
            return None
        request = json.dumps({"module": module, "argv": argv, "env": env, "cwd": os.getcwd()}).encode()
        with open(log_path, "a", encoding="utf-8") as log_file:
            fds = [log_file.fileno(), *([stdin] if stdin is not None else [])]
            try:
                socket.send_fds(self.socket, [request], fds)
                return self._started()
            except OSError as err:
                self._gone(f"the request failed: {err}")
                return None

    def _started(self) -> int | None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.alive:
            message = self._receive(max(0.0, deadline - time.monotonic()))
            if message is None:
                self._gone(f"it did not answer within {START_TIMEOUT_S:g} s")
            elif "started" in message:
                return message["started"]
        return None

    def code(self, pid: int) -> int | None:
        while self.alive and pid not in self.codes and self._receive(0.0) is not None:
            pass
        return self.codes.get(pid)

    def _receive(self, timeout: float) -> dict | None:
        """The next message that is not an exit status (those are kept); None when none came in `timeout`."""
        self.socket.settimeout(timeout)
        try:
            data = self.socket.recv(PACKET)
        except (BlockingIOError, TimeoutError):
            return None
        except OSError as err:
            self._gone(f"its socket failed: {err}")
            return None
        if not data:
            self._gone(f"it ended; see {self.directory / 'warm.log'}")
            return None
        message = json.loads(data)
        if "exited" in message:
            self.codes[message["exited"]] = message["code"]
            return {}
        return message

    def _gone(self, why: str) -> None:
        log.warning("tune: the warm start server is gone (%s): children start as fresh processes", why)
        self.stop()

    def stop(self) -> None:
        """Close the socket (the server leaves on it) and reap the server."""
        if self.socket is not None:
            self.socket.close()
            self.socket = None
        if self.process is not None:
            try:
                self.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


def note_launch(directory: Path, what: str, trial: int | None, pid: int) -> None:
    """probes.log: one line per child started, so a resumed study shows what it did not re-run, and a
    test can check that no child of any kind outlived the tuner."""
    with open(directory / "probes.log", "a", encoding="utf-8") as launches:
        launches.write(json.dumps({"what": what, "trial": trial, "pid": pid, "time": time.time()}) + "\n")


def start_child(module: str, argv: list[str], log_path: Path, env: dict[str, str], server: WarmServer | None = None,
                requests: bool = False) -> Cold | Forked:
    """`python -m module argv` as the leader of a new session, its output (appended) in `log_path`:
    forked by `server` when one is given and alive, else a fresh interpreter. With `requests`, its
    stdin is a pipe the tuner writes (`.stdin`); else it reads nothing."""
    if server is not None and server.alive:
        read, write = os.pipe() if requests else (None, None)
        pid = server.launch(module, argv, log_path, env, read)
        if read is not None:
            os.close(read)
        if pid is not None:
            return Forked(server, pid, os.fdopen(write, "w", encoding="utf-8") if requests else None)
        if write is not None:
            os.close(write)
    with open(log_path, "a", encoding="utf-8") as log_file:  # -P: see runner/recipe/load.py's add_import_root
        process = subprocess.Popen([sys.executable, "-P", "-m", module, *argv], stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.PIPE if requests else subprocess.DEVNULL, start_new_session=True,
                                   env=env, text=requests or None)
    return Cold(process)


def preload_for(spec) -> list[str]:
    """What the recipe's model imports (`module` or `module:attribute`, whose getting imports more:
    transformers' top level is lazy, its modeling modules are where the seconds go), then the trainer."""
    model = [f"transformers:{spec.name}"] if spec.source == "transformers" else \
        list(SOURCE_MODULES.get(spec.source, ()))
    return [*model, *PRELOAD]


# --- the server -------------------------------------------------------------------------------------


def serve(fd: int, modules: list[str]) -> None:
    channel = socket.socket(fileno=fd)
    for name in modules:
        module, _, attribute = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if attribute:
                getattr(imported, attribute)
        except Exception:  # a child importing it again will say what is wrong, in its own log
            traceback.print_exc()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    children: set[int] = set()
    while True:
        ready = selector.select(timeout=0.05)
        _report_exits(channel, children)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(channel, PACKET, 2)
        except OSError:
            data, fds = b"", []
        if not data:
            os._exit(0)  # the tuner is gone or done: children watch this process and follow
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            _become(json.loads(data), fds)
        for descriptor in fds:
            os.close(descriptor)
        children.add(pid)
        channel.send(json.dumps({"started": pid}).encode())


def _report_exits(channel: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 255 << 8
        if done:
            children.discard(pid)
            channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: `python -m MODULE ARGV`, as the request says; never returns."""
    code = 1
    try:
        os.setsid()
        log_fd, *stdin = fds
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.dup2(stdin[0] if stdin else os.open(os.devnull, os.O_RDONLY), 0)
        for descriptor in fds:
            os.close(descriptor)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _search_python_path(request["env"].get("PYTHONPATH", ""))
        ckrun.append_import_roots(request["env"].get(IMPORT_ROOTS_ENV, ""))  # added since the server started
        argv = list(request["argv"])
        if "--parent" in argv:  # its parent is this server, which lives exactly as long as the tuner
            argv[argv.index("--parent") + 1] = str(os.getppid())
        sys.argv = [request["module"], *argv]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _search_python_path(value: str) -> None:
    """The request's PYTHONPATH on sys.path, where a fresh interpreter puts it (after the script's
    folder, before the standard library): the server read its own when it started, and the tuner
    may have added folders since (a recipe's folder for the user's code)."""
    missing = [entry for entry in value.split(os.pathsep)
               if entry and entry not in sys.path and os.path.abspath(entry) not in sys.path]
    if missing:
        sys.path[1:1] = missing
        importlib.invalidate_caches()


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
