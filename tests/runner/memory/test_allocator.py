"""Settings applied before CUDA starts: the allocator's settings (memory.allocator, in both variables
torch reads them from, read back where torch can say what it parsed) and compile's activation memory
budget. On the CPU the allocator setting is a logged no-op."""

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
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.memory import allocator
from ckrun.runner.memory.allocator import ALLOC_ENV, ALLOC_ENVS, apply_allocator
from ckrun.runner.memory.torch_features import functorch_config, missing_budget
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.train.trainer import Trainer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SETTING = "expandable_segments:True"


@pytest.fixture(autouse=True)
def _environment_put_back():
    """apply_allocator writes both variables into os.environ: the next test must not inherit them."""
    before = {name: os.environ.get(name) for name in ALLOC_ENVS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


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
    monkeypatch.setattr(allocator, "settings_in_effect", lambda: SETTING)
    assert apply_allocator(SETTING, "cuda") and os.environ[ALLOC_ENV] == SETTING
    assert "replacing the environment's PYTORCH_CUDA_ALLOC_CONF='max_split_size_mb:64'" in caplog.records[-1].getMessage()
    assert "torch reports it in effect" in caplog.records[-1].getMessage()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not apply_allocator(SETTING, "cuda")
    assert caplog.records[-1].levelno == logging.WARNING and "already initialised" in caplog.records[-1].getMessage()


def test_both_variables_carry_it_whichever_this_torch_reads(monkeypatch):
    """torch's readers disagree on which of the two wins when both are set: the plan's goes into both."""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.6")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(allocator, "settings_in_effect", lambda: SETTING)
    assert apply_allocator(SETTING, "cuda")
    assert [os.environ[name] for name in ALLOC_ENVS] == [SETTING, SETTING]


def test_a_setting_torch_did_not_take_is_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(allocator, "settings_in_effect", lambda: "max_split_size_mb:64")
    for name in ALLOC_ENVS:
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO)
    assert not apply_allocator(SETTING, "cuda")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["memory.allocator: torch reports allocator settings 'max_split_size_mb:64' in effect, not "
                        "'expandable_segments:True' (something in this process made torch read its settings "
                        "before ckrun set them)"]


def _in_fresh_process(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ALLOC_ENVS}
    done = children.run([sys.executable, "-c", code], env={**clean, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.skipif(allocator._READ_BACK is None,
                    reason="this torch cannot report its allocator settings")
def test_this_torch_reports_the_plans_setting_over_both_environment_variables():
    """The real read-back, in a fresh process (torch parses its settings once per process): the
    environment names other settings in both variables, the plan's win; and a process that made torch
    parse them before ckrun set its own is caught."""
    code = ("import logging; from ckrun.runner.memory import allocator as a\n"
            "logging.basicConfig(level=logging.WARNING, format='%(levelname)s')\n"
            f"early = a.settings_in_effect() if {{early}} else None\n"
            f"print(a.apply_allocator({SETTING!r}, 'cuda'), a.settings_in_effect())")
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    assert _in_fresh_process(code.format(early=False), **env) == ["True", SETTING]
    assert _in_fresh_process(code.format(early=True), **env) == ["False", "max_split_size_mb:64"]


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
    from ckrun.autotune.probes.probe import child_env

    recipe = load_recipe(BERT_TINY, [*TINY_BERT, f"memory.allocator={SETTING}"])
    assert [child_env(recipe)[name] for name in ALLOC_ENVS] == [SETTING, SETTING]
    assert child_env(load_recipe(BERT_TINY, TINY_BERT)).get(ALLOC_ENV) == os.environ.get(ALLOC_ENV)


@needs_cuda
@pytest.mark.cuda
def test_on_cuda_the_allocator_runs_with_it(tmp_path):
    """In a fresh process: the trainer sets it before CUDA starts, and the allocator's segments expand."""
    code = (f"from ckrun.runner.recipe.load import load_recipe; from ckrun.runner.train.trainer import Trainer; import torch\n"
            f"t = Trainer(load_recipe({BERT_TINY!r}, ['memory.allocator={SETTING}', 'train.device=cuda', "
            f"'output.dir={tmp_path}']))\nt.train_step()\n"
            "print(all(s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']))")
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_ENVS}
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
    from ckrun.runner.predict.cuda_extras import allocator_settings

    monkeypatch.setenv(ALLOC_ENV, "max_split_size_mb:128")
    assert allocator_settings(SETTING) == (True, [])
    assert allocator_settings(None) == (False, ["max_split_size_mb:128"])
