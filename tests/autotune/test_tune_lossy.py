"""Compression in the tuner: searched only under --allow-lossy, every lossy plan carries its opt-in,
the starting points stay exact, and a lossy winner's tuned.yaml says so with its measured gradient error."""

import pytest
import yaml

from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe

from tune_helpers import report, valid_points

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")


def _space(overrides=(), **flags):
    recipe = load_recipe(BERT_TINY, TINY_BERT + list(overrides))
    return recipe, build_space(recipe, ModelFacts.from_json(model_facts(recipe)), CPU, **flags)


def test_not_searched_without_allow_lossy():
    _, space = _space()
    assert "compression" not in space.choices and "compression" not in space.fixed
    assert any("compression pinned to none: it is lossy" in reason for reason in space.reasons)


def test_allow_lossy_searches_it_and_each_lossy_plan_opts_in():
    recipe, space = _space(allow_lossy=True)
    assert space.choices["compression"][:2] == ["none", "bf16"]
    policies = set()
    for _, plan in valid_points(space, recipe):
        policies.add(plan.compression.policy)
        assert plan.allow_lossy == (plan.compression.policy != "none" or any(p.lossy for p in plan.pool_policies()))
    assert policies == set(space.choices["compression"])
    starts = [space.candidate(p).plan for p in space.starting_points(recipe)]
    assert starts and all(plan.compression.policy == "none" for plan in starts)


def test_a_lossy_winner_is_marked_with_its_gradient_error(tmp_path, monkeypatch):
    from ckrun.runner.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the recipe pins compression (with its opt-in): every plan tried is lossy, so the winner is too
    code = main(["tune", BERT_TINY, *TINY_BERT, "memory.compression={policy: bf16}", "memory.allow_lossy=true",
                 f"output.dir={tmp_path / 'run'}", "--max-mem", "1GB", "--output", str(tmp_path / "tune"),
                 "--trials", "1", "--finalists", "0", "--warmup-steps", "1", "--timed-steps", "1", "--no-train",
                 "--no-screen"])
    assert code == 0
    winner = next(t for t in report(tmp_path / "tune")["trials"] if t["state"] == "feasible")
    assert 0 < winner["gradient_error"] < 5e-2
    text = (tmp_path / "tune" / "tuned.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#  ") and "LOSSY" in line]
    assert len(header) == 1 and f"{winner['gradient_error']:.2e}" in header[0]
    memory = yaml.safe_load(text)["memory"]
    assert memory["compression"]["policy"] == "bf16" and memory["allow_lossy"] is True


def test_the_flag_reaches_the_study(tmp_path, ckrun, monkeypatch, caplog):
    """`ckrun tune --allow-lossy` searches compression (formula probes): the space says so, and the
    starting points, tried first, are exact."""
    import logging

    from tune_helpers import use_fake_child

    use_fake_child(monkeypatch)
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    code, _, err = ckrun("tune", BERT_TINY, *TINY_BERT, f"output.dir={tmp_path / 'run'}", "--max-mem", "100MB",
                         "--output", tmp_path / "tune", "--trials", "2", "--no-screen", "--no-train", "--allow-lossy")
    assert code == 0, err
    assert "compression in ['none', 'bf16'" in caplog.text
    trials = report(tmp_path / "tune")["trials"]
    assert trials and all(t["plan"]["compression"]["policy"] == "none" for t in trials[:2])


@pytest.mark.slow  # a real probe on the CPU with torchao's 8-bit AdamW: about 45 s on 2 busy cores
def test_a_lossy_optimizer_winner_is_marked_with_its_update_error(tmp_path, monkeypatch):
    """The pool knobs' lossy policies (here the recipe's own 8-bit AdamW, pinned): each probe measures
    the update's error against exact AdamW, and tuned.yaml says it."""
    pytest.importorskip("torchao")
    from ckrun.runner.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = main(["tune", BERT_TINY, *TINY_BERT, "memory.optimizer_state={policy: 8bit}", "memory.allow_lossy=true",
                 f"output.dir={tmp_path / 'run'}", "--max-mem", "1GB", "--output", str(tmp_path / "tune"),
                 "--trials", "1", "--finalists", "0", "--warmup-steps", "1", "--timed-steps", "2", "--no-train",
                 "--no-screen"])
    assert code == 0
    winner = next(t for t in report(tmp_path / "tune")["trials"] if t["state"] == "feasible")
    assert winner["plan"]["optimizer_state"]["policy"] == "8bit" and winner["update_error"] > 0
    text = (tmp_path / "tune" / "tuned.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#  ") and "LOSSY: memory.optimizer_state" in line]
    assert len(header) == 1 and f"{winner['update_error']:.2e}" in header[0]
    assert yaml.safe_load(text)["memory"]["allow_lossy"] is True
