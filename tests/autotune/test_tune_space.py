"""The search space: divisors for micro_batch, every-k below the block count, knobs pinned unless
asked for, offload only on CUDA; every point is a plan the recipe schema accepts."""

import json

import pytest

from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space, describe
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from tune_helpers import valid_points

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")
GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8")


def _space(layers: int, device: Device = CPU, **flags):
    recipe = load_recipe(BERT_TINY, TINY_BERT + [f"model.config.num_hidden_layers={layers}", "train.batch_size=12"])
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device, **flags)


def test_cpu_space_of_a_12_block_model():
    recipe, space = _space(12)
    assert space.choices == {
        "micro_batch": [1, 2, 3, 4, 6, 12],
        "checkpointing": ["none", "full", "every:2", "every:3", "every:4", "every:6", "every:8", "sqrt", "selective",
                          "selective:2"],
        "loss": ["whole", "chunked:8"],  # its head is one Linear; in_backward needs no clipping, offload a GPU
    }
    assert space.fixed == {"offload": "none", "precision": "fp32", "compile": False, "weights": "fp32",
                           "optimizer_state": "full", "optimizer_step": "after", "optimizer_offload": "none"}
    assert space.size == 120


def test_two_blocks_leave_out_every_k_and_sqrt():
    # with 2 blocks sqrt makes one segment and checkpoints nothing: the same plan as none
    _, space = _space(2)
    assert space.choices["checkpointing"] == ["none", "full", "selective", "selective:2"]


def test_cuda_searches_offload_and_flags_add_precision_and_compile():
    _, space = _space(4, GPU, search_precision=True, search_compile=True)
    assert space.choices["offload"] == ["none", "all"]
    assert space.choices["precision"] == ["fp32", "bf16", "fp16"]
    assert space.choices["compile"] == [False, True]
    assert "precision" not in space.fixed and "offload" not in space.fixed


def test_starting_points_come_first_with_the_whole_batch():
    recipe, space = _space(4)
    labels = [describe(space.candidate(p)) for p in space.starting_points(recipe)]
    assert labels == ["micro_batch 12, checkpointing none, fp32", "micro_batch 12, checkpointing full, fp32",
                      "micro_batch 12, checkpointing every:2, fp32"]


@pytest.mark.parametrize("device", [CPU, GPU], ids=["cpu", "cuda"])
def test_every_point_is_a_valid_recipe_or_refused_for_its_combination(device):
    recipe, space = _space(4, device, search_precision=True)
    valid = {json.dumps(params, sort_keys=True): memory for params, memory in valid_points(space, recipe)}
    assert all(memory.micro_batch == json.loads(params)["micro_batch"] for params, memory in valid.items())
    assert len(valid) > space.size // 2  # the refused are the few combinations plan_problems names
    keys = {space.candidate(params).key for params in space.all_params()}
    assert len(keys) == space.size  # distinct params never make the same plan


def test_with_predictions_starting_points_take_the_largest_micro_batch_that_fits():
    recipe, space = _space(4)
    fits = lambda c: c.plan.micro_batch * (4 if c.plan.checkpointing.policy == "none" else 1) <= 12  # noqa: E731
    labels = [describe(space.candidate(p)) for p in space.starting_points(recipe, fits)]
    assert labels == ["micro_batch 3, checkpointing none, fp32", "micro_batch 12, checkpointing full, fp32",
                      "micro_batch 12, checkpointing every:2, fp32"]
    assert space.starting_points(recipe, lambda c: False) == []
