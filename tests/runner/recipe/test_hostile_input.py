"""Any input at all ends `ckrun validate` in OK (exit 0) or one line per problem (exit 2), quickly.

Generated, not listed: every key of every bundled recipe set to every YAML type and to boundary
values, random bytes and YAML-like text as files, random `key=value` overrides. Each run goes
through the real CLI (`ckrun.runner.cli.main`, in-process for speed; a few real subprocesses too), under
a time limit, and must print no traceback and only problem lines.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import children
from conftest import BERT_TINY, ROOT, time_limit
from ckrun.runner.cli import main

RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
# a call's work in CPU seconds (the largest recipe's validate takes 5), which no load on the machine stretches;
# wall-clock time only bounds a hang: a 30 s wall bound was within reach of a busy machine (10 s at load 3)
SECONDS_PER_CALL = 30
HANG_S = 600  # a bomb or a hang would take hours

# one value of every YAML type, and the boundaries that numbers and strings break at
EVERY_TYPE = [None, True, -1, 1.5, math.nan, math.inf, "x", [1, "a"], {"a": 1}]
BOUNDARIES = [False, 0, 2**31, 2**63, -(2**63) - 1, 10**30, 1e300, -math.inf, 5e-324, -0.0, "", "\x00",
              "a" * 10_000, [], {}, [[[[[]]]]], list(range(200))]
yaml_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
)
yaml_values = st.recursive(yaml_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


def key_paths(data, prefix=()) -> list[tuple]:
    """Every key (sections too) and list item of a parsed recipe."""
    found = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else []
    for key, value in items:
        found.append(prefix + (key,))
        found += key_paths(value, prefix + (key,))
    return found


def with_value(data, path, value):
    """A copy of `data` with `path` set to `value`."""
    data = copy.deepcopy(data)
    target = data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return data


# libyaml where it is built in: the test's own YAML work should not cost more than ckrun's
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
FAST_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def parsed(recipe: Path) -> dict:
    return yaml.load(recipe.read_text(), Loader=FAST_LOADER)


def validate(capsys, recipe: Path | str, *overrides: str) -> tuple[int, str]:
    """`ckrun validate` in this process; asserts the contract and returns (exit code, stderr)."""
    capsys.readouterr()
    started = time.process_time()
    with time_limit(HANG_S, "one ckrun call"):
        code = main(["validate", str(recipe), *overrides])
    out, err = capsys.readouterr()
    assert_contract(code, out, err, str(recipe), time.process_time() - started)
    return code, err


def assert_contract(code: int, out: str, err: str, recipe: str, seconds: float) -> None:
    assert code in (0, 2), (code, err)
    assert "Traceback" not in err, err
    if code == 0:
        assert err == "" and out.strip().endswith("OK"), (out, err)
        return
    lines = err.splitlines()
    assert out == "" and lines, err
    for line in lines:  # each problem is one line that says where: the file, or the override
        assert line.startswith((f"{recipe}:", f"{recipe} ", "override '", 'override "')), line
    assert seconds < SECONDS_PER_CALL


def write(tmp_path: Path, data) -> Path:
    recipe = tmp_path / "mutated.yaml"
    recipe.write_text(yaml.dump(data, Dumper=FAST_DUMPER, allow_unicode=False))
    return recipe


# --- every key to every type ------------------------------------------------------------------


def sweep(recipe: Path, tmp_path: Path, capsys, values) -> None:
    data = parsed(recipe)
    for path in key_paths(data):
        for value in values:
            validate(capsys, write(tmp_path, with_value(data, path, value)))


def test_every_key_of_the_quickest_recipe_to_every_yaml_type(tmp_path, capsys):
    sweep(Path(BERT_TINY), tmp_path, capsys, EVERY_TYPE)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_key_of_every_recipe_to_every_yaml_type_and_boundary(recipe, tmp_path, capsys):
    sweep(recipe, tmp_path, capsys, EVERY_TYPE + BOUNDARIES)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_key_of_any_recipe_set_to_anything(data, tmp_path, capsys):
    recipe = data.draw(st.sampled_from(RECIPES), label="recipe")
    document = parsed(recipe)
    path = data.draw(st.sampled_from(key_paths(document)), label="key")
    value = data.draw(st.sampled_from(EVERY_TYPE + BOUNDARIES) | yaml_values, label="value")
    validate(capsys, write(tmp_path, with_value(document, path, value)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_unknown_keys_anywhere(data, tmp_path, capsys):
    recipe = data.draw(st.sampled_from(RECIPES), label="recipe")
    document = parsed(recipe)
    sections = [()] + [p for p in key_paths(document) if isinstance(_at(document, p), dict)]
    section = data.draw(st.sampled_from(sections), label="section")
    key = data.draw(st.text(min_size=1, max_size=12), label="new key")
    target = _at(document, section)
    if key in target:
        return
    target[key] = data.draw(yaml_values, label="value")
    code, _ = validate(capsys, write(tmp_path, document))
    assert code == 2 or section[:2] == ("model", "config")  # a factory's arguments are open-ended


def _at(data, path):
    for part in path:
        data = data[part]
    return data


# --- garbage files ----------------------------------------------------------------------------

YAML_PUNCTUATION = ":-[]{}&*!|>'\"#%@`,?.\\ \t\n0123456789aex<=~"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.binary(max_size=400) | st.text(YAML_PUNCTUATION, max_size=200).map(str.encode)
       | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_random_files(content, tmp_path, capsys):
    recipe = tmp_path / "random.yaml"
    recipe.write_bytes(content)
    assert validate(capsys, recipe)[0] == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_valid_recipe_with_garbage_spliced_in(data, tmp_path, capsys):
    text = Path(BERT_TINY).read_bytes()
    at = data.draw(st.integers(0, len(text)), label="at")
    cut = data.draw(st.integers(0, 20), label="cut")
    junk = data.draw(st.binary(max_size=20) | st.text(YAML_PUNCTUATION, max_size=20).map(str.encode), label="junk")
    recipe = tmp_path / "spliced.yaml"
    recipe.write_bytes(text[:at] + junk + text[at + cut:])
    validate(capsys, recipe)


# --- random overrides -------------------------------------------------------------------------

TINY_KEYS = [".".join(map(str, p)) for p in key_paths(parsed(Path(BERT_TINY)))]
override_keys = st.sampled_from(TINY_KEYS) | st.text(min_size=1, max_size=15)
override_values = st.text(max_size=30) | yaml_values.map(
    lambda v: yaml.dump(v, Dumper=FAST_DUMPER, default_flow_style=True, width=1 << 20).removesuffix("\n...\n").strip())
override = st.tuples(override_keys, st.sampled_from(["=", "", "=="]), override_values).map("".join).filter(
    lambda o: not o.startswith("-"))  # a leading dash is an option: argparse's usage errors, another contract


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.lists(override, min_size=1, max_size=3))
def test_random_overrides(overrides, capsys):
    validate(capsys, BERT_TINY, *overrides)


# --- through a real process -------------------------------------------------------------------


def alias_bomb(levels: int) -> str:
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("content, overrides, expected", [
    (alias_bomb(14).encode(), [], "values with aliases expanded"),
    (Path(BERT_TINY).read_bytes(), ["train.steps=3\x1b[2J", "output.dir=runs/\x00"], "control character U+001B"),
], ids=["alias bomb", "escape sequences in overrides"])
def test_hostile_input_through_a_real_process(tmp_path, content, overrides, expected):
    recipe = tmp_path / "hostile.yaml"
    recipe.write_bytes(content)
    overrides = [o.replace("\x00", "\x01") for o in overrides]  # a real argv cannot hold NUL
    done = children.run([sys.executable, "-m", "ckrun", "validate", str(recipe), *overrides])
    assert_contract(done.returncode, done.stdout, done.stderr, str(recipe), 0)
    assert done.returncode == 2 and expected in done.stderr
    assert len(done.stderr.splitlines()) == max(1, len(overrides))
