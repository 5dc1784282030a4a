"""The searches keep their word (issue 42.2, 42.3).

Measured: the starting points docs/tuning.md names (no plan, full checkpointing, every 2nd block) are
measured first, in that order, before the sampler proposes anything; a time budget that stops the search
before all are measured says which were not reached, by name, and records them as skipped (never as
tried). Predicted: a plan predicted to fit is never thrown away: out of time, the best predicted fit is the
answer, said as such. Counted, not timed: the probes' seconds are the fake clock's, the budget is measured
in them."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckrun.autotune.cap import Cap
from ckrun.autotune.records import ProbeResult, ranked_feasible
from ckrun.autotune.search import study as study_module, tuner as tuner_module
from ckrun.autotune.search.run import SearchSettings, search
from ckrun.autotune.search.study import Budget, Prediction, open_study
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.runner.recipe.load import load_recipe
from conftest import BERT_TINY, TINY_BERT

CPU = Device("cpu", "cpu", 24 * 10**9, ("fp32", "bf16"), "test")
FACTS = ModelFacts.from_json({"container_name": "encoder.layer", "blocks": [f"encoder.layer.{i}" for i in range(4)],
                              "containers": ["encoder.layer"] * 4})
RECIPE = load_recipe(BERT_TINY, [*TINY_BERT, "train.batch_size=16"])
NAMED = ["none", "full", "every:2"]  # docs/tuning.md: "no plan, full checkpointing and every 2nd block"


class Clock:
    """A monotonic clock that moves only when a probe runs (its seconds), for the budget's judgement."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Probes:
    """Each probe takes `seconds` on the clock; every plan fits and steps at a speed from its key."""

    def __init__(self, clock: Clock, seconds: float):
        self.clock, self.seconds, self.order = clock, seconds, []

    def __call__(self, candidate: Candidate, number: int) -> ProbeResult:
        self.clock.now += self.seconds
        self.order.append(candidate)
        speed = 10.0 + sum(map(ord, candidate.key)) % 7
        return ProbeResult(status="ok", measured_peak_bytes=10**6, probe_s=self.seconds, samples_per_s=speed,
                           device="cpu", device_total_bytes=CPU.total_bytes, torch=torch.__version__)


def measured(monkeypatch, probes: int, seconds: float, reached: float):
    """A measured search with a time budget of `reached` probes' worth: (probes' candidates, records, log)."""
    clock = Clock()
    for module in (study_module, tuner_module):
        monkeypatch.setattr(module.time, "monotonic", clock)
    space = build_space(RECIPE, FACTS, CPU)
    run = Probes(clock, seconds)
    with tempfile.TemporaryDirectory() as directory:
        study, fresh = open_study(Path(directory), {"cap": 10**8}, False)
        budget = Budget(trials=probes, time_s=reached * seconds, started=clock.now)
        records = search(study, fresh, RECIPE, space, Cap(10**8, 0.05), CPU, budget, run, None,
                         SearchSettings(0, 0, "off"))
    return space, run.order, records


def checkpointing(space, candidate: Candidate) -> str:
    return space.point_of(candidate)["checkpointing"]


@settings(max_examples=8, deadline=None)
@given(reached=st.integers(1, 6))
def test_the_named_starting_points_are_measured_first_and_the_unreached_said(reached):
    with pytest.MonkeyPatch.context() as monkeypatch, _logged() as lines:
        space, order, records = measured(monkeypatch, probes=20, seconds=5.0, reached=reached)
    starts = [checkpointing(space, c) for c in order[:len(NAMED)]]
    assert starts == NAMED[:len(starts)]  # in the named order, before anything the sampler proposes
    assert len(order) == max(1, min(reached, 20))  # the budget's probes, the first one always
    skipped = [r for r in records if r.state == "skipped"]
    unreached = NAMED[len(order):]
    assert [r.label.split(",")[0] for r in skipped][:len(unreached)] == [_words(space, n) for n in unreached]
    if skipped:
        line = next(line for line in lines if "not reached" in line)
        assert all(r.label in line for r in skipped)
    else:
        assert not [line for line in lines if "not reached" in line]


def test_out_of_time_a_predicted_search_answers_with_its_best_fit(monkeypatch):
    """--predict: a plan predicted to fit becomes a trial, whatever stops the search; the answer is the best
    predicted fit and the log says it is one (the issue's 8B lost a 75.6 GB plan under a 76 GB limit)."""
    clock = Clock()
    for module in (study_module, tuner_module):
        monkeypatch.setattr(module.time, "monotonic", clock)
    space = build_space(RECIPE, FACTS, CPU)

    def predict(candidate: Candidate) -> Prediction:
        clock.now += 3.0  # each prediction costs time: the budget runs out with starting points queued
        fits = checkpointing(space, candidate) == "full"
        seconds = 0.5 + (sum(map(ord, candidate.key)) % 5) / 10
        return Prediction(10**6 if fits else 10**9, time={"seconds": seconds, "samples_per_s": 16 / seconds,
                                                           "mfu": 0.3, "hfu": 0.3})

    with tempfile.TemporaryDirectory() as directory, _logged() as lines:
        study, fresh = open_study(Path(directory), {"cap": 10**8}, False)
        budget = Budget(trials=150, time_s=20.0, started=clock.now)
        records = search(study, fresh, RECIPE, space, Cap(10**8, 0.05), CPU, budget, _answered(predict), predict,
                         SearchSettings(0, 0, "off", timed_steps=0, predicted=True))
    ranked = ranked_feasible(records)
    assert ranked and checkpointing(space, Candidate(_plan(ranked[0]), ranked[0].precision)) == "full"
    assert any("the answer is the best plan predicted to fit" in line for line in lines)


def test_a_predicted_search_starts_no_prediction_its_time_budget_cannot_hold(monkeypatch):
    """--predict: a prediction is not started where the predictions so far say it would end past the budget
    (a probe's record of a prediction holds only its cached answer's time, near zero)."""
    clock = Clock()
    for module in (study_module, tuner_module):
        monkeypatch.setattr(module.time, "monotonic", clock)
    space = build_space(RECIPE, FACTS, CPU)
    ends = []

    def predict(candidate: Candidate) -> Prediction:
        clock.now += 3.5
        ends.append(clock.now)
        seconds = 0.5 + (sum(map(ord, candidate.key)) % 5) / 10
        return Prediction(10**6, time={"seconds": seconds, "samples_per_s": 16 / seconds, "mfu": 0.3, "hfu": 0.3})

    with tempfile.TemporaryDirectory() as directory, _logged() as lines:
        study, fresh = open_study(Path(directory), {"cap": 10**8}, False)
        started = clock.now
        search(study, fresh, RECIPE, space, Cap(10**8, 0.05), CPU, Budget(trials=150, time_s=100.0, started=started),
               _answered(predict), predict, SearchSettings(0, 0, "off", timed_steps=0, predicted=True))
    assert len(ends) > 5 and max(ends) - started <= 100.0
    assert any("less than a prediction takes" in line for line in lines)


def _answered(predict):
    """A predicted search's probe: the prediction's peak and throughput."""

    def evaluate(candidate: Candidate, number: int) -> ProbeResult:
        prediction = predict(candidate)
        return ProbeResult(status="ok", measured_peak_bytes=prediction.peak, predicted=True, probe_s=0.0,
                           samples_per_s=prediction.time["samples_per_s"], step_s=prediction.time["seconds"],
                           device="cpu", device_total_bytes=CPU.total_bytes, torch=torch.__version__)
    return evaluate


def _plan(record):
    from ckrun.runner.plan.memory_plan import MemoryPlan

    return MemoryPlan.model_validate(record.plan)


def _words(space, label: str) -> str:
    """How `describe` starts a plan of this checkpointing (its first words, before the first comma)."""
    from ckrun.autotune.space.knobs import describe

    point = {**space.starting_points(RECIPE, None)[0], "checkpointing": label}
    return describe(space.candidate(point)).split(",")[0]


class _logged:
    """The tuner's log lines while inside."""

    def __enter__(self) -> list[str]:
        self.lines: list[str] = []
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger = logging.getLogger("ckrun.autotune")
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
