"""The sinks a run's records go to: the registry matches the recipe's sink sections, `output.tensorboard:
true` is still TensorBoard, a missing package is one line at validate, and the policy when one
fails: metrics.jsonl's failure ends the run (status 5 through the CLI), an optional sink's is one
warning line and the run goes on without it."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import threading
import time
import typing
from types import SimpleNamespace

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.recipe.recipe import OutputSpec
from ckrun.runner.recipe.sinks import SECTIONS, SinkSection, TensorBoardSink
from ckrun.runner.train.output.directory import METRICS, MetricsLog, OutputError, RunInfo
from ckrun.runner.train.output.sinks import SINKS, InBackground, Sinks, chosen, make_sink, open_sinks
from ckrun.runner.train.output.trackers import TensorBoardLog

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def needs_packages(name: str, but: str = "") -> None:
    """Skip where the sink's packages (the test extra; CI has them) are not installed, `but` aside."""
    section = next(section for section in SECTIONS if typing.get_args(section.model_fields["name"].annotation) == (name,))
    for package in section.packages:
        if package != but and importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install -e '.[test]')")
RUN = [BERT_TINY, *TINY_BERT, "train.steps=4"]


def test_every_sink_section_has_a_sink_and_no_other():
    union = {typing.get_args(member.model_fields["name"].annotation)[0]
             for member in typing.get_args(typing.get_args(SinkSection)[0])}
    assert union == set(SINKS) == {typing.get_args(section.model_fields["name"].annotation)[0] for section in SECTIONS}
    for sink in SINKS.values():
        assert all(callable(getattr(sink, method, None)) for method in ("open", "write", "close")), sink


def test_tensorboard_true_is_the_tensorboard_sink_once():
    if not HAS_TENSORBOARD:
        pytest.skip("tensorboard is not installed")
    assert [s.name for s in chosen(OutputSpec(tensorboard=True))] == ["tensorboard"]
    assert [s.name for s in chosen(OutputSpec(tensorboard=True, sinks=["tensorboard"]))] == ["tensorboard"]
    assert chosen(OutputSpec()) == []


class Recorder:
    """A sink that keeps what it is given, and raises where it is told to."""

    def __init__(self, fail_open: bool = False, fail_write: int = 0, fail_close: bool = False):
        self.fail_open, self.fail_write, self.fail_close = fail_open, fail_write, fail_close
        self.records, self.ended = [], None

    def open(self, run: RunInfo) -> None:
        if self.fail_open:
            raise RuntimeError("the store is locked")

    def write(self, record: dict) -> None:
        if len(self.records) + 1 == self.fail_write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.records.append(record)

    def close(self, ended: str) -> None:
        self.ended = ended
        if self.fail_close:
            raise RuntimeError("database is locked")


def run_info(tmp_path, first_step: int = 0) -> RunInfo:
    return RunInfo(tmp_path, load_recipe(BERT_TINY), "<recipe>", first_step)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.startswith("ckrun")]


def test_an_optional_sink_that_fails_is_one_warning_and_the_others_go_on(tmp_path, caplog):
    bad, good = Recorder(fail_write=2), Recorder()
    sinks = Sinks([MetricsLog()], {"bad": bad, "good": good})
    sinks.open(run_info(tmp_path))
    for step in range(1, 5):
        sinks.write({"step": step, "loss": 1.0 / step})
    sinks.close("finished")
    assert warnings(caplog) == ["output.sinks: bad failed at step 2 (OSError: [Errno 28] No space left on device); it gets "
                                "no more records, training goes on (metrics.jsonl has every record)"]
    assert [r["step"] for r in bad.records] == [1] and bad.ended == "failed"  # closed, so it lets go of its files
    assert [r["step"] for r in good.records] == [1, 2, 3, 4] and good.ended == "finished"
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_sink_that_cannot_start_is_one_warning_and_gets_nothing(tmp_path, caplog):
    stuck = Recorder(fail_open=True)
    sinks = Sinks([MetricsLog()], {"mlflow": stuck})
    sinks.open(run_info(tmp_path))
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close("finished")
    assert warnings(caplog) == ["output.sinks: mlflow could not start (RuntimeError: the store is locked); it gets no "
                                "more records, training goes on (metrics.jsonl has every record)"]
    assert stuck.records == [] and stuck.ended == "failed"


def test_a_sink_that_cannot_close_is_one_warning_and_metrics_jsonl_is_still_closed(tmp_path, caplog):
    stuck = Recorder(fail_close=True)
    metrics = MetricsLog()
    sinks = Sinks([metrics], {"mlflow": stuck})
    sinks.open(run_info(tmp_path))
    sinks.write({"step": 1, "loss": 1.0})
    sinks.close("finished")
    assert warnings(caplog) == ["output.sinks: mlflow failed to close (RuntimeError: database is locked); "
                                "metrics.jsonl has every record"]
    assert [r["step"] for r in stuck.records] == [1] and stuck.ended == "finished"
    with pytest.raises(OSError):  # closed
        os.fstat(metrics.fd)


class Slow(Recorder):
    """A sink whose open waits until the test lets it go (MLflow creating its store, without a clock)."""

    opens_slowly = True

    def __init__(self, **fail):
        super().__init__(**fail)
        self.go, self.thread = threading.Event(), None

    def open(self, run: RunInfo) -> None:
        self.thread = threading.current_thread()
        assert self.go.wait(timeout=60), "the test never let the sink open"
        super().open(run)


def test_a_sink_that_opens_slowly_keeps_no_record_waiting_and_loses_none(tmp_path, caplog):
    slow = Slow()
    sinks = Sinks([MetricsLog()], {"slow": InBackground(slow, "slow")})
    sinks.open(run_info(tmp_path))  # returns while the sink is still opening
    for step in range(1, 4):
        sinks.write({"step": step, "loss": 1.0 / step})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3] and slow.records == []
    slow.go.set()
    sinks.close("finished")
    assert [r["step"] for r in slow.records] == [1, 2, 3] and slow.ended == "finished"
    assert slow.thread is not threading.current_thread() and not warnings(caplog)


@pytest.mark.parametrize("fail, said", [({"fail_open": True}, "could not start (RuntimeError: the store is locked)"),
                                        ({"fail_write": 2}, "failed at step 2 (OSError: [Errno 28] No space left")])
def test_a_sink_failing_in_the_background_is_the_same_one_warning(tmp_path, caplog, fail, said):
    slow = Slow(**fail)
    background = InBackground(slow, "slow")
    sinks = Sinks([MetricsLog()], {"slow": background})
    sinks.open(run_info(tmp_path))
    slow.go.set()
    sinks.write({"step": 1, "loss": 1.0})
    sinks.write({"step": 2, "loss": 0.5})
    background.thread.join(timeout=60) if fail.get("fail_open") else None
    if "fail_write" in fail:
        background.thread.join(timeout=60)  # it stops at the failing record
    sinks.write({"step": 3, "loss": 0.3})  # finds the failure
    sinks.close("finished")
    [line] = warnings(caplog)
    assert line.startswith(f"output.sinks: slow {said}") and "training goes on" in line, line
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert slow.ended == ("failed" if "fail_write" in fail else None)  # an opened sink lets go of what it holds


def test_mlflow_opens_in_the_background_and_the_others_do_not():
    from ckrun.runner.recipe.sinks import MlflowSink, WandbSink

    assert isinstance(make_sink(MlflowSink(name="mlflow")), InBackground)
    assert not isinstance(make_sink(TensorBoardSink(name="tensorboard")), InBackground)
    assert not isinstance(make_sink(WandbSink(name="wandb")), InBackground)


def test_metrics_jsonl_failing_ends_the_run_and_the_other_sinks_close_as_failed(tmp_path, monkeypatch):
    other = Recorder()
    trainer = SimpleNamespace(ranks=SimpleNamespace(is_main=True), recipe=load_recipe(BERT_TINY), source="<recipe>", step=0)
    monkeypatch.setitem(SINKS, "tensorboard", lambda section: other)
    trainer.recipe.output.sinks.append(TensorBoardSink(name="tensorboard"))
    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(METRICS):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with pytest.raises(OutputError, match="cannot write .*metrics.jsonl: No space left on device"):
        with open_sinks(trainer, tmp_path) as sinks:
            monkeypatch.setattr(os, "write", full)
            sinks.write({"step": 1, "loss": 1.0})
    assert other.records == [] and other.ended == "failed"  # metrics.jsonl is written first


def test_only_rank_0_writes(tmp_path):
    trainer = SimpleNamespace(ranks=SimpleNamespace(is_main=False), recipe=load_recipe(BERT_TINY), source="<recipe>", step=0)
    with open_sinks(trainer, tmp_path) as sinks:
        sinks.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / METRICS).exists()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'ckrun[tensorboard]')")
def test_tensorboard_that_cannot_start_leaves_the_run_going(tmp_path, ckrun, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the event folder goes")
    code, _, err = ckrun(*RUN, "output.sinks=[tensorboard]", f"output.dir={out}")
    assert code == 0, err
    [line] = warnings(caplog)
    assert line.startswith("output.sinks: tensorboard could not start (") and "training goes on" in line
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'ckrun[tensorboard]')")
def test_tensorboard_failing_mid_run_is_one_warning(tmp_path, ckrun, caplog, monkeypatch):
    real_write = TensorBoardLog.write

    def fills_the_disk(self, record):
        if record["step"] >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(self, record)

    monkeypatch.setattr(TensorBoardLog, "write", fills_the_disk)
    out = tmp_path / "run"
    code, _, err = ckrun(*RUN, "output.tensorboard=true", f"output.dir={out}")
    assert code == 0, err
    assert warnings(caplog) == ["output.sinks: tensorboard failed at step 3 (OSError: [Errno 28] No space left on "
                                "device); it gets no more records, training goes on (metrics.jsonl has every record)"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'ckrun[tensorboard]')")
def test_tensorboard_whose_writer_thread_fails_is_one_warning(tmp_path, ckrun, caplog, monkeypatch):
    # a read-only mount: the event writer's own thread raised, and Python printed its 42-line traceback
    from tensorboard.summary.writer.record_writer import RecordWriter

    real_write, calls = RecordWriter.write, []

    def read_only_after_the_first_events(self, data):
        calls.append(data)
        if len(calls) > 3:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        real_write(self, data)

    monkeypatch.setattr(RecordWriter, "write", read_only_after_the_first_events)
    out = tmp_path / "run"
    code, _, err = ckrun(*RUN, "output.tensorboard=true", f"output.dir={out}")
    assert code == 0 and "Traceback" not in err, err
    [line] = warnings(caplog)  # the thread's failure, or the main thread's next write finding it: said once
    assert line.startswith("output.sinks: tensorboard failed ") and "(OSError: [Errno 30] Read-only file system); it " \
        "gets no more records, training goes on (metrics.jsonl has every record)" in line, line
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


def test_an_mlflow_store_that_is_a_directory_is_one_warning_at_once(tmp_path, ckrun, caplog):
    # MLflow retried it for two minutes, 36 lines of warnings
    needs_packages("mlflow")
    out = tmp_path / "run"
    (out / "mlflow.db").mkdir(parents=True)
    started = time.monotonic()
    code, _, err = ckrun(*RUN, "output.sinks=[mlflow]", f"output.dir={out}")
    assert code == 0 and time.monotonic() - started < 60, err
    [line] = warnings(caplog)
    assert line.startswith("output.sinks: mlflow could not start (OSError: ") and "mlflow.db is a directory" in line


@pytest.mark.parametrize("sink, package", [("wandb", "wandb"), ("mlflow", "mlflow"),
                                           ("mlflow", "sqlalchemy")])  # mlflow-skinny alone has no SQLite store
def test_a_missing_package_is_one_line_at_its_entry(ckrun, monkeypatch, sink, package):
    needs_packages(sink, but=package)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real_find(name, *a))
    code, _, err = ckrun("validate", BERT_TINY, f"output.sinks=[{{name: {sink}}}]")
    assert code == 2
    assert err.splitlines() == [f"override 'output.sinks=[{{name: {sink}}}]': output.sinks.0: the {package} package "
                                f"is not installed; pip install 'ckrun[{sink}]', or remove {sink} from output.sinks"]


@pytest.mark.parametrize("sinks, said", [
    ("[wandbb]", "output.sinks.0: unknown name 'wandbb' (did you mean wandb?); choose one of tensorboard, wandb, mlflow"),
    ("[mlflow, mlflow]", "output.sinks: mlflow is listed twice; list each sink once"),
    ("[{name: wandb, projekt: x}]", "output.sinks.0.projekt: unknown key (did you mean project?)"),
])
def test_a_wrong_sink_is_one_located_line(ckrun, sinks, said):
    if "mlflow" in sinks:
        needs_packages("mlflow")
    code, _, err = ckrun("validate", BERT_TINY, f"output.sinks={sinks}")
    assert code == 2 and err.splitlines() == [f"override 'output.sinks={sinks}': {said}"], err


def test_the_schema_offers_a_sink_by_name_or_as_a_section():
    from ckrun.runner.recipe.recipe import Recipe

    schema = Recipe.model_json_schema()
    items = schema["$defs"]["OutputSpec"]["properties"]["sinks"]["items"]["anyOf"]
    assert {"enum": ["tensorboard", "wandb", "mlflow"], "type": "string"} in items
    assert any("$ref" in item or "oneOf" in item for item in items), json.dumps(items)
