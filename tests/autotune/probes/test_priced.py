"""Predictions in the tuner's process (autotune/probes/priced.py): what the pricer holds is frozen out of the
garbage collector's full collections while the search prices, and given back when it closes; plans asked next
are priced cheapest first. Counted: the objects the collector tracks, traces, not seconds."""

from __future__ import annotations

import gc

from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.probes.priced import FULL_EVERY, PricedPredictor
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.knobs import build_space
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.hardware import resolve_device
from ckrun.runner.recipe.load import load_recipe
from conftest import BERT_TINY, TINY_BERT

GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8")


def _pricer() -> tuple[PricedPredictor, list]:
    """A pricer of tiny BERT for an H100, and the candidates of its first two starting points."""
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "model.config.num_hidden_layers=3", "train.device=auto"])
    space = build_space(recipe, ModelFacts.from_json(model_facts(recipe)), GPU)
    return PricedPredictor(recipe, "cuda", resolve_device("h100")), \
        [space.candidate(point) for point in space.starting_points(recipe)[:2]]


def test_the_pricers_objects_are_frozen_while_it_traces_and_given_back_at_close():
    """Frozen, and the full collections spaced out (frozen objects are not counted as long-lived, so they would
    come after few new ones); both as they were once it closes."""
    predictor, (first, again) = _pricer()
    assert gc.get_freeze_count() == 0
    thresholds = gc.get_threshold()
    try:
        assert predictor(first).peak > 0
        frozen = gc.get_freeze_count()
        assert frozen > 0  # the fake model and the traces the first prediction made
        assert gc.get_threshold() == (*thresholds[:2], max(thresholds[2], FULL_EVERY))
        assert predictor(first).peak > 0 and gc.get_freeze_count() <= frozen  # no new trace: nothing more frozen
        predictor(again)
    finally:
        predictor.close()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds  # the caller's collector as it was


def test_a_caller_that_froze_objects_of_its_own_keeps_them_frozen():
    """gc.unfreeze gives back every frozen object: where the caller froze some (a server before it forks),
    the pricer freezes nothing, so its close unfreezes nothing of theirs."""
    predictor, (first, _) = _pricer()
    gc.freeze()
    theirs = gc.get_freeze_count()
    try:
        assert predictor(first).peak > 0
        assert gc.get_freeze_count() <= theirs  # none of the pricer's (theirs may die meanwhile: refcounting)
        predictor.close()
        assert 0 < gc.get_freeze_count() <= theirs  # theirs still frozen
    finally:
        gc.unfreeze()


def test_plans_asked_next_are_priced_those_traced_first_then_the_fewest_blocks_to_trace_first():
    """A walk's plans, in the order the pricer gives: one composed from what is traced, one needing one block
    traced (selective), one needing blocks around each offloaded one; the same order with or without a second
    pricer (none here), so the search is the same."""
    predictor, _ = _pricer()
    recipe = predictor.recipe

    def candidate(fields: dict) -> Candidate:
        return Candidate(MemoryPlan.model_validate({"blocks": recipe.memory.blocks, "micro_batch": 4, **fields}), "bf16")

    try:
        predictor(candidate({"checkpointing": {"policy": "full"}}))  # traced with a kept block beside
        offloaded = candidate({"checkpointing": {"policy": "every", "every": 2}, "offload": {"policy": "all"}})
        selective, kept = candidate({"checkpointing": {"policy": "selective"}}), candidate({})
        traces = predictor._pricer.traces
        assert [id(c) for c in predictor.prefetch([offloaded, selective, kept])] == [id(kept), id(selective), id(offloaded)]
        assert predictor._pricer.traces == traces  # ordering traced nothing
    finally:
        predictor.close()
