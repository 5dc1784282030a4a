"""`ckrun tune --nproc N` searches the pool knobs as one process does (issue 40.3): bf16 weights and
low-bit optimizer state with --allow-lossy, the update in the backward, the chunked loss, each beside
the strategies; what a strategy cannot run (the update in the backward under ddp) is told infeasible
before a probe, in the strategy's own line; the host optimizer offload under ranks is FSDP2's, the
sharding knob's `cpu`."""

from __future__ import annotations

import importlib.util

import pytest

from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.space.validity import invalid_reason
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe

GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8", count=2)
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (ckrun[lowbit])")


def _space(nproc: int):
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "train.grad_clip=null", "precision=bf16"])
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), GPU, nproc, allow_lossy=True)


@needs_torchao
def test_two_ranks_search_the_pool_knobs_one_process_searches():
    _, one = _space(1)
    _, two = _space(2)
    for section in ("weights", "optimizer_state", "optimizer_step", "loss"):
        assert two.choices[section] == one.choices[section], section
    assert "bf16" in two.choices["weights"] and {"8bit", "4bit"} <= set(two.choices["optimizer_state"])
    assert "in_backward" in two.choices["optimizer_step"] and "chunked:8" in two.choices["loss"]
    assert {"ddp", "fsdp"} <= set(two.choices["sharding"]) and "fsdp:cpu" in two.choices["sharding"]
    assert two.fixed["optimizer_offload"] == "none"
    assert any("optimizer_offload not searched" in line and "sharding knob's cpu" in line for line in two.reasons)


@needs_torchao
@pytest.mark.parametrize(("sharding", "refusal"), [
    ("ddp", "memory.optimizer_step: in_backward would update each parameter with this rank's own gradient"),
    ("fsdp", None), ("fsdp:keep", None)])
def test_the_update_in_the_backward_is_told_infeasible_under_ddp_only(sharding, refusal):
    recipe, space = _space(2)
    point = {name: values[0] for name, values in space.choices.items()}
    point.update(sharding=sharding, optimizer_step="in_backward", weights="bf16", optimizer_state="8bit",
                 loss="chunked:8")
    if "micro_batch" in point:
        point["micro_batch"] = max(space.choices["micro_batch"])  # one micro-batch: the update needs every gradient
    reason = invalid_reason(space.candidate(point), space)
    assert reason == refusal or (refusal is not None and reason.startswith(refusal)), reason
