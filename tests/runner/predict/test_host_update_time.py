"""memory.optimizer_offload in the time model: the host's update priced at the host's AdamW rate for
exactly the parameters it holds, and the copies after the backward at the host link's rate, both ways
(counted, not timed)."""

from __future__ import annotations

from functools import cache

import pytest

from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import resolve_device
from ckrun.runner.predict.roofline import HOST_ADAMW_PER_S
from tests.runner.memory.tiny_lm import WIDE, recipe

H100 = resolve_device("h100")


@cache
def _estimator() -> Estimator:
    return Estimator(recipe("{}", WIDE, "bf16", batch_size=2, device="cuda"), "cuda", H100)


def _offload(fraction: float, micro_batch: int = 2) -> MemoryPlan:
    return MemoryPlan.model_validate({"micro_batch": micro_batch,
                                      "optimizer_offload": {"policy": "cpu", "fraction": fraction}})


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_the_host_update_is_its_parameters_at_the_hosts_adamw_rate(fraction):
    estimator = _estimator()
    estimate = estimator.estimate(_offload(fraction), "bf16")
    hosted = sum(t.numel() for t in estimator._optimizing(_offload(fraction)).optimizer.copies.values())
    assert 0 < hosted <= sum(p.numel() for p in estimator.model.parameters())
    assert estimate.time.by_class["host_adamw"] == pytest.approx(hosted / HOST_ADAMW_PER_S)
    assert "host_adamw" not in estimator.estimate(MemoryPlan(micro_batch=2), "bf16").time.by_class


def test_a_measured_host_rate_replaces_the_assumed_one_and_copies_go_at_the_host_link():
    plan = _offload(1.0, micro_batch=1)  # two micro-batches: the gradients are copied after the backward
    estimate = _estimator().estimate(plan, "bf16")
    assumed = estimate.time
    measured = estimate.time_on(H100.model_copy(update={"host_adamw_per_s": HOST_ADAMW_PER_S / 4}))
    assert measured.by_class["host_adamw"] == pytest.approx(4 * assumed.by_class["host_adamw"])
    parameters = sum(p.numel() * p.element_size() for p in _estimator().model.parameters())
    # each float32 gradient out and each updated parameter back
    assert assumed.by_class["host_copies"] == pytest.approx(2 * parameters / (H100.host_gbs * 1e9))
    assert assumed.update_s >= assumed.by_class["host_adamw"] + assumed.by_class["host_copies"]
