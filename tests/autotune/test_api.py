"""The Python API (autotune/api.py): docs/own_loop.md's two loops and its calls, and the README's, run as written, a plan keeps a real loop under
its cap, `remove()` gives the model back exactly, and every bad input is one MemoryPlanError line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

from ckrun.autotune.api import MemoryPlanError, PlannedMemory, apply_memory_plan, auto_checkpoint, plan_memory
from conftest import BERT_TINY, TINY_BERT
from tune_helpers import report, use_fake_child
from ckrun.runner.memory.tracker import LiveBytesTracker
from ckrun.runner.plan.memory_plan import MemoryPlan

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "own_loop.md").read_text()
SECTION = PAGE.split("## Your own training loop", 1)[1].split("\n## ", 1)[0]
PLAIN_LOOP, TRAINER_LOOP = re.findall(r"```python\n(.*?)```", SECTION, re.S)
(CALLS,) = re.findall(r"```python\n(.*?)```", PAGE.split("## ckrun's commands as calls", 1)[1], re.S)
README_SECTION = (ROOT / "README.md").read_text().split("## In Python", 1)[1].split("\n## ", 1)[0]
(README_CALLS,) = re.findall(r"```python\n(.*?)```", README_SECTION, re.S)


def _readme_model():
    """The plain loop's model, optimizer and batch, as docs/own_loop.md makes them (the block up to its plan)."""
    namespace: dict = {}
    exec(compile(PLAIN_LOOP.split("applied = auto_checkpoint")[0], "own_loop.md", "exec"), namespace)
    return namespace["model"], namespace["optimizer"], namespace["x"], namespace["y"]


def _loop_peak(model, optimizer, x, y, steps: int = 2) -> int:
    """The most live tensor bytes of the page's loop (the tracker `ckrun` measures CPU runs with)."""
    tracker = LiveBytesTracker("cpu").track(model, optimizer, [x, y])
    try:
        for _ in range(steps):
            with tracker:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    finally:
        tracker.close()
    return tracker.peak_bytes


def test_the_plain_loop_runs_as_written(caplog):
    caplog.set_level("INFO", logger="ckrun.autotune")
    namespace: dict = {}
    exec(compile(PLAIN_LOOP, "own_loop.md", "exec"), namespace)
    planned = namespace["applied"].planned
    assert planned.plan.checkpointing.recomputes and not planned.measured
    assert "memory plan applied: checkpointing " in caplog.text
    assert not any("forward" in vars(m) for m in namespace["model"].modules())  # removed at the end


def test_a_predicted_plan_keeps_the_loop_under_its_cap_and_no_plan_would_not():
    model, optimizer, x, y = _readme_model()
    without = _loop_peak(model, optimizer, x, y)
    with auto_checkpoint(model, (x, y), memory_budget="7MB", optimizer=optimizer) as applied:
        with_plan = _loop_peak(model, optimizer, x, y)
    # the estimate of this very loop, but for a few scalars of ckrun's own step (its loss sum, clipping)
    assert 0 <= applied.planned.peak_bytes - with_plan <= 1024
    assert with_plan <= 7e6 * 0.95 < without


def test_the_trainer_loop_runs_as_written(tmp_path, monkeypatch, caplog):
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")
    caplog.set_level("INFO", logger="ckrun.autotune")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(TRAINER_LOOP, "own_loop.md", "exec"), namespace)
    assert "memory plan applied: checkpointing full" in caplog.text
    assert not any("forward" in vars(m) for m in namespace["model"].modules())


# --- undo: the model as it was --------------------------------------------------------------------


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1))


def _state(model: nn.Module) -> list:
    """Everything a plan may touch: each module's own attributes and hook tables, and the configs."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return [(name, sorted(vars(m)), [len(getattr(m, h)) for h in hooks], getattr(getattr(m, "config", None), "use_cache", None))
            for name, m in model.named_modules()]


def _forward_backward(model: nn.Module, ids: torch.Tensor):
    torch.manual_seed(3)  # the same dropout masks
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


checkpointings = st.one_of(st.just({"policy": "full"}), st.just({"policy": "selective"}), st.just({"policy": "sqrt"}),
                           st.builds(lambda k: {"policy": "every", "every": k}, st.integers(1, 3)),
                           st.builds(lambda ls: {"policy": "layers", "layers": sorted(ls)},
                                     st.sets(st.integers(0, 2), min_size=1)))


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(checkpointing=checkpointings)
def test_remove_gives_the_model_back_exactly(checkpointing):
    model = _bert()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    before, state = _forward_backward(model, ids), _state(model)
    plan = MemoryPlan.model_validate({"checkpointing": checkpointing})
    applied = apply_memory_plan(model, PlannedMemory(plan, 0, 1, False, "given"))
    assert _state(model) != state  # the plan is on the model
    applied.remove()
    assert _state(model) == state
    after = _forward_backward(model, ids)
    assert torch.equal(before[0], after[0]) and all(torch.equal(before[1][k], after[1][k]) for k in before[1])


# --- one line for every bad input -----------------------------------------------------------------


def _one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and text, text
    return text


junk = st.recursive(st.none() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=6)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(batch=junk.filter(lambda b: b is not None))  # None: "give a model and an example batch"
def test_a_batch_of_another_kind_is_one_line(batch):
    model, *_ = _readme_model()
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(model, batch, max_mem="1GB")
    assert _one_line(err).startswith("batch: ")


@pytest.mark.parametrize("call,says", [
    (lambda m, b: plan_memory(m, b, max_mem="8 gigs"), "max_mem: '8 gigs' is not a size"),
    (lambda m, b: plan_memory(m, b, max_mem="1GB", margin=0.7), "margin: a fraction of the cap"),
    (lambda m, b: plan_memory(m, b, max_mem="1GB", device="tpu"), "device 'tpu': ckrun plans for cpu or cuda"),
    (lambda m, b: plan_memory("model", b, max_mem="1GB"), "model is a str, not a torch.nn.Module"),
    (lambda m, b: plan_memory(m, b, max_mem="1GB", measure=True), "measure=True needs a recipe"),
    (lambda m, b: plan_memory(m, b, max_mem="1GB", optimizer=3), "optimizer is a int"),
    (lambda m, b: plan_memory(m, b, max_mem="1GB", optimizer="Adamm"), "Adamm"),
    (lambda m, b: plan_memory(m, (b[0][:, :32], b[1]), max_mem="1GB"), "cannot predict this model's memory"),
    (lambda m, b: plan_memory(m, b, max_mem="1MB"), "nothing fits within 950.0 kB (1.0 MB cap minus 5% margin): "
                                                     "even recomputing every block is predicted at"),
    (lambda m, b: plan_memory(nn.Linear(64, 10), b, max_mem="10kB"), "found no repeated blocks in Linear"),
    (lambda m, b: plan_memory(m, b, max_mem="1MB", blocks="blockz"), "has no module 'blockz' (did you mean blocks?)"),
])
def test_bad_input_is_one_memory_plan_error_line(call, says):
    model, _, x, y = _readme_model()
    with pytest.raises(MemoryPlanError) as err:
        call(model, (x, y))
    assert says in _one_line(err)


def test_a_model_carries_one_plan_at_a_time():
    model, optimizer, x, y = _readme_model()
    with auto_checkpoint(model, (x, y), memory_budget="7MB", optimizer=optimizer) as applied:
        with pytest.raises(MemoryPlanError, match="already carries a ckrun plan; remove"):
            apply_memory_plan(model, applied.planned)
        with pytest.raises(MemoryPlanError, match="already carries a ckrun plan; remove"):
            plan_memory(model, (x, y), max_mem="7MB")
    apply_memory_plan(model, applied.planned).remove()  # once removed, it takes another


# --- a recipe instead of a model: predicted, or measured by `ckrun tune` -------------------------------


def test_a_recipe_gets_the_plan_the_tuner_would_start_from(tmp_path):
    planned = plan_memory(recipe=BERT_TINY, overrides=TINY_BERT, max_mem="2MB")
    assert planned.plan.checkpointing.recomputes and planned.peak_bytes <= 0.95 * 2e6
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(recipe=BERT_TINY, overrides=["train.steps=0", "train.batch_size=-1"], max_mem="2MB")
    assert "train.batch_size" in _one_line(err) and "train.steps" in str(err.value)


def test_a_measured_plan_comes_from_ckrun_tune(tmp_path):
    planned = plan_memory(recipe=BERT_TINY, overrides=[*TINY_BERT, f"output.dir={tmp_path / 'run'}"], max_mem="1GB",
                          measure=True, output=tmp_path / "tune",
                          tune_options={"trials": 1, "finalists": 0, "no_solver": True, "timed_steps": 1})
    assert planned.measured and planned.peak_bytes > 0 and (tmp_path / "tune" / "tuned.yaml").is_file()
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(recipe=BERT_TINY, overrides=TINY_BERT, max_mem="1GB", measure=True, tune_options={"trialz": 1})
    assert _one_line(err).startswith("tune_options: tune() got unexpected keyword(s) trialz;")


# --- `ckrun tune` as a call ------------------------------------------------------------------------------


def test_tune_returns_the_winner_the_tuned_recipe_and_its_training_and_prints_nothing(tmp_path, monkeypatch, capfd):
    import ckrun
    from ckrun.runner.recipe.load import load_recipe

    use_fake_child(monkeypatch)
    result = ckrun.tune(BERT_TINY, [*TINY_BERT, "train.steps=2", f"output.dir={tmp_path / 'run'}"], max_mem="1GB",
                        output=tmp_path / "tune", trials=2, finalists=0, no_screen=True, no_solver=True)
    assert capfd.readouterr().out == ""  # the table and the winner's line are `ckrun tune`'s to print
    assert isinstance(result, ckrun.TuneResult) and result.directory == tmp_path / "tune"
    assert result.winner.number == report(result.directory)["winner"] and result.winner.state == "feasible"
    assert result.tuned_path == result.directory / "tuned.yaml"
    assert load_recipe(result.tuned_path) == result.recipe
    assert result.recipe.memory.model_copy(update={"max_mem": None}) == MemoryPlan.model_validate(result.winner.plan)
    assert "Pareto front" in result.found.table or "1 trials" in result.found.table
    trained = result.trained
    assert isinstance(trained, ckrun.RunResult) and trained.output_dir == tmp_path / "run"
    assert trained.steps_done == 2 and len(trained.losses) == 2 and not trained.stopped_by


def test_tune_refuses_in_the_flags_words_and_takes_only_the_flags(tmp_path):
    import ckrun

    with pytest.raises(ckrun.CkrunError) as err:
        ckrun.tune(BERT_TINY, TINY_BERT, max_mem="lots", output=tmp_path)
    assert err.value.lines() == ["--max-mem: 'lots' is not a size; write it like 40GB, 40GiB, 512MB or a number of bytes"]
    with pytest.raises(ckrun.CkrunError) as err:
        ckrun.tune(BERT_TINY, TINY_BERT, max_mem="1GB", trials=0, output=tmp_path)
    assert err.value.lines() == ["--trials: at least 1 plan must be measured but got 0"]
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) trialz; .*search_precision"):
        ckrun.tune(BERT_TINY, max_mem="1GB", trialz=3)


def test_the_pages_calls_run_as_written_and_print_only_what_they_print(tmp_path, monkeypatch, capfd):
    """docs/own_loop.md's block on my.yaml, a tiny BERT; the probes measure the fake child's formula."""
    import yaml

    from ckrun.runner.recipe.load import load_recipe

    _quick_probes(monkeypatch)
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "output.dir=runs/my"]).model_dump(mode="json", exclude_none=True)
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(recipe))
    namespace: dict = {}
    exec(compile(CALLS, "own_loop.md", "exec"), namespace)
    printed = capfd.readouterr().out.splitlines()
    tuned, run = namespace["tuned"], namespace["run"]
    assert len(printed) == 4 and printed[0].startswith(tuned.winner.label)  # the block's prints, nothing else
    assert tuned.trained.steps_done == 20 and run.resumed_at == 20 and run.steps_done == 30
    assert run.output_dir == Path("runs/my") and tuned.directory == Path("runs/my/tune")


def test_the_readmes_calls_run_as_written(tmp_path, monkeypatch, capfd):
    """The README's block, on a tiny BERT (the calls get TINY_BERT's overrides on top of the README's)."""
    import ckrun

    tune = _quick_probes(monkeypatch)
    monkeypatch.chdir(tmp_path)
    train = ckrun.train
    monkeypatch.setattr(ckrun, "train", lambda recipe, overrides, **kw: train(recipe, [*TINY_BERT, *overrides], **kw))
    monkeypatch.setattr(ckrun, "tune", lambda recipe, overrides, **kw: tune(recipe, [*TINY_BERT, *overrides], **kw))
    namespace: dict = {}
    exec(compile(README_CALLS, "README.md", "exec"), namespace)
    assert len(capfd.readouterr().out.splitlines()) == 2
    assert namespace["run"].steps_done == 20 and namespace["tuned"].tuned_path == Path("runs/first/tune/tuned.yaml")


def _quick_probes(monkeypatch):
    """ckrun.tune as the pages call it, its probes the fake child's formula and neither the solver's
    timed blocks nor predictions (which would screen that formula's plans by the real estimate)."""
    import ckrun

    use_fake_child(monkeypatch)
    tune = ckrun.tune
    monkeypatch.setattr(ckrun, "tune", lambda *args, **kw: tune(*args, **kw, no_solver=True, no_screen=True))
    return ckrun.tune


def test_a_batch_without_labels_is_planned_from_the_models_own_output():
    """A batch of inputs alone (a tensor, no labels): the stand-in labels take their shape from a fake forward
    of the model, which ran without the plan its device behaviour needs (a TypeError before any plan)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    planned = plan_memory(model, torch.randn(8, 16), max_mem="1GB")
    assert isinstance(planned, PlannedMemory) and 0 < planned.peak_bytes <= 10**9 and not planned.measured
