"""Settings applied before CUDA starts: the allocator's PYTORCH_CUDA_ALLOC_CONF (memory.allocator) and
compile's activation memory budget. On the CPU the allocator setting is a logged no-op."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from hypothesis import given, strategies as st
from pydantic import ValidationError

import children
from conftest import BERT_TINY, TINY_BERT
from runner.load import load_recipe
from runner.memory.allocator import ALLOC_ENV, apply_allocator
from runner.memory.torch_features import functorch_config, missing_budget
from runner.plan import MemoryPlan
from runner.train.loop import Trainer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SETTING = "expandable_segments:True"


def test_a_no_op_on_the_cpu_that_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ALLOC_ENV, raising=False)
    caplog.set_level(logging.INFO)
    Trainer(load_recipe(BERT_TINY, [*TINY_BERT, f"memory.allocator={SETTING}", f"output.dir={tmp_path}"]))
    assert ALLOC_ENV not in os.environ
    assert any("memory.allocator: expandable_segments:True has no effect on the cpu" in r.getMessage()
               for r in caplog.records)


def test_set_before_cuda_starts_and_warned_after(monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setenv(ALLOC_ENV, "max_split_size_mb:64")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert apply_allocator(SETTING, "cuda") and os.environ[ALLOC_ENV] == SETTING
    assert "replacing the environment's 'max_split_size_mb:64'" in caplog.records[-1].getMessage()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not apply_allocator(SETTING, "cuda")
    assert caplog.records[-1].levelno == logging.WARNING and "already initialised" in caplog.records[-1].getMessage()


@given(st.lists(st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
                          st.from_regex(r"[A-Za-z0-9.]{1,6}", fullmatch=True)), min_size=1, max_size=3))
def test_option_value_pairs_are_accepted(pairs):
    text = ",".join(f"{k}:{v}" for k, v in pairs)
    assert MemoryPlan.model_validate({"allocator": text}).allocator == text


@pytest.mark.parametrize("bad", ["expandable_segments", "a:b,", ":True", "a:b c", "a:b;c:d", ""])
def test_malformed_settings_are_refused(bad):
    with pytest.raises(ValidationError, match="option:value pairs joined by commas"):
        MemoryPlan.model_validate({"allocator": bad})


def test_the_probe_child_gets_it_in_its_environment(tmp_path):
    from autotune.probe import child_env

    recipe = load_recipe(BERT_TINY, [*TINY_BERT, f"memory.allocator={SETTING}"])
    assert child_env(recipe)[ALLOC_ENV] == SETTING
    assert child_env(load_recipe(BERT_TINY, TINY_BERT)).get(ALLOC_ENV) == os.environ.get(ALLOC_ENV)


@needs_cuda
@pytest.mark.cuda
def test_on_cuda_the_allocator_runs_with_it(tmp_path):
    """In a fresh process: the trainer sets it before CUDA starts, and the allocator's segments expand."""
    code = (f"from runner.load import load_recipe; from runner.train.loop import Trainer; import torch\n"
            f"t = Trainer(load_recipe({BERT_TINY!r}, ['memory.allocator={SETTING}', 'train.device=cuda', "
            f"'output.dir={tmp_path}']))\nt.train_step()\n"
            "print(all(s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']))")
    env = {k: v for k, v in os.environ.items() if k != ALLOC_ENV}
    out = children.run([sys.executable, "-c", code], env=env)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


# --- compile's activation memory budget -------------------------------------------------------


def test_budget_needs_compile(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "memory.activation_memory_budget=0.5", f"output.dir={tmp_path}")
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and "memory.activation_memory_budget: " in lines[0], err
    assert "needs memory.compile: true" in lines[0]


@pytest.mark.skipif(missing_budget() is not None, reason="this torch has no activation_memory_budget")
def test_budget_is_set_before_the_first_compiled_step(tmp_path):
    config = functorch_config()
    before = config.activation_memory_budget  # put back by assignment: monkeypatch's undo breaks a ConfigModule
    try:
        Trainer(load_recipe(BERT_TINY, [*TINY_BERT, "memory.compile=true", "memory.activation_memory_budget=0.3",
                                        f"output.dir={tmp_path}"]))
        assert config.activation_memory_budget == 0.3
    finally:
        config.activation_memory_budget = before


def test_the_estimate_models_the_plans_allocator_over_the_environments(monkeypatch):
    from runner.predict.cuda_extras import allocator_settings

    monkeypatch.setenv(ALLOC_ENV, "max_split_size_mb:128")
    assert allocator_settings(SETTING) == (True, [])
    assert allocator_settings(None) == (False, ["max_split_size_mb:128"])
