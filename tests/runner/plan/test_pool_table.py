"""A new kind of memory pool is one entry in one table (runner/plan/pool_policies.py's POOL_KINDS) plus its
applier: the plan's field and schema, the rules over the pools, `apply_plan`'s loop and its undo, the
resume fingerprint, the lossy error's labels and the tuner's knob, space and lower bound all derive
from it. tests/runner/plan/dummy_pool.py adds a dummy pool to the table in a fresh process and reports what
each of them made of it; the real table is held here to the lists that must match it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckrun.autotune.space.knobs import KNOBS
from ckrun.autotune.space.pool_knobs import ADDERS, SECTIONS
from ckrun.runner.memory.apply import POOL_APPLIERS
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.pool_policies import POOL_KINDS
from conftest import BERT_TINY, TINY_BERT

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def seen() -> dict:
    done = subprocess.run([sys.executable, str(HERE / "dummy_pool.py"), BERT_TINY, *TINY_BERT],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_plan_gets_the_new_pools_field_documented_and_defaulted(seen):
    assert seen["fields"][-3:] == ["dummy", "allow_lossy", "max_mem"]  # after the pools before it
    assert seen["doc"].startswith("How the dummy pool is held") and "dummy" in seen["schema"]
    assert seen["default"] == "kept" and seen["policy_fields"][-1] == "dummy"
    assert seen["read_back"] == {"policy": "squeezed", "level": 3}  # a tuner label read back into the recipe


def test_the_rules_the_fingerprint_and_the_error_labels_see_it(seen):
    assert len(seen["refused"]) == 1 and "memory.dummy: squeezed:3 changes the training" in seen["refused"][0]
    assert seen["changes"] == ["dummy squeezed:3"]
    assert seen["on_ranks"] == []  # a pool runs on ranks unless a strategy's own rules refuse it
    assert seen["fingerprints"] == ["kept", "squeezed:3"]  # a resume under another setting is refused
    assert seen["lossy_labels"] == ["memory.dummy squeezed:3"]


def test_apply_plan_applies_it_in_its_loop_and_undoes_it_also_when_a_later_part_fails(seen):
    assert seen["during"] == 2 and seen["part"] == "applied squeezed:2" and not seen["after"]
    assert seen["failed"].startswith("memory.blocks: ") and not seen["after_failure"]


def test_the_tuner_searches_it_as_the_last_knob(seen):
    assert seen["knobs"][-1] == "dummy"  # last: a resumed study's sampler draws the others as before
    assert seen["closed"] == "kept" and seen["opened"] == ["kept", "squeezed"]  # lossy: --allow-lossy opens it
    assert seen["reasons"] and seen["space_values"] == ["kept", "squeezed"]
    assert seen["written"] == {"memory": {"dummy": {"policy": "squeezed", "level": 3}, "allow_lossy": True}}
    assert seen["read"] == "squeezed:3" and seen["words"] == "dummy squeezed:3 (lossy)"
    assert seen["floor_plan"] == {"dummy": {"policy": "squeezed", "level": 1}, "allow_lossy": True}
    assert seen["tuner_lossy"] == ["squeezed"]  # what the lower bound adds when it says what would fit


def test_every_list_of_the_pools_is_the_table():
    sections = list(POOL_KINDS)
    assert [policy.section for policy in MemoryPlan().pool_policies()] == sections
    assert [name for name in MemoryPlan.model_fields if name in POOL_KINDS] == sections
    assert list(POOL_APPLIERS) == sections and list(SECTIONS) == sections and set(ADDERS) <= set(sections)
    assert [knob.name for knob in KNOBS][-len(sections):] == sections
    for section, kind in POOL_KINDS.items():
        assert all(cls.section == section for cls in kind) and not kind[0].active  # the default changes nothing
