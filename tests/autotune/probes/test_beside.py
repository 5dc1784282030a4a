"""The second pricer (autotune/probes/beside.py): traces made in another process serve the tuner's composer as
its own would, to the byte; which ones it takes is decided by the keys alone; its solver answers as the tuner's;
and a second pricer that dies leaves the tuner pricing alone, saying so. Counted: bytes, keys and plans."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from ckrun.autotune.probes.beside import Beside, Taking, serves
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.probes.priced import PricedPredictor
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.compose import Composer
from ckrun.runner.predict.hardware import resolve_device
from ckrun.runner.predict.parts import PartsEstimator
from ckrun.runner.recipe.load import load_recipe
from conftest import BERT_TINY, TINY_BERT

GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8")
OVERRIDES = [*TINY_BERT, "model.config.num_hidden_layers=4", "train.device=auto"]
PLANS = [{"checkpointing": {"policy": "every", "every": 2}, "offload": {"policy": "all"}},
         {"checkpointing": {"policy": "full"}}, {"checkpointing": {"policy": "selective"}}]


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(BERT_TINY, OVERRIDES)


@pytest.fixture(scope="module")
def beside(recipe, tmp_path_factory):
    second = Beside(recipe, "cuda", resolve_device("h100"), tmp_path_factory.mktemp("beside"))
    yield second
    second.close()


def _plan(recipe, fields: dict) -> MemoryPlan:
    return MemoryPlan.model_validate({"blocks": recipe.memory.blocks, "micro_batch": 4, **fields})


def _made_there(beside: Beside, key: tuple) -> None:
    """Wait (a bounded while) until the other process has sent the trace of `key`."""
    deadline = time.monotonic() + 120
    while key not in beside.made and beside.broken is None and time.monotonic() < deadline:
        beside._receive(1.0, "a test's trace") if beside.connection.poll(1.0) else None
    assert key in beside.made, beside.broken


def test_a_trace_serves_its_own_key_or_a_block_trace_of_the_same_parts_with_more_blocks_real():
    step = ("step", "parts", "actions", (0, 1, 2))
    assert serves(step, step)
    assert serves(step, ("step", "parts", "actions", (1, 2)))
    assert not serves(step, ("step", "parts", "actions", (2, 3)))  # block 3 was a relay there
    assert not serves(step, ("step", "other parts", "actions", (1,)))
    assert not serves(step, ("step", "parts", "other actions", (1,)))
    assert not serves(("update", 1, 2, frozenset({3})), ("update", 1, 2, frozenset()))


@pytest.mark.parametrize("fields", PLANS, ids=["every2-offload", "full", "selective"])
def test_a_plan_priced_from_traces_made_beside_is_priced_as_from_traces_made_here(recipe, beside, fields):
    """Every trace the plan needs is made in the other process (asked for as a search asks), then taken: the peak
    to the byte and the step time to the last bit, as where this process made them all."""
    plan = _plan(recipe, fields)
    here = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")))
    expected = here.estimate(plan, "bf16")
    there = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")), tracer=Taking(beside))
    taken = beside.taken
    while (request := there.next_trace(plan, "bf16")) is not None:  # each trace as pricing the plan asks for it
        beside.ask([request])
        _made_there(beside, request[1])
        layout = there._layout(plan, "bf16")
        if request[0] == "step":
            there._trace(layout, *there._wanted(layout))
        else:
            layout.reps = [there.represented[(layout.key, signature)] for signature in layout.signatures]
            layout.absolute = there.absolute[layout.key]
            there._update(layout)
    got = there.estimate(plan, "bf16")
    assert beside.taken > taken and there.traces == beside.taken - taken
    assert (got.peak_bytes, got.time.seconds) == (expected.peak_bytes, expected.time.seconds)


def test_the_solver_beside_proposes_the_plans_the_solver_here_proposes(recipe, beside):
    space = build_space(recipe, ModelFacts.from_json(model_facts(recipe)), GPU)
    base = _plan(recipe, {}).model_dump(mode="json")
    request = {"pairs": [[m, "bf16"] for m in space.micro_batches()], "limit": 150 * 2**20, "offload": True,
               "timed_steps": 0, "context": 0, "base": base, "deadline": None}
    here = PricedPredictor(recipe, "cuda", resolve_device("h100"))
    there = PricedPredictor(recipe, "cuda", resolve_device("h100"), beside=beside)
    try:
        expected, answered = here.frontier(request), there.frontier_later(request)
        assert answered() == expected and expected["status"] == "ok" and expected["lines"]
    finally:
        here.close()


def test_a_second_pricer_that_dies_leaves_the_tuner_pricing_alone_and_saying_so(recipe, tmp_path, caplog):
    second = Beside(recipe, "cuda", resolve_device("h100"), tmp_path)
    plan = _plan(recipe, PLANS[0])
    composer = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")), tracer=Taking(second))
    request = composer.next_trace(plan, "bf16")
    second.ask([request])
    os.killpg(second.process.pid, signal.SIGKILL)
    with caplog.at_level(logging.WARNING, logger="ckrun.autotune.probes.beside"):
        estimate = composer.estimate(plan, "bf16")  # made here: the other process is gone
        second.ask([request])  # asks nothing of a broken second pricer
    assert estimate.peak_bytes > 0 and second.broken and second.taken == 0
    assert len([r for r in caplog.records if "second pricer stopped" in r.getMessage()]) == 1


def test_a_trace_with_more_blocks_real_than_asked_prices_a_plan_as_the_trace_asked_for(recipe, beside):
    """The trace `serves` gives where the tuner asks for fewer real blocks (a plan's trace chosen before the traces
    ahead of it were made): every block real, taken for the plan's first trace, the estimate to the byte."""
    from ckrun.runner.predict.compose import trace_key

    plan = _plan(recipe, PLANS[1])  # full: its first trace makes two of the four blocks real
    expected = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100"))).estimate(plan, "bf16")
    there = Composer(PartsEstimator(recipe, "cuda", resolve_device("h100")), tracer=Taking(beside))
    kind, key, traced, precision, real = there.next_trace(plan, "bf16")
    every = frozenset(range(len(there.blocks(plan))))
    assert kind == "step" and real < every
    wider = trace_key(key[1], traced, every)
    beside.ask([(kind, wider, traced, precision, every)])
    _made_there(beside, wider)
    taken = beside.taken
    got = there.estimate(plan, "bf16")
    assert beside.taken == taken + 1 and wider not in beside.made
    assert (got.peak_bytes, got.time.seconds) == (expected.peak_bytes, expected.time.seconds)
