"""Screening in the model child, under generated fault schedules: whatever the user's code does in
which stage (hang, segfault, os._exit, raise), every prediction comes back in bounded time as a
peak or an unscreened plan with its reason, screening turns off after MAX_FAULTS, and no process
outlives the predictor. The child is tests/autotune/fake_model_child.py (same protocol, no torch)."""

import os
import time

from hypothesis import HealthCheck, given, settings, strategies as st

from autotune.screen import MAX_FAULTS, IsolatedPredictor, ModelChild
from autotune.space import Candidate
from autotune.study import Prediction
from conftest import BERT_TINY, TINY_BERT
from runner.load import load_recipe
from runner.plan import MemoryPlan
from tune_helpers import HERE, launches, survivors

RECIPE = load_recipe(BERT_TINY, TINY_BERT)
CANDIDATES = [Candidate(MemoryPlan(micro_batch=m), "fp32") for m in (1, 2, 4, 8)]
TIMEOUT_S = 2.0
KINDS = ("hang", "segfault", "exit", "raise")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=st.dictionaries(st.sampled_from(["facts", "ready", "0", "1", "2", "3"]), st.sampled_from(KINDS), max_size=3))
def test_any_fault_costs_a_plan_its_screening_never_the_tuner(tmp_path_factory, monkeypatch, faults):
    directory = tmp_path_factory.mktemp("screen")
    monkeypatch.setenv("CKRUN_MODEL_CHILD", "fake_model_child")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_MODEL_FAULTS", ",".join(f"{stage}:{kind}" for stage, kind in faults.items()))
    monkeypatch.setenv("FAKE_MODEL_COUNTER", str(directory / "counter"))
    (directory / "probes").mkdir()
    child = ModelChild(RECIPE, directory / "probes", "cpu", TIMEOUT_S, screen=True)
    predictor = IsolatedPredictor(child, context_bytes=5)
    started = time.monotonic()
    try:
        answers = [predictor(candidate) for candidate in CANDIDATES]
    finally:
        child.stop()
    # each candidate may wait for a fresh child's facts and warm-up and its own answer
    assert time.monotonic() - started < len(CANDIDATES) * 3 * (TIMEOUT_S + 5)
    for candidate, answer in zip(CANDIDATES, answers, strict=True):
        assert answer is None or isinstance(answer, Prediction)
        if answer is not None and answer.peak is not None:
            assert answer.peak == 1000 * candidate.plan.micro_batch + 5 and not answer.reason
        elif answer is not None:
            assert answer.reason.startswith("unscreened: ")
    summary = predictor.summary()
    assert len(summary["faults"]) <= MAX_FAULTS
    if "facts" in faults or "ready" in faults:  # the model never got as far as predicting
        assert summary["state"] == "off" and all(a is None for a in answers)
    if summary["state"] == "on":
        assert all(a is not None for a in answers)
    started_children = [launch["pid"] for launch in launches(directory)]
    assert started_children and not survivors(started_children)
