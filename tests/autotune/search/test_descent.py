"""The predicted search's walks (autotune/search/descent.py), on predictions made up from the knobs' values.

Counted, not timed: each prediction is a function of the plan's labels (activations by micro-batch and
checkpointing, shrunk by offload and compression; pools by their settings; time grown by each lighter
value), so the best plan that fits is known by going through the grid. The 8B's shape (issue 42): the
fastest fit is three knobs from every starting point, and its first step is several times over the limit.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.autotune.cap import Cap
from ckrun.autotune.records import ProbeResult, ranked_feasible
from ckrun.autotune.search.run import SearchSettings, search
from ckrun.autotune.search.study import Budget, Prediction, open_study
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.space.pool_floor import Bound
from ckrun.autotune.space.space import Space
from ckrun.autotune.space.validity import invalid_reason
from ckrun.runner.memory.floor import ParameterFacts
from ckrun.runner.recipe.load import load_recipe
from conftest import BERT_TINY, TINY_BERT

GB = 10**9
GPU = Device("cuda", "H100", 80 * GB, ("fp32", "bf16", "fp16"), "test", None, 0, 1)
FACTS = ModelFacts.from_json({"container_name": "encoder.layer", "blocks": [f"encoder.layer.{i}" for i in range(4)],
                              "containers": ["encoder.layer"] * 4})
RECIPE = load_recipe(BERT_TINY, [*TINY_BERT, "train.batch_size=8", "precision=bf16"])
CAP = Cap(80 * GB, 0.05)
POOLS = ("weights", "optimizer_state", "optimizer_offload")


def gpu_space(billions: float) -> Space:
    """Tiny BERT's space on an H100 with the lossy knobs, its pools' bound counted for `billions` parameters."""
    space = build_space(RECIPE, FACTS, GPU, allow_lossy=True)
    count = int(billions * GB)
    space.bound = Bound(ParameterFacts(count, 4 * count, count, 4 * count, 4 * count // 100), RECIPE.step_facts(), 0,
                        CAP.limit)
    return space


class Model:
    """Made-up peaks and step times: the pools hold their bound (autotune/space/pool_floor.py); what a plan saves
    of its activations (offload, compression, a smaller micro-batch) it pays for in time, and checkpointing's
    values trade one for the other unordered. `saved`: per checkpointing label, the activations a sample keeps
    (GB), the recompute's seconds and the seconds its activations' copies to the host and back add (not hidden
    under the compute)."""

    def __init__(self, space: Space, saved: dict[str, tuple[float, float, float]]):
        self.space, self.saved, self.floors = space, saved, {}

    def __call__(self, point: dict) -> tuple[int, float]:
        """(peak bytes, step seconds) of a point of the space."""
        per_sample_gb, recompute_s, copies_s = self.saved[point["checkpointing"]]
        micro, kept = point["micro_batch"], {"none": 1.0, "bf16": 0.6, "fp8": 0.35}[point["compression"]]
        activations = per_sample_gb * micro * kept
        seconds = 0.8 / micro + 1.0 + recompute_s + {"none": 0.0, "bf16": 0.05, "fp8": 0.12}[point["compression"]]
        if point["offload"] == "all":
            seconds += copies_s * kept * micro / 8
            activations *= 0.1
        seconds += 2.0 * (point["optimizer_offload"] != "none")
        return self._floor(point) + int(activations * GB), seconds

    def _floor(self, point: dict) -> int:
        pools = tuple(point[name] for name in POOLS)
        if pools not in self.floors:
            self.floors[pools] = self.space.bound.floor(self.space.candidate(point)).total
        return self.floors[pools]


def predicted_search(model: Model, trials: int, directory: str | None = None, resume: bool = False) -> list:
    """Every trial record of a predicted search on the model's space whose predictions are the model's (its
    study in `directory`, a new one unless `resume`)."""
    if directory is None:
        with tempfile.TemporaryDirectory() as directory:
            return predicted_search(model, trials, directory)
    space = model.space

    def predict(candidate: Candidate) -> Prediction:
        peak, seconds = model(space.point_of(candidate))
        return Prediction(peak, time={"seconds": seconds, "samples_per_s": 8 / seconds, "mfu": 0.3, "hfu": 0.3})

    def evaluate(candidate: Candidate, number: int) -> ProbeResult:
        prediction = predict(candidate)
        return ProbeResult(status="ok", measured_peak_bytes=prediction.peak, predicted=True, probe_s=0.0,
                           samples_per_s=prediction.time["samples_per_s"], step_s=prediction.time["seconds"],
                           device="H100", device_total_bytes=GPU.total_bytes, torch=torch.__version__)

    study, fresh = open_study(Path(directory), {"cap": CAP.bytes}, resume)
    return search(study, fresh, RECIPE, space, CAP, GPU, Budget(trials=trials), evaluate, predict,
                  SearchSettings(0, 0, "off", timed_steps=0, predicted=True))


def best_fit(model: Model) -> float:
    """The step time of the fastest valid point of the space whose peak is within the limit (the grid gone through)."""
    space = model.space
    names = list(space.choices)
    points = (dict(zip(names, values, strict=True)) for values in itertools.product(*space.choices.values()))
    fits = sorted(((seconds, point) for point in points for peak, seconds in [model(point)] if peak <= CAP.limit),
                  key=lambda fit: fit[0])
    return next(seconds for seconds, point in fits if not invalid_reason(space.candidate(point), space))


def eight_b() -> Model:
    """The Llama 8B's shape at 80 GB: full checkpointing fits and is slow, selective checkpointing is fast and 3.5
    times over the limit, its activations on the host cost little time, and a 4-bit state closes the rest."""
    space = gpu_space(8.0)
    saved = {"none": (40.0, 0.0, 5.0), "full": (0.5, 0.9, 0.0), "every:2": (20.0, 0.45, 3.0), "sqrt": (6.0, 0.75, 1.0),
             "selective": (25.0, 0.2, 0.05), "selective:2": (12.0, 0.55, 0.1)}
    return Model(space, {label: saved.get(label, (30.0, 0.3, 4.0)) for label in space.choices["checkpointing"]})


def test_the_fastest_fit_three_knobs_away_and_first_over_the_limit_is_found():
    model = eight_b()
    records = predicted_search(model, trials=150)
    best = best_fit(model)
    assert ranked_feasible(records)[0].step_s == best
    first = next(r for r in records if r.state == "feasible" and r.step_s == best)
    assert first.proposed_by == "lighter"  # brought under the limit from a faster plan over it
    assert first.number < 50


def test_a_resumed_predicted_search_walks_on_to_the_same_best_plan_pricing_no_plan_twice():
    model = eight_b()
    with tempfile.TemporaryDirectory() as directory:
        stopped = predicted_search(model, 20, directory)
        records = predicted_search(model, 150, directory, resume=True)
    best = best_fit(model)
    assert min(r.step_s for r in stopped if r.state == "feasible") > best  # stopped before the walks got there
    assert ranked_feasible(records)[0].step_s == best
    keys = [r.key for r in records if r.duplicate_of is None and r.key]
    assert len(keys) == len(set(keys))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_each_walk_goes_one_knob_from_a_plan_it_had_priced(data):
    """A 'faster' trial is one knob from a fit priced before it, holding more (or along an unordered knob); a
    'lighter' one is one knob lighter than a plan priced over the limit before it."""
    space = gpu_space(data.draw(st.floats(0.5, 12.0)))
    saved = {label: (data.draw(st.floats(0.2, 50.0)), data.draw(st.floats(0.0, 1.0)), data.draw(st.floats(0.0, 5.0)))
             for label in space.choices["checkpointing"]}
    records = predicted_search(Model(space, saved), trials=60)
    priced = []
    for record in records:
        point = space.point_of(Candidate(_plan(record), record.precision))
        if record.proposed_by == "faster":
            assert any(_one_knob(p, point) and peak <= CAP.limit and _not_lighter(space, p, point)
                       for p, peak in priced)
        if record.proposed_by == "lighter":
            assert any(_one_knob(p, point) and peak > CAP.limit and not _not_lighter(space, p, point) for p, peak in priced)
        if record.step_s is not None or record.predicted_s is not None:
            priced.append((point, record.measured_peak or record.predicted_peak))


def _one_knob(before: dict, after: dict) -> bool:
    return sum(before[k] != after[k] for k in after) == 1


def _not_lighter(space: Space, before: dict, after: dict) -> bool:
    """Whether `after` is one knob from `before` along a knob without an order, or holds more by its order."""
    (name,) = [k for k in after if before[k] != after[k]]
    knob = next(k for k in space.knobs if k.name == name)
    return knob.lighter is None or after[name] not in knob.lighter(space, before[name])


def _plan(record):
    from ckrun.runner.plan.memory_plan import MemoryPlan

    return MemoryPlan.model_validate(record.plan)

