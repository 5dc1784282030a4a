"""The allocator and compile's activation memory budget as tuner knobs: the allocator per probe on
CUDA only, the budget a stepped number searched with compile, never screened by the eager estimate
and never ruled out from its neighbours: a non-monotonic peak is found by measuring."""

import pytest

from ckrun.autotune.cap import Cap
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.records import ranked_feasible
from ckrun.autotune.records import ProbeResult
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.search.study import Budget, open_study, trial_records
from ckrun.autotune.search.tuner import Tuner
from tune_helpers import valid_points
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.memory.torch_features import missing_budget


CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")
GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8")
needs_budget = pytest.mark.skipif(missing_budget() is not None, reason="this torch has no activation_memory_budget")


def _space(device=CPU, overrides=(), **flags):
    recipe = load_recipe(BERT_TINY, TINY_BERT + ["model.config.num_hidden_layers=4", *overrides])
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device, **flags)


def test_allocator_is_searched_per_probe_on_cuda_only():
    recipe, gpu = _space(GPU)
    assert gpu.choices["allocator"] == ["default", "expandable_segments:True"]
    allocators = {memory.allocator for _, memory in valid_points(gpu, recipe)}
    assert allocators == {None, "expandable_segments:True"}
    assert all(p["allocator"] == "default" for p in gpu.starting_points(recipe))
    _, cpu = _space(CPU)
    assert "allocator" not in cpu.choices and "allocator" not in cpu.fixed


@needs_budget
def test_budget_is_a_number_searched_with_compile():
    recipe, space = _space(search_compile=True)
    assert "activation_memory_budget" in space.distributions() and "activation_memory_budget" not in space.choices
    grid = sorted({p["activation_memory_budget"] for p in space.all_params()})
    assert grid == [round(0.1 * i, 6) for i in range(11)]
    for params in space.all_params()[:200]:
        plan = space.candidate(params).plan
        assert plan.activation_memory_budget == (params["activation_memory_budget"] if plan.compile else None)
    _, without = _space()
    assert "activation_memory_budget" not in without.distributions()


@needs_budget
def test_a_non_monotonic_budget_is_measured_not_assumed(tmp_path):
    """Peak dips at budget 0.3 only (pytorch issue 197838 shows such shapes): the estimate (eager, over
    the cap) screens none of these plans, and the study finds the dip by measuring."""
    recipe, space = _space(overrides=["memory.compile=true", "memory.micro_batch=8"], search_micro_batch=False)
    space.fixed["micro_batch"], space.choices = 8, {"checkpointing": ["none"]}  # the budget alone decides: 11 plans
    cap, probed = Cap(1_000_000, 0.05), []

    def probe(candidate, number):
        budget = candidate.plan.activation_memory_budget
        probed.append(budget)
        peak = 700_000 if budget == 0.3 else 1_200_000 - int(100_000 * budget)  # lower budget, higher peak
        return ProbeResult(status="ok", measured_peak_bytes=peak, samples_per_s=10 + budget)

    study, _ = open_study(tmp_path, {"seed": 0}, False)
    tuner = Tuner(study, space, cap, probe, predict=lambda candidate: 10 * cap.bytes)
    tuner.start(recipe)
    tuner.run(Budget(trials=11))
    records = trial_records(study)
    assert not [r for r in records if r.state == "screened"] and not tuner.screening.peaks
    assert sorted(set(probed)) == [round(0.1 * i, 6) for i in range(11)]
    assert ranked_feasible(records)[0].plan["activation_memory_budget"] == 0.3
