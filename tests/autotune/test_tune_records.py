"""The tuner's records: a trial's record comes back from the study's journal as it was stored, a
probe's result file reads back as written, and a mistyped state or field is refused."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState
from pydantic import ValidationError

from ckrun.autotune.records import ProbeResult, ProbeStatus, RecordState, TrialRecord, read_record, store_record
from ckrun.autotune.search.study import open_study
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.strategies import strategy_from_label

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
FLOATS = st.floats(min_value=0, max_value=1e12, allow_nan=False)
BYTES = st.integers(min_value=0, max_value=2**50)
PLANS = st.sampled_from([MemoryPlan(), MemoryPlan(micro_batch=2, checkpointing={"policy": "full"})]).map(
    lambda plan: plan.model_dump(mode="json"))
DEVICES = st.fixed_dictionaries({"device": NAMES, "device_total_bytes": BYTES, "torch": NAMES,
                                 "cuda": st.none() | NAMES})


def _maybe(strategy):
    return st.none() | strategy


RECORDS = st.builds(
    TrialRecord, state=st.sampled_from(get_args(RecordState)), reason=st.text(max_size=40), label=NAMES,
    key=_maybe(NAMES), plan=_maybe(PLANS), precision=_maybe(st.sampled_from(["fp32", "bf16", "fp16"])),
    strategy=_maybe(st.sampled_from(["ddp", "fsdp", "hsdp:2", "tp:4"]).map(strategy_from_label)), predicted_peak=_maybe(BYTES), predicted_s=_maybe(FLOATS),
    unscreened=_maybe(NAMES), measured_peak=_maybe(BYTES), probe_s=_maybe(FLOATS), device=_maybe(DEVICES),
    samples_per_s=_maybe(FLOATS), step_s=_maybe(FLOATS), mfu=_maybe(FLOATS), hfu=_maybe(FLOATS),
    predicted=_maybe(st.booleans()), gradient_error=_maybe(FLOATS), runs=_maybe(st.integers(1, 9)),
    proposed_by=_maybe(st.just("solver")), repeat_of=_maybe(st.integers(0, 99)),
    duplicate_of=_maybe(st.integers(0, 99)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=RECORDS)
def test_a_record_comes_back_from_the_study_journal_unchanged(record):
    with tempfile.TemporaryDirectory() as directory:
        study, _ = open_study(Path(directory), {}, resume=False)
        trial = study.ask()
        store_record(trial, record)
        study.tell(trial, record.samples_per_s or 0.0)
        reopened, fresh = open_study(Path(directory), {}, resume=True)  # read back from the file, as --resume does
        assert not fresh
        assert read_record(reopened.trials[0]) == record.model_copy(update={"number": trial.number})


def test_a_trial_without_a_record_reads_as_running_or_interrupted(tmp_path):
    study, _ = open_study(tmp_path, {}, resume=False)
    study.ask()
    running = read_record(study.trials[0])
    assert (running.state, running.number, running.label) == ("running", 0, "{}")
    study.tell(0, state=TrialState.FAIL)
    assert read_record(study.trials[0]).state == "interrupted"


@given(status=st.sampled_from(get_args(ProbeStatus)), reason=st.text(max_size=40), peak=_maybe(BYTES),
       speed=_maybe(FLOATS), losses=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=4))
def test_a_probe_result_file_reads_back_as_written(status, reason, peak, speed, losses):
    result = ProbeResult(status=status, reason=reason, measured_peak_bytes=peak, samples_per_s=speed, losses=losses)
    assert ProbeResult.from_json(result.to_json()) == result


def test_a_mistyped_state_status_or_field_is_refused():
    with pytest.raises(ValidationError, match="state"):
        TrialRecord(state="feasable")
    with pytest.raises(ValidationError, match="samples_per_sec"):
        ProbeResult.from_json('{"status": "ok", "samples_per_sec": 1.0}')
    with pytest.raises(ValidationError, match="status"):
        ProbeResult.from_json('{"status": "OK"}')
