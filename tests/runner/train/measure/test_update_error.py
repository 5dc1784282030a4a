"""A lossy optimizer's error is measured, not assumed: exact AdamW follows a sample of every
parameter through the first steps on the same gradients; an exact optimizer measures exactly 0, a
lossy one its distance, which training logs and a probe reports."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ckrun.runner.builders.optim import decay_groups
from ckrun.runner.train.measure.probe import probe
from ckrun.runner.train.measure.update_error import SAMPLE, UpdateErrorMeter
from tests.runner.memory.tiny_lm import WIDE, needs_torchao, recipe


def test_exact_adamw_measures_zero_and_only_the_optimizer_is_measured():
    """The meter's exact copy is the same AdamW arithmetic on the same sample: run beside torch's own
    AdamW (under a schedule, with weight decay on matrices only) it finds no difference at all; a
    parameter larger than the sample is followed on its first SAMPLE elements."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 100), nn.Tanh(), nn.Linear(100, 3))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(decay_groups(params, 0.1), lr=0.01, foreach=False)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    meter = UpdateErrorMeter(optimizer, params, steps=3)
    assert meter.samples[0][1] == min(200 * 100, SAMPLE)
    for _ in range(3):
        model(torch.randn(8, 200)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        error = meter.stepped()
    assert error == 0.0 and meter.error == 0.0
    assert not optimizer._optimizer_step_pre_hooks  # it stopped following


@needs_torchao
@pytest.mark.parametrize(("memory", "precision"), [
    ("{optimizer_state: {policy: 8bit}, allow_lossy: true}", "fp32"),
    ("{optimizer_state: {policy: 4bit}, allow_lossy: true}", "fp32"),
    ("{optimizer_state: {policy: fp8}, allow_lossy: true}", "fp32"),
    ("{weights: {policy: bf16}, optimizer_step: {policy: in_backward}, allow_lossy: true}", "bf16"),
])
def test_a_lossy_optimizers_error_is_logged_and_reported_by_a_probe(memory, precision, caplog):
    with caplog.at_level(logging.INFO, logger="ckrun.runner.train.trainer"):
        measured = probe(recipe(memory, WIDE, precision), warmup_steps=2, timed_steps=1)
    # below the update itself: embeddings keep full-precision moments (LowBitState.full_precision_embeddings)
    assert measured.status == "ok" and measured.update_error is not None and 0 < measured.update_error < 1
    lines = [r.getMessage() for r in caplog.records if "against exact AdamW" in r.getMessage()]
    assert len(lines) == 1 and f"relative error {measured.update_error:.2e} of the weights' change over the first 3" \
        in lines[0]


def test_an_exact_plan_measures_nothing():
    assert probe(recipe("{optimizer_step: {policy: in_backward}}"), warmup_steps=2, timed_steps=1).update_error is None
