"""The recipe's `tf32` key: torch's fp32 math settings as the recipe says, torch's defaults when unset."""

from __future__ import annotations

import pytest
import torch

from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.train.step import set_fp32_math

RECIPE = """
model: {source: torchvision, name: resnet18, config: {num_classes: 10}}
data: {source: synthetic, image_size: 32}
train: {batch_size: 8, steps: 2, device: cpu}
"""


@pytest.fixture
def restored():
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]


@pytest.mark.parametrize("tf32, matmul, cudnn", [(True, "high", True), (False, "highest", False)])
def test_the_key_sets_matmul_precision_and_cudnn(restored, tf32, matmul, cudnn):
    line = set_fp32_math(tf32)
    assert torch.get_float32_matmul_precision() == matmul and torch.backends.cudnn.allow_tf32 is cudnn
    assert line.startswith("tf32:")
    # both the legacy flags and torch >= 2.9's per-backend settings still read (the new API's setters would
    # make the legacy readers raise)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32


def test_unset_leaves_torchs_defaults(restored):
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    assert "torch's defaults" in set_fp32_math(None)
    assert torch.get_float32_matmul_precision() == "medium" and torch.backends.cudnn.allow_tf32


def test_the_recipe_key_takes_a_boolean_or_nothing():
    assert recipe_from_text(RECIPE).tf32 is None
    assert recipe_from_text(RECIPE + "tf32: true\n").tf32 is True
    with pytest.raises(Exception, match="tf32"):
        recipe_from_text(RECIPE + "tf32: maybe\n")
