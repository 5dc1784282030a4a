"""The sinks a run's records go to: metrics.jsonl always, then those the recipe chooses
(`output.sinks`, `output.tensorboard`), on rank 0 only (every rank's records are the same, reduced).

When one fails. metrics.jsonl is the run's record, so its failure ends the run as any write into
output.dir does (status 5, everything before it kept, --resume continues). An optional sink
(TensorBoard, W&B, MLflow) that raises, when it opens, writes or closes (its disk full, its store
locked, a bug in its package), is one warning line naming it and the error; it gets no more
records and training goes on, since metrics.jsonl still has every record. So is one whose own
background thread fails (TensorBoard's writer thread on a read-only mount printed a 42-line
traceback): the threads a sink starts are its own, and their failure is said the same way.

A sink whose opening is slow (MLflow: its import and its SQLite store, 5-20 s; `opens_slowly`) opens
in a thread of its own, so training does not wait for it: its records queue until it is open and
reach it in order, a failure there is the same one warning at the next record or at the end, and
the end waits for every queued record (saying so when it must wait).

Adding a sink: its section in runner/recipe/sinks.py (in the SinkSection union, naming the packages
it needs), its class (open, write, close: directory.py's `Sink`, `takes` naming its section) in
runner/train/output/trackers.py and in its TRACKERS, its packages as an extra in pyproject.toml;
tests/runner/train/output/test_sinks.py checks the registry is complete.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

from ...problems import one_line
from ...recipe.recipe import OutputSpec
from ...recipe.sinks import SinkSection, TensorBoardSink
from .directory import Ended, MetricsLog, RunInfo, Sink
from .numbers import plain_record
from .trackers import TRACKERS

log = logging.getLogger(__name__)

SINKS: dict[str, type] = {tracker.takes.sink_name(): tracker for tracker in TRACKERS}
CLOSE_WAIT_S = 300.0  # how long the end waits for a sink opening in the background to take its last records


def chosen(output: OutputSpec) -> list[SinkSection]:
    """The recipe's optional sinks: output.sinks, with TensorBoard first when output.tensorboard says so."""
    sections = list(output.sinks)
    if output.tensorboard and not any(section.name == "tensorboard" for section in sections):
        sections.insert(0, TensorBoardSink(name="tensorboard"))
    return sections


class Sinks:
    """Every record to every sink, metrics.jsonl first (so the line of a non-finite step is written
    before the run ends on it); an optional sink that fails is dropped with one warning line."""

    def __init__(self, required: list[Sink], optional: dict[str, Sink]):
        self.required, self.optional = required, optional
        self.ended: Ended = "finished"  # the loop says "stopped" when a signal ended it early
        self.threads: dict[threading.Thread, str] = {}  # a thread an optional sink started -> its name
        self.failed: set[str] = set()  # sinks whose own thread failed: said once, then left alone
        self.opening: tuple[str, set[threading.Thread]] | None = None  # the sink opening now, and the threads before

    def open(self, run: RunInfo) -> None:
        for sink in self.required:
            sink.open(run)
        for name in list(self.optional):
            self.opening = (name, set(threading.enumerate()))
            self._guarded(name, "could not start", lambda sink: sink.open(run))
            self.threads.update(dict.fromkeys(set(threading.enumerate()) - self.opening[1], name))
            self.opening = None

    def write(self, record: dict) -> dict:
        """Write `record` as plain numbers (numbers.py: a library's tensor learning rate becomes a float)
        and return it as written."""
        record = plain_record(record)
        for sink in self.required:
            sink.write(record)
        for name in list(self.optional):
            self._guarded(name, f"failed at step {record['step']}", lambda sink: sink.write(record))
        return record

    def close(self, ended: Ended) -> None:
        try:
            for name in list(self.optional):
                self._guarded(name, "failed to close", lambda sink: sink.close(ended), closing=True)
        finally:
            for sink in self.required:
                sink.close(ended)

    def thread_failed(self, args) -> bool:
        """threading.excepthook's call for a thread a sink started: one warning line; False for other threads."""
        name = self.threads.get(args.thread)
        if name is None and self.opening is not None and args.thread not in self.opening[1]:
            name = self.opening[0]  # started by the sink being opened, which may not have returned yet
        if name is None:
            return False
        if name not in self.failed and name in self.optional:  # else its failure was said already
            self.failed.add(name)
            log.warning("output.sinks: %s failed in its writer thread (%s: %s); it gets no more records, training "
                        "goes on (metrics.jsonl has every record)", name, args.exc_type.__name__,
                        one_line(str(args.exc_value))[:300] or "no message")
        return True

    def _guarded(self, name: str, what: str, use, closing: bool = False) -> None:
        sink = self.optional.get(name)
        if sink is None:
            return
        if name in self.failed:  # its own thread failed, and its hook said so
            if closing:
                with contextlib.suppress(Exception):  # let it release what it holds
                    use(sink)
            return
        try:
            use(sink)
        except Exception as err:  # noqa: BLE001 - an optional sink's failure is its own, never the run's
            if name in self.failed:  # its thread's failure, said by the hook meanwhile
                return
            self.failed.add(name)
            if isinstance(err, Deferred):  # it failed in the background: say when, and what
                what, err = err.what, err.error
            del self.optional[name]
            after = "metrics.jsonl has every record" if closing else \
                "it gets no more records, training goes on (metrics.jsonl has every record)"
            log.warning("output.sinks: %s %s (%s: %s); %s", name, what, type(err).__name__,
                        one_line(str(err))[:300] or "no message", after)
            if not closing:
                with contextlib.suppress(Exception):  # let it release what it holds; it said what went wrong
                    sink.close("failed")


class Deferred(Exception):
    """What a sink in the background failed at (`could not start`, `failed at step 7`), raised at the
    next call: the warning names that, not the later call that found it."""

    def __init__(self, what: str, error: Exception):
        super().__init__(what)
        self.what, self.error = what, error


class InBackground:
    """A sink (`opens_slowly`) that opens, writes and closes in a thread of its own: `open` returns at
    once, records queue in order, `close` waits for them; a failure in the thread is raised (Deferred)
    at the next call, and the sink is let go of what it holds."""

    def __init__(self, sink: Sink, name: str):
        self.sink, self.name = sink, name
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failure: Deferred | None = None
        self.thread: threading.Thread | None = None

    def open(self, run: RunInfo) -> None:
        self.thread = threading.Thread(target=self._work, args=(run,), name=f"ckrun-{self.name}", daemon=True)
        self.thread.start()

    def write(self, record: dict) -> None:
        self._raise()
        self.queue.put(("write", copy.deepcopy(record)))  # as it is now: the loop may reuse its dicts

    def close(self, ended: Ended) -> None:
        self.queue.put(("close", ended))
        self.thread.join(timeout=1.0)
        if self.thread.is_alive():
            log.info("output.sinks: waiting for %s to take the run's last records (it opens in the background, "
                     "at most %.0f s)", self.name, CLOSE_WAIT_S)
            self.thread.join(timeout=CLOSE_WAIT_S)
        if self.thread.is_alive():
            raise TimeoutError(f"still busy after {CLOSE_WAIT_S:.0f} s")
        self._raise()

    def _raise(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _work(self, run: RunInfo) -> None:
        what, opened = "could not start", False
        try:
            self.sink.open(run)
            opened = True
            while True:
                kind, item = self.queue.get()
                if kind == "close":
                    what = "failed to close"
                    self.sink.close(item)
                    return
                what = f"failed at step {item['step']}"
                self.sink.write(item)
        except Exception as err:  # noqa: BLE001 - raised at the next call, as the sink's own failure
            self.failure = Deferred(what, err)
            if opened and what != "failed to close":
                with contextlib.suppress(Exception):  # let it release what it holds; the warning says what went wrong
                    self.sink.close("failed")


def make_sink(section: SinkSection) -> Sink:
    """The sink of a recipe's section: in the background where its opening is slow."""
    sink = SINKS[section.name](section)
    return InBackground(sink, section.name) if getattr(sink, "opens_slowly", False) else sink


@contextlib.contextmanager
def open_sinks(trainer, out_dir: Path) -> Iterator[Sinks]:
    """The run's sinks, open for its records, closed with how the run ended ("failed" on an exception)."""
    if not trainer.ranks.is_main:
        yield Sinks([], {})
        return
    recipe = trainer.recipe
    sinks = Sinks([MetricsLog()], {section.name: make_sink(section) for section in chosen(recipe.output)})
    with _sink_threads_said(sinks):
        sinks.open(RunInfo(out_dir, recipe, trainer.source, trainer.step))
        try:
            yield sinks
        except BaseException:
            sinks.close("failed")
            raise
        sinks.close(sinks.ended)


@contextlib.contextmanager
def _sink_threads_said(sinks: Sinks):
    """While the sinks are open, a failure in a thread one of them started is its one warning line."""
    previous = threading.excepthook

    def hook(args) -> None:
        if not sinks.thread_failed(args):
            previous(args)
    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous
