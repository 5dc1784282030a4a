"""A recipe this machine cannot hold is refused in one line before its model is built (room.py): by
`ckrun validate` and by `ckrun RECIPE` alike, naming what the plan holds at least and what the machine
has. The machine's figures are stood in for (no test builds a model larger than its machine)."""

from __future__ import annotations

import pytest

from conftest import BERT_TINY, ROOT, TINY_BERT
from ckrun.runner.memory import nvml
from ckrun.runner.memory.floor import ParameterFacts, pool_floor
from ckrun.runner.builders.model import build_model
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.run import room

MIXTRAL = str(ROOT / "recipes" / "mixtral_tiny.yaml")
GB = 10**9


def _floor(args: list[str]) -> int:
    recipe = load_recipe(BERT_TINY, args)
    facts = ParameterFacts.of(build_model(recipe.model, device="meta", weights=False))
    return pool_floor(recipe.memory, facts, recipe.step_facts()).total


def _one_line_before_the_build(code: int, err: str, out_dir) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "building" not in err and not (out_dir / "metrics.jsonl").exists()
    return lines[0]


def test_mixtral_from_its_default_config_is_refused_on_a_24_gb_machine(tmp_path, ckrun, monkeypatch):
    """The issue's case: 46.7B parameters, counted on the meta device; the kernel used to kill the build."""
    monkeypatch.setattr(room, "available_host_bytes", lambda: 24 * GB)
    args = [MIXTRAL, "model.config={}", "train.device=cpu", f"output.dir={tmp_path / 'run'}"]
    line = _one_line_before_the_build(*ckrun(*args)[::2], tmp_path / "run")
    assert line == ("override 'model.config={}': model: MixtralForCausalLM cannot fit: with this plan it holds at "
                    "least 747.2 GB (parameters 186.8 GB, gradients 186.8 GB, optimizer state 373.6 GB) before any "
                    "activation, and this machine has 24.0 GB available (RAM and swap); use a smaller model "
                    "(model.config), a plan that holds less (`ckrun estimate RECIPE` shows each pool), or a GPU "
                    "(train.device: cuda) or a machine with more memory")
    code, _, err = ckrun("validate", *args)
    assert code == 2 and err.strip() == line


@pytest.mark.parametrize("plan", [[], ["precision=bf16", "memory.weights={policy: bf16}", "memory.allow_lossy=true",
                                       "memory.optimizer_state={policy: 8bit}"]], ids=["fp32", "bf16-8bit"])
def test_a_model_just_over_what_the_machine_has_is_refused_and_just_under_trains(tmp_path, ckrun, monkeypatch, plan):
    """The bound is the plan's (bf16 weights and 8-bit state hold less), and it is a lower bound: a machine
    with exactly that much is not refused."""
    args = [BERT_TINY, *TINY_BERT, *plan, "train.steps=1"]
    floor = _floor(args[1:])
    monkeypatch.setattr(room, "available_host_bytes", lambda: floor - 1)
    line = _one_line_before_the_build(*ckrun(*args, f"output.dir={tmp_path / 'over'}")[::2], tmp_path / "over")
    assert ": model: BertForMaskedLM cannot fit: with this plan it holds at least " in line
    monkeypatch.setattr(room, "available_host_bytes", lambda: floor)
    assert ckrun(*args, f"output.dir={tmp_path / 'under'}")[0] == 0


def test_on_cuda_the_card_s_free_memory_is_the_room(ckrun, monkeypatch):
    monkeypatch.setattr(nvml, "card_free_bytes", lambda index: 1000)
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "train.device=cuda")
    assert code == 2 and "model: BertForMaskedLM cannot fit" in err and "the GPU has 1.0 kB free" in err, err
    assert "a card with more memory" in err and len(err.strip().splitlines()) == 1


def test_a_cap_under_what_the_plan_holds_is_refused_before_the_build(tmp_path, ckrun):
    floor = _floor(TINY_BERT)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, f"memory.max_mem={floor - 1}", f"output.dir={tmp_path / 'run'}")
    line = _one_line_before_the_build(code, err, tmp_path / "run")
    assert "is under what this plan holds before any activation: at least " in line and "raise the cap" in line
    assert line.startswith(f"override 'memory.max_mem={floor - 1}': memory.max_mem:")


def test_where_the_machine_cannot_say_nothing_is_refused(tmp_path, ckrun, monkeypatch):
    monkeypatch.setattr(room, "available_host_bytes", lambda: None)
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={tmp_path / 'run'}")[0] == 0


def test_a_model_the_meta_device_cannot_build_is_left_to_the_build(tmp_path, ckrun, monkeypatch):
    def no_meta_build(*args, **kwargs):
        raise RuntimeError("Tensor.item() cannot be called on meta tensors")
    monkeypatch.setattr(room, "available_host_bytes", lambda: 1000)
    monkeypatch.setattr(room, "build_model", no_meta_build)
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=1", f"output.dir={tmp_path / 'run'}")[0] == 0


def test_the_host_figure_is_read_from_proc_within_the_cgroup_limit(monkeypatch):
    available = room.available_host_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024
               for line in open("/proc/meminfo").read().splitlines() if len(line.split()) > 1}
    assert 0 < available <= meminfo["MemAvailable"] + meminfo.get("SwapFree", 0) + 2**30  # read moments apart
    monkeypatch.setattr(room, "_cgroup_room", lambda: 5)
    assert room.available_host_bytes() == 5


def test_validate_leaves_a_recipe_on_any_device_to_the_machine_it_runs_on(tmp_path, ckrun, monkeypatch):
    """train.device auto: the recipe is checked, not this machine (a GPU recipe validated on a laptop);
    `ckrun RECIPE` here still refuses it before the build."""
    monkeypatch.setattr(room, "available_host_bytes", lambda: 1000)
    monkeypatch.setattr(nvml, "card_free_bytes", lambda index: 1000)
    args = [BERT_TINY, *[a for a in TINY_BERT if not a.startswith("train.device")], "train.device=auto"]
    assert ckrun("validate", *args)[0] == 0
    code, _, err = ckrun(*args, f"output.dir={tmp_path / 'run'}")
    assert "BertForMaskedLM cannot fit" in _one_line_before_the_build(code, err, tmp_path / "run")
