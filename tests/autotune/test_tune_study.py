"""The search loop with a formula for a measurement, in this process: seeding, resume after an
interruption, repeated proposals, screening, and failures told as infeasible trials."""

import json

import pytest
from optuna.trial import TrialState

from ckrun.autotune.request import parse_duration
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import KNOBS, build_space, describe
from ckrun.autotune.cap import Cap
from ckrun.autotune.records import ProbeResult
from ckrun.autotune.search.study import Budget, Prediction, open_study, trial_records
from ckrun.autotune.search.tuner import Tuner
from ckrun.autotune.records import ranked_feasible
from conftest import BERT_TINY, TINY_BERT
from fake_child import measure
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.problems import InputError

CAP = Cap(2_500_000, 0.05)  # the formula puts no-plan at micro_batch 8 at 4.2 MB: most plans must shrink


@pytest.fixture(scope="module")
def setting():
    recipe = load_recipe(BERT_TINY, TINY_BERT + ["model.config.num_hidden_layers=4"])
    device = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")
    knobs = tuple(knob for knob in KNOBS if knob.name != "loss")  # the space small enough to exhaust below
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device, knobs=knobs)


class Counting:
    """The formula as a probe, remembering what it was asked; `stop_at` interrupts like a kill would."""

    def __init__(self, recipe, stop_at=None, status=None):
        self.recipe, self.stop_at, self.status, self.asked = recipe, stop_at, status or {}, []

    def __call__(self, candidate, number):
        if number == self.stop_at:
            raise KeyboardInterrupt  # the tuner dies mid-probe: the trial stays RUNNING in the journal
        self.asked.append(candidate.key)
        if number in self.status:
            return ProbeResult.failed(self.status[number], f"injected {self.status[number]}")
        return measure(json.loads(candidate.recipe(self.recipe, CAP.bytes).model_dump_json()), 1, 1)


def _tune(directory, setting, probe, trials=8, seed=0, resume=False, predict=None):
    recipe, space = setting
    study, fresh = open_study(directory, {"seed": seed}, resume)
    tuner = Tuner(study, space, CAP, probe, predict, seed)
    if fresh:
        tuner.start(recipe)
    tuner.run(Budget(trials))
    return trial_records(study)


def _sequence(records):
    """The plans in the order they were first evaluated."""
    return [r.key for r in records if r.state not in ("duplicate", "interrupted")]


def test_same_seed_same_proposals_and_a_feasible_winner(tmp_path, setting):
    first = _tune(tmp_path / "a", setting, Counting(setting[0]), seed=7)
    again = _tune(tmp_path / "b", setting, Counting(setting[0]), seed=7)
    other = _tune(tmp_path / "c", setting, Counting(setting[0]), seed=8)
    assert _sequence(first) == _sequence(again)
    assert _sequence(first) != _sequence(other)
    winner = ranked_feasible(first)[0]
    assert winner.measured_peak <= CAP.limit and winner.state == "feasible"
    assert [r.label for r in first[:2]] == ["micro_batch 8, checkpointing none, fp32",
                                               "micro_batch 8, checkpointing full, fp32"]


def test_interrupted_study_resumes_without_rerunning_and_ends_the_same(tmp_path, setting):
    whole = _tune(tmp_path / "whole", setting, Counting(setting[0]), seed=3)
    with pytest.raises(KeyboardInterrupt):
        _tune(tmp_path / "cut", setting, Counting(setting[0], stop_at=4), seed=3)
    with pytest.raises(InputError, match="already holds a study; pass --resume"):
        _tune(tmp_path / "cut", setting, Counting(setting[0]), seed=3)
    rest = Counting(setting[0])
    resumed = _tune(tmp_path / "cut", setting, rest, seed=3, resume=True)
    finished_before = {r.key for r in resumed if r.number < 4}
    assert not finished_before & set(rest.asked)  # finished trials were not measured again
    assert _sequence(resumed) == _sequence(whole)
    assert ranked_feasible(resumed)[0].key == ranked_feasible(whole)[0].key
    assert [r.state for r in resumed].count("interrupted") == 1


def test_the_journal_is_written_without_fsync_and_read_back_whole(tmp_path, setting, monkeypatch):
    """A kill loses nothing written (the kernel holds it): the journal's writes skip optuna's fsync per write
    (6 ms each on a busy disk, about 11 a plan), and a resumed study reads every trial back."""
    import os

    def refused(_):
        raise AssertionError("the study's journal called fsync")

    monkeypatch.setattr(os, "fsync", refused)
    written = _tune(tmp_path, setting, Counting(setting[0]), trials=3, seed=1)
    study, fresh = open_study(tmp_path, {"seed": 1}, resume=True)
    assert not fresh and [r.key for r in trial_records(study)] == [r.key for r in written]


def test_resume_with_other_options_is_refused(tmp_path, setting):
    _tune(tmp_path, setting, Counting(setting[0]), trials=1, seed=1)
    with pytest.raises(InputError, match="started with other seed"):
        _tune(tmp_path, setting, Counting(setting[0]), trials=2, seed=2, resume=True)


def test_repeated_proposals_reuse_the_measurement(tmp_path, setting):
    probe = Counting(setting[0])
    records = _tune(tmp_path, setting, probe, trials=30)  # more than the 15 plans: proposals must repeat
    assert len(probe.asked) == len(set(probe.asked)) == setting[1].size
    for duplicate in (r for r in records if r.state == "duplicate"):
        first = next(r for r in records if r.number == duplicate.duplicate_of)
        assert (duplicate.key, duplicate.measured_peak) == (first.key, first.measured_peak)


def test_screening_skips_plans_predicted_over_the_cap(tmp_path, setting):
    probe = Counting(setting[0])
    predict = lambda candidate: 10 * CAP.bytes if candidate.plan.checkpointing.policy == "none" else None  # noqa: E731
    records = _tune(tmp_path, setting, probe, trials=15, predict=predict)  # the whole space
    assert records[0].label == "micro_batch 8, checkpointing full, fp32"  # no-plan start: none predicted to fit
    screened = [r for r in records if r.state == "screened"]
    assert screened and all(r.reason.startswith("predicted 25.0 MB > cap 2.5 MB") for r in screened)
    assert not {r.key for r in screened} & set(probe.asked)


def test_failed_probes_are_infeasible_trials_and_the_search_goes_on(tmp_path, setting):
    probe = Counting(setting[0], status={0: "oom", 1: "timeout", 2: "died"})
    records = _tune(tmp_path, setting, probe, trials=5)
    assert [r.state for r in records[:3]] == ["oom", "timeout", "died"]
    assert ranked_feasible(records)  # later trials still found a plan


def test_a_spent_time_budget_stops_after_the_one_probe_a_choice_needs(tmp_path, setting):
    recipe, space = setting
    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, Counting(recipe))
    tuner.start(recipe)
    assert tuner.run(Budget(trials=20, time_s=1e-9)) == "the time budget of 1e-09 s is spent"
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 1


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("10m", 600), ("1.5h", 5400), ("45", 45)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


class Lucky(Counting):
    """The formula, except that the first run of one plan comes out 30% faster, as a quiet moment would."""

    def __init__(self, recipe, lucky_label):
        super().__init__(recipe)
        self.lucky_label, self.runs = lucky_label, {}

    def __call__(self, candidate, number):
        result = super().__call__(candidate, number)
        self.runs[candidate.key] = self.runs.get(candidate.key, 0) + 1
        if describe(candidate) == self.lucky_label and self.runs[candidate.key] == 1:
            result = result.model_copy(update={"samples_per_s": result.samples_per_s * 1.3})
        return result


def test_finalists_are_measured_three_times_and_one_lucky_run_does_not_win(tmp_path, setting):
    honest = _tune(tmp_path / "honest", setting, Counting(setting[0]), trials=15)  # the whole space
    best, second = ranked_feasible(honest)[:2]
    recipe, space = setting
    study, _ = open_study(tmp_path / "lucky", {}, False)
    tuner = Tuner(study, space, CAP, Lucky(recipe, second.label))
    tuner.start(recipe)
    tuner.run(Budget(15))
    assert ranked_feasible(trial_records(study))[0].key == second.key  # one probe each: the lucky run wins
    tuner.confirm(2)
    ranked = ranked_feasible(trial_records(study))
    assert ranked[0].key == best.key and [p.runs for p in ranked[:2]] == [3, 3]
    assert ranked[1].samples_per_s == pytest.approx(second.samples_per_s)  # the median drops the lucky run


def test_a_re_measurement_measures_the_plan_it_names_though_queued_plans_were_left(tmp_path, setting):
    """The search ends (--trials 2) with starting points still queued; each finalist's re-run must
    probe the finalist's plan, not a leftover queued one (optuna's ask() pops the oldest queued trial)."""
    recipe, space = setting
    study, _ = open_study(tmp_path, {}, False)
    probe = Counting(recipe)
    tuner = Tuner(study, space, CAP, probe)
    tuner.start(recipe)
    assert study.get_trials(states=(TrialState.WAITING,)), "the test needs plans left queued by the search"
    tuner.run(Budget(trials=2))
    searched = list(probe.asked)
    tuner.confirm(2)
    records = {r.number: r for r in trial_records(study)}
    repeats = [r for r in records.values() if r.repeat_of is not None]
    assert repeats, "confirm() measured no finalist again"
    for repeat in repeats:
        assert repeat.key == records[repeat.repeat_of].key
    assert set(probe.asked[len(searched):]) <= set(searched)  # only plans measured before were probed again
    assert all(p.runs == 3 for p in ranked_feasible(trial_records(study))[:2])
    assert not study.get_trials(states=(TrialState.WAITING,))  # the unreached plans are closed, and say why
    assert {r.state for r in records.values() if r.number not in {x.number for x in repeats}} >= {"skipped"}


class Slow(Counting):
    """The formula, each probe taking `seconds` of a fake clock."""

    def __init__(self, recipe, clock, seconds):
        super().__init__(recipe)
        self.clock, self.seconds = clock, seconds

    def __call__(self, candidate, number):
        self.clock.now += self.seconds
        return super().__call__(candidate, number).model_copy(update={"probe_s": self.seconds})


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("budget_s, probe_s", [(40, 15), (100, 15), (40, 30), (1, 15), (61, 10)])
def test_the_time_budget_bounds_search_and_re_runs(tmp_path, setting, monkeypatch, budget_s, probe_s):
    """No probe starts that would end past the budget (its expected length is the median of the probes
    so far), re-runs included; only the first probe may overrun, since a plan must be measured."""
    recipe, space = setting
    clock = Clock()
    monkeypatch.setattr("ckrun.autotune.search.study.time.monotonic", clock)
    budget = Budget(trials=20, time_s=budget_s)
    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, Slow(recipe, clock, probe_s))
    tuner.start(recipe)
    tuner.run(budget)
    tuner.confirm(2, budget)
    spent = clock.now - budget.started
    assert spent <= max(budget_s, probe_s)
    probes = len([r for r in trial_records(study) if r.probe_s and r.state != "duplicate"])
    assert probes == max(1, budget_s // probe_s)


def test_predicted_times_order_the_starting_points_after_the_recipes_own_plan(tmp_path, setting):
    """With step times in the predictions (a GPU whose facts are known), the known rules are tried
    fastest first; the recipe's own plan (a hand-written or predicted tuned.yaml) comes before them."""
    recipe, space = setting
    own = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"micro_batch": 4})})
    slowest_first = {"none": 3.0, "full": 1.0, "every:2": 2.0}

    def predict(candidate):
        label = candidate.plan.checkpointing.label()
        return Prediction(1000, time={"seconds": slowest_first.get(label, 9.0) + candidate.plan.micro_batch / 100})

    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, Counting(recipe), predict)
    tuner.start(own)
    queued = [space.candidate(t.system_attrs["fixed_params"]) for t in study.get_trials(states=(TrialState.WAITING,))]
    assert [(c.plan.micro_batch, c.plan.checkpointing.label()) for c in queued[:4]] == [
        (4, "none"), (8, "full"), (8, "every:2"), (8, "none")]


def test_the_budget_counts_from_the_process_start_so_imports_count_too():
    """`ckrun tune`'s own imports (seconds on a busy machine) are part of --time-budget."""
    import subprocess
    import sys

    code = "import time; time.sleep(1.5); from ckrun.autotune.search.study import process_started; " \
           "print(time.monotonic() - process_started())"
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1.5 <= age < 60


class Timed:
    """A predictor that takes `seconds` of the (fake) clock per prediction."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.asked = clock, seconds, 0

    def __call__(self, candidate):
        self.clock.now += self.seconds
        self.asked += 1
        return None

    def frontier(self, request):
        raise AssertionError("the solver must not be asked once its share of the budget is spent")


@pytest.mark.parametrize("budget_s, spent_s", [(40, 11), (40, 2), (None, 50)])
def test_the_work_before_the_first_probe_keeps_to_its_share_of_the_budget(tmp_path, setting, monkeypatch, caplog,
                                                                          budget_s, spent_s):
    """Under --time-budget, the solver and the whole-space predictions run only within PRE_PROBE_SHARE of
    it (the model's facts already took `spent_s`); the starting points are predicted regardless."""
    from ckrun.autotune.search.frontier import solver_points
    from ckrun.autotune.search.study import PRE_PROBE_SHARE

    recipe, space = setting
    clock = Clock()
    monkeypatch.setattr("ckrun.autotune.search.study.time.monotonic", clock)
    budget = Budget(trials=20, time_s=budget_s, started=clock.now - spent_s)
    study, fresh = open_study(tmp_path, {}, False)
    predictor = Timed(clock, 0.5)
    caplog.set_level("INFO")
    with monkeypatch.context() as patch:
        patch.setattr(Timed, "frontier", lambda self, request: {"status": "ok", "proposals": [], "lines": ["asked"]})
        share_left = budget_s is None or spent_s < PRE_PROBE_SHARE * budget_s
        first = solver_points(study, fresh, space, CAP, Device("cpu", "cpu", 0, ("fp32",), "2.x"), predictor,
                              budget=budget if budget_s else None)()  # the solver started, then its plans
    assert first == []
    solver = [r.getMessage() for r in caplog.records if r.getMessage().startswith("solver:")]
    assert ("solver: asked" in solver) == share_left, solver
    tuner = Tuner(study, space, CAP, Counting(recipe), predictor)
    tuner.start(recipe, first, 20, budget if budget_s else None)
    if budget_s is not None:  # the starting points' few predictions, then the whole space only within the share
        assert clock.now - budget.started <= max(spent_s, PRE_PROBE_SHARE * budget_s) + 8 * predictor.seconds
    else:
        assert predictor.asked > 20  # no budget: the space is predicted until more than --trials plans fit


class Growing:
    """A predictor whose peak grows with the micro-batch (3 MB a sample without checkpointing, less with),
    each prediction taking `seconds` of the (fake) clock; it remembers when it was asked."""

    PER_SAMPLE = {"none": 3_000_000, "every:2": 1_000_000, "full": 500_000}

    def __init__(self, clock, seconds):
        self.clock, self.seconds, self.asked_at = clock, seconds, []

    def peak(self, candidate) -> int:
        return self.PER_SAMPLE.get(candidate.plan.checkpointing.label(), 400_000) * candidate.plan.micro_batch

    def __call__(self, candidate):
        self.asked_at.append(self.clock.now)
        self.clock.now += self.seconds
        return Prediction(self.peak(candidate))


def test_past_the_starting_points_share_of_the_budget_no_start_known_over_the_cap_is_taken(tmp_path, setting,
                                                                                           monkeypatch, caplog):
    """A short budget (a 7B LoRA's 60 s): once START_SHARE of it has passed, no starting point is predicted;
    one predicted already is taken as predicted (none over the cap), the rest at the smallest micro-batch
    (the likeliest to fit), never at the largest as if it fitted."""
    from ckrun.autotune.search.tuner import START_SHARE

    recipe, space = setting
    clock = Clock()
    monkeypatch.setattr("ckrun.autotune.search.study.time.monotonic", clock)
    budget = Budget(trials=20, time_s=40, started=clock.now - START_SHARE * 40 + 3)  # 3 s before the cut
    predictor = Growing(clock, 2)
    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, Counting(recipe), predictor, predicted=True)
    over = space.candidate({**space.starting_points(recipe)[0], "micro_batch": 1, "checkpointing": "none"})
    assert tuner.screening.peak(over) > CAP.limit  # predicted before: none at micro-batch 1 is over
    caplog.set_level("INFO")
    tuner.start(recipe, budget=budget)
    cut = budget.started + START_SHARE * budget.time_s
    assert tuner.starts_cut and predictor.asked_at and all(at <= cut for at in predictor.asked_at)
    queued = [space.candidate(t.system_attrs["fixed_params"]) for t in study.get_trials(states=(TrialState.WAITING,))]
    assert queued and all(predictor.peak(c) <= CAP.limit for c in queued), [describe(c) for c in queued]
    unpredicted = [c for c in queued if c.key not in tuner.screening.peaks]
    assert unpredicted and all(c.plan.micro_batch == 1 for c in unpredicted)
    assert "none" not in {c.plan.checkpointing.label() for c in unpredicted}  # its micro-batch 1 is known over
