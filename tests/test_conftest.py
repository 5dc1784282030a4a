"""The suite's hypothesis settings (tests/conftest.py): a generated test fails on what it claims,
never because a busy machine (CI's 2 cores under `-n 2`) ran one example slowly."""

from __future__ import annotations

import ast
import time

from hypothesis import given, settings, strategies as st

from conftest import ROOT


def test_a_slow_example_is_no_failure():
    @settings(max_examples=2)
    @given(st.integers())
    def slow(number):
        time.sleep(0.3)  # past hypothesis's own deadline of 200 ms

    slow()


def test_no_generated_test_sets_a_deadline_of_its_own():
    """A deadline in @settings would time each example again: speed is measured in bench/."""
    timed = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "settings":
                timed += [f"{path.relative_to(ROOT)}:{node.lineno}" for keyword in node.keywords
                          if keyword.arg == "deadline" and not (isinstance(keyword.value, ast.Constant)
                                                                and keyword.value.value is None)]
    assert not timed, timed
