"""A run that cannot go on ends in one line and its own exit status: a non-finite loss (4), a
signal (130/143, after a whole step), memory the machine cannot give (3), a bug (1)."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.problems import EXIT_NON_FINITE
from ckrun.runner.train.run import guard
from ckrun.runner.train.trainer import Trainer
from ckrun.runner.train.output.directory import strict_record


def strict_metrics(out) -> list[dict]:
    def refuse(token):
        raise AssertionError(f"{token} is not JSON, yet it is in metrics.jsonl")

    return [json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_huge_learning_rate_stops_at_the_first_non_finite_loss(tmp_path, ckrun):
    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=8", "train.optimizer.lr=1e30", "train.grad_clip=null",
                         "output.checkpoint_every=1", f"output.dir={out}")
    assert code == EXIT_NON_FINITE and len(err.splitlines()) == 1, err
    records = strict_metrics(out)
    last = records[-1]
    assert last["loss"] is None and all(r["loss"] is not None for r in records[:-1])  # null, never NaN
    assert err.startswith(f"ckrun: step {last['step']}: the loss is ") and "train.optimizer.lr" in err
    assert last["step"] < 8


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


@given(st.dictionaries(st.text(min_size=1, max_size=8), st.one_of(finite, non_finite, st.integers(), st.none(),
                                                                   st.booleans())))
def test_every_record_is_written_as_strict_json(record):
    line = json.dumps(strict_record(record), allow_nan=False)
    back = json.loads(line, parse_constant=lambda token: pytest.fail(f"{token} written"))
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            assert back[key] is None
        else:
            assert back[key] == value


@given(st.lists(st.tuples(st.one_of(finite, non_finite), st.booleans()), max_size=60))
def test_the_run_stops_at_the_first_non_finite_loss_the_fp16_scaler_cannot_explain(steps):
    # the scaler skips a step whose gradients overflowed: a non-finite loss then is normal, but not forever
    watch, in_row, expected = guard.LossWatch(), 0, None
    for number, (loss, skipped) in enumerate(steps, 1):
        in_row = in_row + 1 if not math.isfinite(loss) and skipped else 0
        if not math.isfinite(loss) and (not skipped or in_row >= guard.FP16_NON_FINITE_LIMIT):
            expected = number
            break
    stopped = None
    for number, (loss, skipped) in enumerate(steps, 1):
        try:
            watch.check({"step": number, "loss": loss, **({"skipped": True} if skipped else {})})
        except guard.NonFiniteLoss as err:
            stopped = err.step
            assert f"step {number}: the loss is {loss}" in str(err)
            break
    assert stopped == expected


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(losses=st.lists(st.floats(min_value=-1e6, max_value=1e9, allow_nan=False), min_size=1, max_size=40),
       start=st.one_of(st.none(), st.floats(min_value=0.01, max_value=100)))
def test_divergence_is_said_once_where_the_loss_first_passes_five_times_the_first_steps(losses, start, caplog):
    """`start`: a resumed run's first step, read from its metrics; else the first loss it sees."""
    caplog.clear()
    watch = guard.LossWatch(start, lr=0.5)
    for number, loss in enumerate(losses, 1):
        watch.check({"step": number, "loss": loss})
    first = start if start is not None else losses[0]
    rest = losses if start is not None else losses[1:]
    offset = 1 if start is not None else 2
    over = next((n for n, loss in enumerate(rest, offset) if first > 0 and loss >= guard.DIVERGED * first), None)
    said = [r.getMessage() for r in caplog.records if "training diverges" in r.getMessage()]
    assert len(said) == (over is not None) and (watch.diverged is None) == (over is None)
    if over is not None:
        assert said[0].startswith(f"step {over}: the loss ") and "(train.optimizer.lr 0.5)" in said[0]


def test_a_learning_rate_far_too_high_that_stays_finite_is_said_in_one_line(tmp_path, ckrun, caplog):
    """Adam at lr 30 without clipping: a tiny BERT's loss goes 5.5, 11242, 36633, ... and the run exits 0; the
    line is said once, at the step, and the last line keeps it in view. The default rate says nothing."""
    caplog.set_level("INFO", logger="ckrun")
    diverging = ["train.steps=4", "train.scheduler={name: constant}", "train.grad_clip=null"]
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *diverging, "train.optimizer.lr=30", f"output.dir={tmp_path / 'a'}")
    said = [r.getMessage() for r in caplog.records if "training diverges" in r.getMessage()]
    assert code == 0 and len(said) == 1 and "times the first step's" in said[0], (err, said)
    assert any("(diverged: see the warning at its step)" in r.getMessage() for r in caplog.records)
    caplog.clear()
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *diverging, f"output.dir={tmp_path / 'b'}")
    assert code == 0 and not any("diverge" in r.getMessage() for r in caplog.records), err


def test_fp16_stops_after_a_run_of_skipped_non_finite_steps_and_saves_none_of_them(tmp_path, ckrun):
    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "precision=fp16", "train.steps=40", "train.optimizer.lr=1e30",
                         "train.grad_clip=null", "output.checkpoint_every=1", f"output.dir={out}")
    assert code == EXIT_NON_FINITE and len(err.splitlines()) == 1, err
    assert "th step in a row, each skipped by the fp16 loss scaler" in err
    records = strict_metrics(out)
    first_bad = next(r["step"] for r in records if r["loss"] is None)
    assert records[-1]["step"] == first_bad + guard.FP16_NON_FINITE_LIMIT - 1
    saved = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert saved and max(saved) < first_bad  # the last checkpoint is the last good one


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_run_after_the_current_step(tmp_path, ckrun, monkeypatch, signum):
    out, real_step = tmp_path / "run", Trainer.train_step
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a background job

    def signalled_during_step_3(trainer):
        if trainer.step == 2:
            os.kill(os.getpid(), signum)  # handled at once: the flag is set before step 3 runs
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", signalled_during_step_3)
    common = [BERT_TINY, *TINY_BERT, "train.steps=6", "output.checkpoint_every=1", f"output.dir={out}"]
    code, _, err = ckrun(*common)
    assert code == 128 + signum
    assert err.strip() == (f"ckrun: stopped by {signal.Signals(signum).name} after step 3 of 6; "
                           "`--resume` continues from step-00000003")
    assert [r["step"] for r in strict_metrics(out)] == [1, 2, 3]
    assert signal.getsignal(signal.SIGINT) is before  # the run's handlers are gone again
    monkeypatch.undo()
    code, _, err = ckrun(*common, "--resume")
    assert code == 0, err
    assert [r["step"] for r in strict_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_a_second_signal_abandons_the_step(tmp_path, ckrun, monkeypatch):
    out, real_step = tmp_path / "run", Trainer.train_step

    def signalled_twice_in_step_3(trainer):
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # raises here: step 3 never runs
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", signalled_twice_in_step_3)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=6", "output.checkpoint_every=1", f"output.dir={out}")
    assert code == 143 and err.strip() == "ckrun: interrupted"
    assert [r["step"] for r in strict_metrics(out)] == [1, 2]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_a_batch_far_too_large_for_memory_is_one_line(tmp_path, ckrun):
    # 2**42 samples of 32 tokens: the allocator refuses at once (more than any address space holds)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"train.batch_size={2**42}", f"output.dir={tmp_path / 'run'}")
    assert code == 3 and len(err.splitlines()) == 1, err
    assert err.startswith("ckrun: step 1 ran out of memory on cpu: the allocator could not get ")
    assert "lower train.batch_size or memory.micro_batch" in err


def test_running_out_of_memory_inside_a_step_is_one_line(tmp_path, ckrun, monkeypatch):
    from ckrun.runner.train import trainer

    def allocator_fails(*args, **kwargs):  # the exact error torch's CPU allocator raises
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(trainer, "run_step", allocator_fails)
    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=3", f"output.dir={out}")
    assert code == 3 and len(err.splitlines()) == 1, err
    assert "step 1 ran out of memory on cpu: the allocator could not get 68.7 GB" in err
    monkeypatch.undo()
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={out}")[0] == 0  # nothing to resume: re-usable


def test_an_internal_error_is_one_line_and_its_traceback_only_with_verbose(tmp_path, ckrun, monkeypatch):
    def broken(trainer):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(Trainer, "train_step", broken)
    common = [BERT_TINY, *TINY_BERT, f"output.dir={tmp_path / 'run'}"]
    code, _, err = ckrun(*common)
    assert (code, err) == (1, "ckrun: internal error: ZeroDivisionError: division by zero "
                              "(run with -v for the traceback)\n")
    code, _, err = ckrun("-v", *common, f"output.dir={tmp_path / 'again'}")
    assert code == 1 and err.endswith("\nckrun: internal error: ZeroDivisionError: division by zero\n")
    assert err.startswith("Traceback") and "in broken" in err
