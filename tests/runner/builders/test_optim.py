"""Optimizers and schedules beyond adamw/sgd and constant/cosine: any torch.optim class by name with
its arguments, bitsandbytes' 8-bit AdamW when installed, and transformers' schedules. Every
mistake in them is one line at the recipe's key, found by `ckrun validate` where it can be."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import optimization

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.optim import build_optimizer, build_scheduler
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.recipe.train import TORCH_OPTIMIZERS
from ckrun.runner.train.trainer import Trainer


def test_the_named_optimizers_are_torchs_own():
    found = {name for name, value in vars(torch.optim).items()
             if inspect.isclass(value) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer}
    assert set(TORCH_OPTIMIZERS) == found - {"LBFGS", "SparseAdam"}  # closure-stepped and sparse-only: left out


def test_any_torch_optimizer_trains_with_its_arguments_and_decays_matrices_only(tmp_path, ckrun):
    spec = "train.optimizer={name: RAdam, lr: 0.003, betas: [0.8, 0.95], weight_decay: 0.1, decoupled_weight_decay: true}"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, spec, "train.scheduler={name: constant}", "train.steps=3",
                         f"output.dir={tmp_path}")
    assert code == 0, err
    assert [r["lr"] for r in read_metrics(tmp_path)] == [0.003] * 3
    optimizer = Trainer(load_recipe(BERT_TINY, [*TINY_BERT, spec, "train.steps=3"])).optimizer
    assert type(optimizer) is torch.optim.RAdam
    assert optimizer.defaults["betas"] == (0.8, 0.95) and optimizer.defaults["decoupled_weight_decay"]
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert all(p.dim() < 2 for p in optimizer.param_groups[1]["params"])


def test_an_optimizer_without_lr_takes_its_classs_default():
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "train.optimizer={name: Adagrad}", "train.steps=1"])
    optimizer = build_optimizer(torch.nn.Linear(2, 2), recipe.train, torch.device("cpu"))
    assert type(optimizer) is torch.optim.Adagrad and optimizer.defaults["lr"] == 0.01
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0, 0.0]  # its own default, on the matrix


@pytest.mark.parametrize("optimizer, line", [
    ("{name: RAdam, lr: 0.001, betas_: [0.9, 0.9]}", "train.optimizer.betas_: torch.optim.RAdam takes no argument "
                                                     "'betas_' (did you mean betas?)"),
    ("{name: Radam}", "train.optimizer: unknown name 'Radam' (did you mean RAdam?)"),
    ("{name: Adam, betas: [1.5, 0.9]}", "train.optimizer: torch.optim.Adam refuses these arguments: Invalid beta "
                                        "parameter at index 0: 1.5"),
    ("{name: adamw_8bit}", "train.optimizer.name: adamw_8bit needs the bitsandbytes package, which is not "
                           "installed: pip install bitsandbytes (or choose adamw)"),
], ids=["unknown argument", "unknown name", "refused value", "8-bit without bitsandbytes"])
def test_a_wrong_optimizer_is_one_line_at_its_key_from_validate(tmp_path, ckrun, monkeypatch, optimizer, line):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as where it is not installed
    recipe = tmp_path / "my.yaml"
    text = re.sub(r"(?m)^  optimizer: .*$", f"  optimizer: {optimizer}", Path(BERT_TINY).read_text())
    recipe.write_text(text)
    code, _, err = ckrun("validate", recipe)
    number = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("  optimizer: {"))
    assert code == 2 and err.startswith(f"{recipe}:{number}:") and line in err, err


def test_8_bit_adamw_comes_from_bitsandbytes_when_installed(tmp_path, monkeypatch):
    fake = tmp_path / "bitsandbytes"
    fake.mkdir()
    (fake / "__init__.py").write_text("from . import optim\n")
    (fake / "optim.py").write_text("import torch\nclass PagedAdamW8bit(torch.optim.AdamW):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "train.optimizer={name: paged_adamw_8bit, lr: 0.002}", "train.steps=1"])
    try:
        optimizer = build_optimizer(torch.nn.Linear(2, 2), recipe.train, torch.device("cpu"))
    finally:
        _forget_fake_bitsandbytes()
    assert type(optimizer).__module__ == "bitsandbytes.optim" and type(optimizer).__name__ == "PagedAdamW8bit"
    assert optimizer.defaults["lr"] == 0.002


def _forget_fake_bitsandbytes() -> None:
    """The fake package leaves this process: later tests in it (peft's LoRA layers ask for bitsandbytes.nn
    wherever `bitsandbytes` imports, and peft caches whether it does) must see none installed."""
    for name in [name for name in sys.modules if name == "bitsandbytes" or name.startswith("bitsandbytes.")]:
        del sys.modules[name]
    utils = sys.modules.get("peft.import_utils")
    for check in ("is_bnb_available", "is_bnb_4bit_available"):
        getattr(getattr(utils, check, None), "cache_clear", lambda: None)()


# each schedule's recipe settings, and transformers' own function with the arguments they should reach
SCHEDULES = {
    "{name: linear, warmup_steps: 2}": lambda o: optimization.get_linear_schedule_with_warmup(o, 2, 10),
    "{name: polynomial, warmup_steps: 1, power: 2.0, end_lr: 0.0001}":
        lambda o: optimization.get_polynomial_decay_schedule_with_warmup(o, 1, 10, lr_end=0.0001, power=2.0),
    "{name: cosine_with_restarts, warmup_steps: 1, cycles: 3}":
        lambda o: optimization.get_cosine_with_hard_restarts_schedule_with_warmup(o, 1, 10, num_cycles=3),
    "{name: warmup_stable_decay, warmup_steps: 2, decay_steps: 4, decay_type: linear, min_lr_ratio: 0.1}":
        lambda o: optimization.get_wsd_schedule(o, 2, 4, num_training_steps=10, decay_type="linear", min_lr_ratio=0.1),
    # cosine and constant too (issue 36 point 11: one lineage for every name), and the Trainer's warmup_ratio
    "{name: cosine, warmup_steps: 3}": lambda o: optimization.get_cosine_schedule_with_warmup(o, 3, 10),
    "{name: cosine, warmup_ratio: 0.25, min_lr_ratio: 0.1}":  # ceil(0.25 * 10) = 3 steps
        lambda o: optimization.get_cosine_with_min_lr_schedule_with_warmup(o, 3, 10, min_lr_rate=0.1),
    "{name: constant, warmup_steps: 2}": lambda o: optimization.get_constant_schedule_with_warmup(o, 2),
    "{name: constant}": lambda o: optimization.get_constant_schedule(o),
    "{name: linear, warmup_ratio: 0.1}": lambda o: optimization.get_linear_schedule_with_warmup(o, 1, 10),
}


def _rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_schedules_are_transformers_own(schedule):
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, f"train.scheduler={schedule}", "train.steps=10"])
    ours = build_scheduler(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.01), recipe.train, 10)
    theirs = SCHEDULES[schedule](torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.01))
    assert _rates(ours, 10) == _rates(theirs, 10)
    changes = len(set(_rates(build_scheduler(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.01),
                                             recipe.train, 10), 10)))
    assert changes > 2 or schedule == "{name: constant}"  # it does change the rate


def test_a_linear_schedule_runs_through_the_cli_to_zero(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.scheduler={name: linear, warmup_steps: 1}", "train.steps=5",
                         "train.optimizer.lr=0.001", f"output.dir={tmp_path}")
    assert code == 0, err
    assert [round(r["lr"], 9) for r in read_metrics(tmp_path)] == [0.0, 0.001, 0.00075, 0.0005, 0.00025]


@pytest.mark.parametrize("schedule, line", [
    ("{name: warmup_stable_decay, warmup_steps: 2, decay_steps: 10}",
     "train.scheduler.decay_steps: warm-up (2) and decay (10) steps are more than the run's 4 steps"),
    ("{name: polynomial, end_lr: 0.5}", "train.scheduler: polynomial: lr_end (0.5) must be smaller than initial lr"),
])
def test_a_schedule_that_does_not_fit_the_run_is_one_line(tmp_path, ckrun, schedule, line):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"train.scheduler={schedule}", "train.steps=4", f"output.dir={tmp_path}")
    assert code == 2 and line in err and "Traceback" not in err, err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["constant", "cosine", "linear"]), steps=st.integers(1, 50),
       warmup=st.one_of(st.integers(0, 80).map(lambda n: f"warmup_steps: {n}"),
                        st.floats(0, 1).map(lambda r: f"warmup_ratio: {r}")))
def test_a_warm_up_as_long_as_the_run_is_said_in_one_line_with_the_rate_its_last_step_takes(name, steps, warmup,
                                                                                             caplog):
    caplog.clear()
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, f"train.scheduler={{name: {name}, {warmup}}}", f"train.steps={steps}"])
    scheduler = build_scheduler(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.01), recipe.train, steps)
    said = [r.getMessage() for r in caplog.records if "is as long as the run's" in r.getMessage()]
    length = recipe.train.scheduler.warmup(steps)
    assert len(said) == (length >= steps)
    if said:
        last = _rates(scheduler, steps)[-1] / 0.01
        # the line rounds the exact share; the scheduler's rate carries float error, so a share of x.5 % may
        # round either way: the percent said is the rate's within half a percent
        percent = re.search(r"its last step takes (\d+)% of train\.optimizer\.lr", said[0])
        assert percent and abs(int(percent[1]) - 100 * last) <= 0.5 + 1e-9, (said, last)


def test_warmup_steps_and_warmup_ratio_are_one_or_the_other(ckrun):
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "train.scheduler={name: cosine, warmup_steps: 3, warmup_ratio: 0.1}")
    assert code == 2 and "train.scheduler.warmup_ratio: give train.scheduler.warmup_steps or train.scheduler.warmup_ratio, " \
                         "not both" in err, err


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "RAdam"])
def test_split_layers_beside_whole_ones_step_one_by_one(optimizer):
    """Tensor parallelism alone leaves norms and embeddings plain tensors beside the split layers' DTensors;
    no fused or foreach kernel takes both (DTensor refuses plain operands), so such an optimizer steps them
    one by one, and the step updates both kinds. Fused AdamW on the CPU stands for the GPU's fused AdamW."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    from ckrun.runner.builders.optim import optimizer_over
    from ckrun.runner.predict.per_rank import fake_process_group
    from ckrun.runner.recipe.recipe import TrainSpec

    with fake_process_group(2):
        mesh = DeviceMesh("cpu", [0, 1])
        split = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
        whole = torch.nn.Parameter(torch.ones(4, 4))  # a matrix, as an embedding is: one decay group with the split one
        train = TrainSpec.model_validate({"batch_size": 1, "steps": 1, "optimizer": {"name": optimizer, "lr": 0.1}})
        step = optimizer_over([split, whole], train, torch.device("cpu"), fused_on_cpu=True)
        split.grad, whole.grad = torch.ones_like(split), torch.ones_like(whole)
        step.step()
        assert split.to_local().lt(1).all() and whole.lt(1).all()
        assert step.defaults["foreach"] is False  # on CUDA torch's default (None) picks foreach, which fails the same way
