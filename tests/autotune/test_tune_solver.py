"""The tuner with the solver's plans: they are the study's first trials, their per-block labels
join the space, and a small space is predicted whole and searched exhaustively."""

from __future__ import annotations

import json
import logging

import pytest

from ckrun.autotune.cap import Cap
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.search.study import Budget, open_study, trial_records
from ckrun.autotune.search.tuner import Tuner
from conftest import BERT_TINY, TINY_BERT
from fake_child import measure
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan

CAP = Cap(2_500_000, 0.05)


def _setting(layers: int = 4):
    recipe = load_recipe(BERT_TINY, TINY_BERT + [f"model.config.num_hidden_layers={layers}"])
    device = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device)


def _probe(recipe):
    return lambda candidate, number: measure(json.loads(candidate.recipe(recipe, CAP.bytes).model_dump_json()), 1, 1)


def _proposal(micro: int, layers: list[int]) -> dict:
    plan = MemoryPlan.model_validate({"micro_batch": micro, "checkpointing": {"policy": "layers", "layers": layers}})
    return {"plan": plan.model_dump(mode="json"), "precision": "fp32", "predicted_peak": 1, "added_s": 0.0,
            "reason": "test"}


def test_the_solvers_plans_are_the_first_trials_and_join_the_space(tmp_path):
    recipe, space = _setting()
    points = space.add_proposals([_proposal(8, [1, 3]), _proposal(4, [2]), _proposal(8, [1, 3])])
    assert [p["checkpointing"] for p in points] == ["layers:1,3", "layers:2"]  # the repeat is dropped
    assert {"layers:1,3", "layers:2"} <= set(space.choices["checkpointing"])
    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, _probe(recipe))
    tuner.start(recipe, points)
    tuner.run(Budget(5))
    records = trial_records(study)
    assert [r.plan["checkpointing"].get("layers") for r in records[:2]] == [[1, 3], [2]]
    assert [r.plan["micro_batch"] for r in records[:2]] == [8, 4]
    assert [r.proposed_by for r in records[:3]] == ["solver", "solver", None]
    assert records[2].plan["checkpointing"]["policy"] == "none"  # then the usual starting points


def test_a_plan_that_differs_from_a_pinned_knob_is_left_out():
    _, space = _setting()
    bf16 = {**_proposal(8, [1]), "precision": "bf16"}  # precision is pinned to the recipe's fp32
    assert space.add_proposals([bf16]) == []


@pytest.mark.parametrize("trials, exhaustive", [(40, True), (3, False)])
def test_a_small_space_is_predicted_whole_and_searched_exhaustively(tmp_path, caplog, trials, exhaustive):
    recipe, space = _setting(layers=2)
    formula = lambda c: measure(json.loads(c.recipe(recipe, 10**12).model_dump_json()), 1, 1).peak_mem_bytes  # noqa: E731
    study, _ = open_study(tmp_path, {}, False)
    tuner = Tuner(study, space, CAP, _probe(recipe), predict=formula)
    with caplog.at_level(logging.INFO, logger="ckrun.autotune.search.tuner"):
        tuner.start(recipe, [], trials)
    fitting = [p for p in space.all_params() if formula(space.candidate(p)) <= CAP.screen_above]
    assert ("exhaustive search" in caplog.text) is exhaustive
    if exhaustive:
        tuner.run(Budget(trials))
        probed = {r.key for r in trial_records(study) if r.probe_s is not None}
        assert probed == {space.candidate(p).key for p in fitting}  # every plan predicted to fit, and no other
        assert tuner.probes == len(fitting) <= trials
