"""In-place ops (nn.ReLU(inplace=True), F.relu_, in-place dropout, x.add_) wherever a model puts them: the
estimate is the peak a CPU run measures, and a checkpointed block that writes its own input is refused in one
line by the run and the estimate alike (torch's checkpoint keeps that input to recompute from: an internal
error at the first backward, under every policy)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from estimate_models import INPLACE_OPS, INPLACE_PLACES
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict.estimate import estimate_peak
from ckrun.runner.train.trainer import Trainer


def _recipe_text(where: str, op: str, policy: str, precision: str) -> str:
    return f"""
model: {{source: python, name: "estimate_models:in_place_net", config: {{where: {where}, op: {op}}}}}
data: {{source: synthetic, task: image_classification, image_size: 8, num_classes: 4}}
train: {{batch_size: 128, steps: 2, device: cpu}}
precision: {precision}
memory: {{checkpointing: {{policy: {policy}}}}}
"""


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(INPLACE_PLACES), st.sampled_from(sorted(INPLACE_OPS)),
       st.sampled_from(["none", "full", "selective", "sqrt"]), st.sampled_from(["fp32", "bf16"]))
def test_the_estimate_is_the_measured_peak_wherever_an_op_writes_in_place(where, op, policy, precision):
    recipe = recipe_from_text(_recipe_text(where, op, policy, precision))
    if where == "block_input" and policy != "none":
        for run in (lambda: Trainer(recipe).train_step(), lambda: estimate_peak(recipe, "cpu")):
            with pytest.raises(BuildError, match="layers.0 writes a tensor it is given in place") as refused:
                run()
            assert refused.value.key == "memory.checkpointing" and "\n" not in str(refused.value)
        return
    trainer = Trainer(recipe)
    trainer.train_step()  # the first step creates the optimizer state; the estimate is of later steps
    measured = trainer.train_step()["peak_mem_bytes"]
    assert estimate_peak(recipe, "cpu").peak_bytes == measured


@pytest.mark.parametrize("policy", ["full", "selective", "sqrt"])
def test_a_block_that_writes_its_input_is_refused_by_the_run_in_one_line(tmp_path, ckrun, policy):
    path = tmp_path / "r.yaml"
    path.write_text(_recipe_text("block_input", "relu_module", policy, "fp32"))
    code, _, err = ckrun(path, f"output.dir={tmp_path / 'run'}")
    assert code == 2 and err.strip().count("\n") == 0, err
    assert "memory.checkpointing: layers.0 writes a tensor it is given in place" in err


@pytest.mark.parametrize("policy", ["none", "full"])
def test_a_bf16_batch_norm_before_an_in_place_activation_is_estimated_to_the_byte(policy):
    # the fake kernel kept BatchNorm's saved statistics in bf16, the CPU kernel in its fp32 parameters' dtype:
    # 4 bytes a channel and layer low (MobileNetV3, GoogLeNet: conv, BatchNorm, in-place activation)
    recipe = recipe_from_text(f"""
model: {{source: python, name: "estimate_models:conv_bn_net"}}
data: {{source: synthetic, task: image_classification, image_size: 32, num_classes: 4}}
train: {{batch_size: 16, steps: 2, device: cpu}}
precision: bf16
memory: {{checkpointing: {{policy: {policy}}}}}
""")
    trainer = Trainer(recipe)
    trainer.train_step()
    measured = trainer.train_step()["peak_mem_bytes"]
    assert estimate_peak(recipe, "cpu").peak_bytes == measured


def test_sqrt_replays_a_block_that_writes_an_input_its_region_made():
    # inside a sqrt region a block's input is the previous block's output, which the replay makes again:
    # writing it in place is replayed too (exact, not refused); only a region's first block is refused
    import copy

    import torch

    from estimate_models import in_place_net
    from ckrun.runner.memory.apply import apply_plan
    from ckrun.runner.memory.blocks import find_blocks
    from ckrun.runner.plan.memory_plan import MemoryPlan

    torch.manual_seed(0)
    model, images = in_place_net("block_input", "add_", depth=6), torch.randn(8, 3, 8, 8)
    plan = MemoryPlan(checkpointing={"policy": "sqrt"})
    regions = plan.checkpointing.regions(find_blocks(model))
    for region in regions:
        model.layers[region[0]].where = "middle"  # the first block of each region leaves its input alone

    def gradients(plan):
        copied = copy.deepcopy(model)
        apply_plan(copied, plan, "cpu")
        copied(images).sum().backward()
        return [p.grad for p in copied.parameters()]

    assert any(len(region) > 1 for region in regions)
    assert all(torch.equal(a, b) for a, b in zip(gradients(MemoryPlan()), gradients(plan), strict=True))
