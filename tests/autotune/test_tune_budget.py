"""`ckrun tune --predict --nproc N` and the trial budget: predictions do not vary, so the search's trials
come in the same order whatever --trials is (the starting points, one per strategy, predicted and ordered
before the first; then the sampler, seeded by --seed and the count so far). A smaller budget runs a prefix
of a larger one's, and a larger budget changes the winner only to a plan predicted faster that it alone
reached. Generated over prediction landscapes (any plan any speed), seeds and pairs of budgets."""

from __future__ import annotations

import hashlib
import logging
import random
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings, strategies as st

from ckrun.autotune.cap import Cap
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.records import ProbeResult
from ckrun.autotune.records import ranked_feasible
from ckrun.autotune.search.run import SearchSettings, search
from ckrun.autotune.space.sharding import ShardingChoice
from ckrun.autotune.search.study import Budget, Prediction, open_study
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe

GPU = Device("cuda", "gpu", 80 * 10**9, ("fp32", "fp16", "bf16"), "test", count=4)
FACTS = ModelFacts.from_json({"container_name": "encoder.layer", "blocks": [f"encoder.layer.{i}" for i in range(4)],
                              "containers": ["encoder.layer"] * 4})
RECIPE = load_recipe(BERT_TINY, [*TINY_BERT, "train.batch_size=16"])


class Landscape:
    """A predictor that gives each plan a peak and a speed drawn from `seed` by its key: any ordering of plans."""

    def __init__(self, seed: int, fits: float):
        self.seed, self.fits, self.asked = seed, fits, []

    def draw(self, candidate: Candidate) -> random.Random:
        digest = hashlib.sha256(f"{self.seed}:{candidate.key}".encode()).hexdigest()
        return random.Random(int(digest[:16], 16))

    def __call__(self, candidate: Candidate) -> Prediction:
        self.asked.append(candidate.key)
        draw = self.draw(candidate)
        peak = int(10**9 * (1 if draw.random() < self.fits else 100))
        seconds = 0.1 + draw.random()
        return Prediction(peak, time={"seconds": seconds, "samples_per_s": 16 / seconds, "mfu": 0.3, "hfu": 0.3})

    def evaluate(self, candidate: Candidate, number: int) -> ProbeResult:
        prediction = self(candidate)
        return ProbeResult(status="ok", measured_peak_bytes=prediction.peak, predicted=True, probe_s=0.0,
                           samples_per_s=prediction.time["samples_per_s"], step_s=prediction.time["seconds"],
                           mfu=0.3, hfu=0.3, device="gpu", device_total_bytes=GPU.total_bytes, torch=torch.__version__)


def searched(landscape: Landscape, trials: int, seed: int):
    space = build_space(RECIPE, FACTS, GPU, nproc=4)
    with tempfile.TemporaryDirectory() as directory:
        study, fresh = open_study(Path(directory), {"cap": 10 * 10**9}, False)
        records = search(study, fresh, RECIPE, space, Cap(10 * 10**9, 0.05), GPU, Budget(trials=trials),
                         landscape.evaluate, landscape, SearchSettings(seed, 0, "off", timed_steps=0, predicted=True))
    return [r for r in records if r.probe_s is not None and r.duplicate_of is None], ranked_feasible(records)


@settings(max_examples=6, deadline=None)
@given(landscape=st.integers(0, 10**6), seed=st.integers(0, 3), fits=st.sampled_from([0.3, 0.8]),
       budgets=st.tuples(st.integers(1, 10), st.integers(1, 10)))
def test_a_smaller_budget_runs_a_prefix_and_a_larger_one_changes_the_winner_only_to_a_faster_plan(
        landscape, seed, fits, budgets):
    small, large = sorted(budgets)
    few, few_ranked = searched(Landscape(landscape, fits), small, seed)
    many, many_ranked = searched(Landscape(landscape, fits), large, seed)
    assert [r.key for r in few] == [r.key for r in many][:len(few)]
    if few_ranked and many_ranked[0].key != few_ranked[0].key:
        assert many_ranked[0].samples_per_s > few_ranked[0].samples_per_s
        assert many_ranked[0].key not in {r.key for r in few}


def test_every_strategy_is_a_starting_point_when_plans_are_predicted(caplog):
    """The issue's 8 trials found ddp and 24 trials fsdp (keep): a strategy reached only by the sampler is
    found or not by the budget. Predicted, each strategy starts (its first choice), the fastest first."""
    space = build_space(RECIPE, FACTS, GPU, nproc=4)
    starts = space.starting_points(RECIPE, lambda candidate: True)
    strategies = {ShardingChoice.from_label(label).strategy.label() for label in space.choices["sharding"]}
    assert {space.candidate(start).strategy.label() for start in starts} == strategies
    assert {start["sharding"] for start in space.starting_points(RECIPE, None)} == {space.choices["sharding"][0]}
    with caplog.at_level(logging.INFO, logger="ckrun.autotune"):
        _, ranked = searched(Landscape(1, 1.0), 3, 0)
    line = next(r.getMessage() for r in caplog.records if "picks it" in r.getMessage())
    assert f"trial {ranked[0].number}," in line
