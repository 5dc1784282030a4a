"""The user's own code (`model.source: python`) may end ckrun's process in ways no `except` sees.

Each of these used to end ckrun silently, or never end it; each is now one line and a status:

- An import that hangs, calls `os._exit` or crashes the interpreter (a segfault in an extension)
  is first tried in a forked copy of this process, with a time limit (`CKRUN_IMPORT_TIMEOUT`,
  120 s) and a line after 10 s saying what ckrun waits for. Only an import that survives is
  repeated here. Forking costs milliseconds: torch is loaded before the fork when the module's
  own top level imports it, so its import (seconds) is not paid in the fork and again here.
- `os._exit` called from the main thread later (the factory, the forward) raises `UserExit`
  instead while a command runs (`exits_raised`), so the CLI can say where it was called.
- A factory or an evaluation metric that runs long gets the same waiting line, and one that never
  returns is stopped after `CKRUN_USER_CODE_TIMEOUT` (900 s) with a line naming it (`bounded`): a
  signal raises `Overdue` in the main thread, which ends a Python loop or a wait; native code that
  never returns to Python is ended at its next return.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import importlib
import importlib.util
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from ..environment import DURATIONS, IMPORT_TIMEOUT_ENV, USER_CODE_TIMEOUT_ENV, seconds

log = logging.getLogger(__name__)

NOTICE_AFTER_S = 10.0
_REAL_EXIT = os._exit
_VERDICTS: dict[str, str | None] = {}  # module -> why it cannot be imported here, or None
_LIBRARY_ROOTS = tuple(str(Path(p).resolve()) for p in {*sys.path[1:], os.path.dirname(os.__file__)}
                       if "site-packages" in p or "dist-packages" in p or p.startswith(sys.prefix))


class UserExit(BaseException):
    """`os._exit(code)` called by user code in ckrun's main thread (a BaseException: no `except
    Exception` in user code swallows it)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def import_limit_s() -> float:
    return max(0.1, seconds(IMPORT_TIMEOUT_ENV, DURATIONS[IMPORT_TIMEOUT_ENV]))


def check_import(module_name: str) -> str | None:
    """Why importing `module_name` would hang, exit or crash this process, or None (also when it merely
    raises: the real import reports that). Tried once per module, in a fork of this process."""
    if module_name in sys.modules or not sys.platform.startswith("linux"):
        return None  # elsewhere fork is missing (Windows) or unsafe once system frameworks are loaded (macOS)
    if module_name not in _VERDICTS:
        limit = import_limit_s()  # a bad CKRUN_IMPORT_TIMEOUT is one line before anything is forked
        _load_torch_first(module_name)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the copy: import, say "ok", leave without running this process's exit handlers
            _import_in_fork(module_name, read, write)
        os.close(write)
        try:
            _VERDICTS[module_name] = _verdict(module_name, pid, read, limit)
        finally:
            os.close(read)
    return _VERDICTS[module_name]


def _load_torch_first(module_name: str) -> None:
    """Import torch here, before the fork, when the module's own source imports it: the fork's import
    of torch (1.5 s) would otherwise be paid again by the real import after it (validate: 3.2 s, not 2)."""
    source = module_file(module_name)
    if "torch" not in sys.modules and source is not None and _imports_torch(source):
        import torch  # noqa: F401


def _imports_torch(source: Path) -> bool:
    """Whether the module's top level imports torch itself; what it imports in a function or under a
    condition may never be imported, and importing it here would import what the module does not."""
    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False  # the import in the fork reports what is wrong with the file
    names = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    names += [node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module]
    return any(name.split(".")[0] == "torch" for name in names)


def module_file(module: str) -> Path | None:
    """The file of `module`, found without importing it or its packages (their code may import torch,
    or hang: that is for the fork to find): on sys.path, else under where the finders put its
    top-level package. An editable install (`pip install -e .`) is found that way: setuptools' finder
    is on sys.meta_path, and the package's folder is on no sys.path entry."""
    parts = module.split(".")
    relative = Path(*parts)
    for root in sys.path:
        found = _file_in(Path(root or "."), relative)
        if found is not None:
            return found
    try:  # a top-level name: the finders locate it, nothing is imported
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if len(parts) == 1:
        return Path(spec.origin) if spec.origin and Path(spec.origin).is_file() else None
    for location in spec.submodule_search_locations or []:
        found = _file_in(Path(location), Path(*parts[1:]))
        if found is not None:
            return found
    return None


def _file_in(root: Path, relative: Path) -> Path | None:
    for candidate in (root / relative.with_suffix(".py"), root / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _import_in_fork(module_name: str, read: int, write: int) -> None:
    try:
        os.close(read)
        quiet = os.open(os.devnull, os.O_WRONLY)  # the real import prints what the module prints, once
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        faulthandler.disable()  # a crash here is the parent's to report, in one line (pytest's handler writes elsewhere)
        if "torch" in sys.modules:  # no OpenMP pool was forked: one thread keeps torch from waiting on it
            sys.modules["torch"].set_num_threads(1)
        with contextlib.suppress(BaseException):
            importlib.import_module(module_name)
        os.write(write, b"ok")
    finally:
        _REAL_EXIT(0)


def _verdict(module_name: str, pid: int, read: int, limit: float) -> str | None:
    started, said = time.monotonic(), False
    while True:
        waited = time.monotonic() - started
        if select.select([read], [], [], 0.2)[0] or waited >= limit:
            break
        if not said and waited >= NOTICE_AFTER_S:
            said = True
            log.warning("waiting for %s to import (%.0f s so far; ckrun gives up at %.0f s, CKRUN_IMPORT_TIMEOUT)",
                        module_name, waited, limit)
    answer = os.read(read, 2) if select.select([read], [], [], 0)[0] else b""
    if not answer and time.monotonic() - started >= limit:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return f"importing {module_name!r} did not finish in {limit:.0f} s (an endless loop or a wait at import?)"
    _, status = os.waitpid(pid, 0)
    if answer == b"ok":
        return None
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return f"importing {module_name!r} crashed the process ({name}: a fault in native code it runs or loads)"
    return f"importing {module_name!r} ended the process (exit status {os.WEXITSTATUS(status)}: os._exit at import?)"


@contextlib.contextmanager
def exits_raised():
    """While open, `os._exit` from this process's main thread raises UserExit; forked children and other
    threads keep the real one (a DataLoader worker ends itself with it)."""
    main_pid, main_thread = os.getpid(), threading.main_thread()

    def intercepted(code: int):
        if os.getpid() != main_pid or threading.current_thread() is not main_thread:
            _REAL_EXIT(code)
        raise UserExit(code)
    os._exit = intercepted
    try:
        yield
    finally:
        os._exit = _REAL_EXIT


def where(err: BaseException) -> str:
    """" at models.py:12": the deepest frame of the traceback outside the libraries and ckrun."""
    own = str(Path(__file__).resolve().parents[2])
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith((own, *_LIBRARY_ROOTS)) and not f.filename.startswith("<")]
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def describe_exit(err: BaseException) -> str:
    """One line for a SystemExit or UserExit that reached the CLI: user code ended the run."""
    call = f"os._exit({err.code})" if isinstance(err, UserExit) else f"sys.exit({err.code!r})"
    return f"ckrun: {call} was called{where(err)} while ckrun was running; it stopped there (nothing after that point ran)"


class Overdue(BaseException):
    """The user's code ran past CKRUN_USER_CODE_TIMEOUT (a BaseException: its own `except Exception`
    does not swallow it). `what` says what ckrun waited for."""

    def __init__(self, what: str, limit: float):
        super().__init__(f"{what} did not return in {limit:.0f} s (an endless loop or a wait?); fix it, or raise "
                         f"{USER_CODE_TIMEOUT_ENV} (now {limit:g} s) when it needs longer")
        self.what, self.limit = what, limit


@contextlib.contextmanager
def bounded(what: str):
    """Run the user's code in the block: a waiting line after NOTICE_AFTER_S, Overdue at the limit.
    The limit needs the main thread and POSIX timers; elsewhere only the line is said."""
    limit = max(0.1, seconds(USER_CODE_TIMEOUT_ENV, DURATIONS[USER_CODE_TIMEOUT_ENV]))
    with waiting_line(what, limit), _alarm(what, limit):
        yield


@contextlib.contextmanager
def _alarm(what: str, limit: float):
    """SIGALRM at `limit` raising Overdue; a timer already set (pytest-timeout's) is put back after, with
    the time it had left, and one due sooner than ours is left alone."""
    pending = signal.getitimer(signal.ITIMER_REAL)[0] if hasattr(signal, "getitimer") else 0.0
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer") or (
            0 < pending <= limit):
        yield
        return

    def overdue(signum, frame):
        raise Overdue(what, limit)
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, overdue)
    _, interval = signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - started), 0.001), interval)


@contextlib.contextmanager
def waiting_line(what: str, limit: float | None = None):
    """A line after NOTICE_AFTER_S saying what ckrun waits for (a factory that loops forever looked like a hang)."""
    done = threading.Event()
    ends = f"ckrun gives up at {limit:.0f} s, {USER_CODE_TIMEOUT_ENV}" if limit else "Ctrl-C stops it"

    def notice():
        if not done.wait(NOTICE_AFTER_S):
            log.warning("still waiting for %s (%.0f s so far; %s)", what, NOTICE_AFTER_S, ends)
    watcher = threading.Thread(target=notice, name="ckrun-waiting-line", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def stray_threads() -> list[str]:
    """Names of non-daemon threads still running besides the main thread: Python would wait for them at exit."""
    return [t.name for t in threading.enumerate()
            if t.is_alive() and not t.daemon and t is not threading.main_thread()]
