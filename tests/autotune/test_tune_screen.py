"""Screening in the model child, under generated fault schedules: whatever the user's code does in
which stage (hang, segfault, os._exit, raise), every prediction comes back in bounded time as a
peak or an unscreened plan with its reason, screening turns off after MAX_FAULTS, and no process
outlives the predictor. The child is tests/autotune/fake_model_child.py (same protocol, no torch)."""

import os
import time

from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.autotune.probes.screen import MAX_FAULTS, IsolatedPredictor, ModelChild
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.search.study import Prediction
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
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


# --- on CUDA the model child stays off the GPU --------------------------------------------------


def test_on_cuda_the_child_predicts_with_the_gpus_hidden_and_the_cards_capability(tmp_path, monkeypatch):
    from ckrun.runner.predict.cuda_extras import CAPABILITY_ENV, target_capability

    (tmp_path / "device.result.json").write_text('{"status": "ok", "capability": "8.0"}')
    child = ModelChild(RECIPE, tmp_path, "cuda", TIMEOUT_S, screen=True)
    hidden = child.environment(gpu=False)
    assert hidden["CUDA_VISIBLE_DEVICES"] == "" and hidden[CAPABILITY_ENV] == "8.0"
    assert child.environment(gpu=True).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert ModelChild(RECIPE, tmp_path, "cpu", TIMEOUT_S, screen=True).environment(gpu=False) == dict(os.environ)
    monkeypatch.setenv(CAPABILITY_ENV, "8.0")
    assert target_capability() == ((8, 0), True)  # an A100's 8 MiB cuBLAS workspace, not Hopper's 32


class _Child:
    """ModelChild's calls as IsolatedPredictor makes them, recorded; every answer ok."""

    def __init__(self, device_kind: str):
        self.device_kind, self.process, self.calls = device_kind, None, []

    running = property(lambda self: self.process is not None)

    def start(self, gpu: bool = False):
        self.process = "gpu" if gpu else "hidden"
        self.calls.append(f"start {self.process}")

    def stop(self):
        if self.process:
            self.calls.append(f"stop {self.process}")
        self.process = None

    def facts(self):
        return {"status": "ok"}

    def ready(self):
        return {"status": "ok"}

    def ask(self, candidate):
        self.calls.append(f"predict on {self.process}")
        return {"status": "ok", "peak_bytes": 1}

    def ask_frontier(self, frontier):
        self.calls.append(f"solve on {self.process}")
        return {"status": "ok", "proposals": [], "lines": []}


def test_on_cuda_the_solvers_timing_child_is_gone_before_any_probe():
    child = _Child("cuda")
    predictor = IsolatedPredictor(child)
    predictor(CANDIDATES[0])  # read_facts may have started one already: the solver must not use it
    predictor.frontier({"pairs": []})
    predictor(CANDIDATES[1])
    assert child.calls == ["start hidden", "predict on hidden", "stop hidden", "start gpu", "solve on gpu",
                           "stop gpu", "start hidden", "predict on hidden"]


def test_on_the_cpu_one_child_serves_the_solver_and_the_predictions():
    child = _Child("cpu")
    predictor = IsolatedPredictor(child)
    predictor.frontier({"pairs": []})
    predictor(CANDIDATES[0])
    assert child.calls == ["start hidden", "solve on hidden", "predict on hidden"]


def test_on_cuda_predicted_block_times_need_no_child_of_their_own():
    """tune --predict: the solver times nothing on the card, so the child that predicts (its model built
    once, minutes for an 8B model) answers the solver too."""
    child = _Child("cuda")
    predictor = IsolatedPredictor(child)
    predictor.frontier({"pairs": [], "timed_steps": 0})
    predictor(CANDIDATES[0])
    assert child.calls == ["start hidden", "solve on hidden", "predict on hidden"]
