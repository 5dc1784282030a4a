"""A model that trains must estimate: builders and forwards that read tensor values, which the
fake tensors of an estimate do not have (torchvision's RegNet, a forward branching on `.item()`)."""

from __future__ import annotations

import json

import pytest
import torchvision

from conftest import read_metrics

RECIPE = """
model: {{source: {source}, name: {name}, config: {config}}}
data: {{source: synthetic, image_size: 32, task: image_classification, num_classes: 3}}
train: {{batch_size: 4, steps: 1, device: cpu}}
memory: {{checkpointing: {{policy: {policy}}}}}
output: {{dir: {out}}}
"""

VALUE_READING_MODEL = '''
import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(48, 48) for _ in range(2)])
        self.head = nn.Linear(48, 3)

    def forward(self, images):
        x = images.flatten(2).mean(-1).repeat(1, 16)
        if x.abs().max().item() > 1e6:  # a branch on a value: fake tensors have none
            x = x / 2
        return self.head(self.blocks(x))


def build():
    return Gated()
'''


def _recipe(tmp_path, source, name, config="{}", policy="none"):
    path = tmp_path / f"{name.replace(':', '_')}.yaml"
    path.write_text(RECIPE.format(source=source, name=name, config=config, policy=policy, out=tmp_path / "run"))
    return path


def test_a_builder_that_reads_values_estimates_as_usual(tmp_path, ckrun):
    # RegNet computes its widths with torch and .tolist(): estimate exited 2 blaming `memory`
    recipe = _recipe(tmp_path, "torchvision", "regnet_y_400mf", "{num_classes: 10}", "full")
    code, out, err = ckrun("estimate", recipe, "--device", "cpu", "--json")
    assert code == 0, err
    estimate = json.loads(out)
    model = torchvision.models.regnet_y_400mf(num_classes=10)
    assert estimate["breakdown"]["parameters"] == sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert not any(note.startswith("approximate") for note in estimate["notes"])  # still the fake estimate


def test_a_forward_that_reads_values_is_probed_for_real_and_says_so(tmp_path, ckrun, monkeypatch):
    (tmp_path / "gated_model.py").write_text(VALUE_READING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    for policy in ("none", "full"):
        recipe = _recipe(tmp_path, "python", "gated_model:build", policy=policy)
        code, out, err = ckrun("estimate", recipe, "--device", "cpu", "--json")
        assert code == 0, err
        estimate = json.loads(out)
        assert estimate["notes"][0].startswith("approximate: measured on real CPU tensors")
        assert ckrun(recipe, f"output.dir={tmp_path / policy}")[0] == 0
        measured = read_metrics(tmp_path / policy)[0]["peak_mem_bytes"]
        assert estimate["peak_bytes"] == pytest.approx(measured, rel=0.05), policy  # as every estimate is held to


def test_a_model_fault_the_probe_meets_names_the_model_not_the_plan(tmp_path, ckrun, monkeypatch):
    (tmp_path / "gated_model.py").write_text(VALUE_READING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = _recipe(tmp_path, "python", "gated_model:build")
    code, _, err = ckrun("estimate", recipe, "data.num_classes=50", "--device", "cpu")  # 3 outputs for 50 classes
    assert code == 2 and "model.name: gated_model:build's forward returns 3 classes" in err, err  # was `memory:`
