"""The command line itself: verbs loaded on demand, mistyped verbs named, usage errors in one line."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import children
from hypothesis import given, settings
from hypothesis import strategies as st

import ckrun.runner.cli
from ckrun.runner.cli import VERBS, main
from ckrun.runner.recipe.library import library_recipes

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("optuna", "transformers")


def python(*args: str, path: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *path, os.environ.get("PYTHONPATH", "")])}
    return children.run([sys.executable, *args], cwd=ROOT, env=env)


def imported_modules(*args: str, path: tuple[str, ...] = ()) -> set[str]:
    """Every module `python -m ckrun ARGS` imports by an import statement, from `python -X importtime`."""
    done = python("-X", "importtime", "-m", "ckrun", *args, path=path)
    # lines look like "import time:       123 |        456 |     package.module" (nesting by indent)
    names = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "ckrun.runner.cli" in names, done.stderr[-2000:]  # the parse found the CLI, so an absence below is real
    return names


def verbs_loaded(*args: str) -> set[str]:
    """The verb modules in sys.modules after `ckrun ARGS` (importlib.import_module escapes -X importtime)."""
    code = (f"import sys\nfrom ckrun.runner.cli import main\ntry:\n    main({list(args)!r})\nexcept SystemExit:\n    pass\n"
            "print('MODULES', *sys.modules)")
    done = python("-c", code)
    loaded = set(done.stdout.rpartition("MODULES ")[2].split())
    assert "ckrun.runner.cli" in loaded, done.stderr[-2000:]
    return {module for module, _ in VERBS.values()} & loaded


def heavy(names: set[str], *packages: str) -> list[str]:
    return sorted(n for n in names if n.split(".")[0] in packages)


def test_help_imports_neither_optuna_nor_transformers():
    assert heavy(imported_modules("--help"), *HEAVY, "torch") == []
    assert verbs_loaded("--help") == set()  # not even the verbs' own modules
    assert verbs_loaded("validate", "--help") == {"ckrun.runner.cli.validate"}


def test_validate_imports_only_what_its_recipe_needs(tmp_path):
    # a model of the user's own: validating it imports the factory's module, and nothing heavy besides
    # (it imports colorsys, which nothing else does: import_module itself escapes -X importtime);
    # the sinks' packages are looked for, not imported
    (tmp_path / "own_models.py").write_text("import colorsys\n\n\ndef small():\n    pass\n")
    recipe = tmp_path / "own.yaml"
    recipe.write_text("model: {source: python, name: 'own_models:small'}\ntrain: {batch_size: 2, steps: 1}\n"
                      "output: {sinks: [tensorboard, wandb, mlflow]}\n")
    names = imported_modules("validate", str(recipe), path=(str(tmp_path),))
    assert "colorsys" in names and "pydantic" in names  # the recipe was really checked
    assert heavy(names, *HEAVY, "torch", "tensorboard", "wandb", "mlflow", "sqlalchemy", "alembic") == []


def test_the_verb_table_matches_every_verb_module():
    modules = {f"ckrun.runner.cli.{m.name}" for m in pkgutil.iter_modules(ckrun.runner.cli.__path__) if m.name != "__main__"}
    plugins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["ckrun.commands"]
    assert modules | {value.split(":")[0] for value in plugins.values()} == {module for module, _ in VERBS.values()}
    for name, (module, help_line) in VERBS.items():
        command = importlib.import_module(module).COMMAND
        assert (command.name, command.help) == (name, help_line), f"{module}: its COMMAND and the table disagree"
    for name, value in plugins.items():
        assert VERBS[name][0] == value.split(":")[0], f"pyproject's {name} entry point names another module"


def call(*args: str) -> tuple[int, str, str]:
    """main() in this process (hypothesis cannot take pytest's capsys, a per-test fixture)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def is_taken(word: str) -> bool:
    return word in VERBS or word in library_recipes() or Path(word).exists()


LETTERS = "abcdefghijklmnopqrstuvwxyz"


@st.composite
def slips(draw, kinds=("swap", "drop", "change", "add")) -> tuple[str, str, str]:
    """(verb, kind, the verb with one slip of the finger) for verbs long enough to still be recognisable."""
    verb = draw(st.sampled_from([v for v in VERBS if len(v) >= 4]))
    kind, at = draw(st.sampled_from(kinds)), draw(st.integers(0, len(verb) - 2))
    letter = draw(st.sampled_from(LETTERS))
    typo = {"swap": verb[:at] + verb[at + 1] + verb[at] + verb[at + 2:], "drop": verb[:at] + verb[at + 1:],
            "change": verb[:at] + letter + verb[at + 1:], "add": verb[:at] + letter + verb[at:]}[kind]
    return verb, kind, typo


@settings(max_examples=60, deadline=None)
@given(slips())
def test_a_mistyped_verb_is_named_as_one(slip):
    verb, kind, typo = slip
    if is_taken(typo):
        return
    code, out, err = call(typo, "recipes/bert_tiny.yaml")
    meant = re.fullmatch(rf"ckrun: unknown verb '{typo}' \(did you mean (\w+)\?\)\n", err)
    assert code == 2 and meant and out == "", err
    if kind in ("swap", "drop"):  # a changed or added letter may land nearer another verb; these cannot
        assert meant[1] == verb


@settings(max_examples=20, deadline=None)
@given(slips(("swap", "drop")))
def test_a_file_that_looks_like_a_mistyped_verb_is_still_a_recipe(slip):
    _, _, typo = slip
    with contextlib.chdir(Path(os.environ.get("TMPDIR", "/tmp"))), _scratch_file(typo):
        code, _, err = call("validate", typo)  # the verb is given: the file's text is what fails
        assert "unknown verb" not in err
        code, _, err = call(typo)
        assert code == 2 and "unknown verb" not in err and err.count("\n") == 1, err


@contextlib.contextmanager
def _scratch_file(name: str):
    path = Path(name)
    if path.exists():
        yield path
        return
    path.write_text("not: [a recipe\n")
    try:
        yield path
    finally:
        path.unlink()


@pytest.mark.parametrize("name", sorted(library_recipes()))
def test_library_names_are_recipes_not_verbs(name):
    assert ckrun.runner.cli._verb_and_argv([name], {}) == ("run", ["run", name])


def test_a_recipe_typo_nearer_a_library_name_than_a_verb_lists_the_recipes():
    code, _, err = call("bert")  # 0.6 like `report`, nearer to bert_base
    assert code == 2 and "no such recipe file or library recipe (did you mean bert_base" in err


# a complete command line for every verb, so that the flag added below is its only fault
COMPLETE = {"run": ["bert_tiny"], "validate": ["bert_tiny"], "show": ["bert_tiny"], "estimate": ["bert_tiny"],
            "tune": ["bert_tiny", "--max-mem", "1GB"], "report": ["runs/t"], "ls": [], "cp": ["gpt2", "my.yaml"],
            "schema": [], "tokenizer": ["corpus/*.txt", "--out", "tok"]}


def test_every_verb_has_a_complete_command_line():
    assert set(COMPLETE) == set(VERBS)


@settings(max_examples=30, deadline=None)
@given(verb=st.sampled_from(sorted(VERBS)), flag=st.text(LETTERS + "-", min_size=1, max_size=12))
def test_an_unknown_flag_is_one_line_naming_the_verb(verb, flag):
    code, out, err = call(verb, *COMPLETE.get(verb, []), f"--zz{flag}")
    assert code == 2 and out == "" and "usage:" not in err and err.count("\n") == 1, err
    assert err.startswith(f"ckrun {verb}: unrecognized arguments: --zz{flag}; see `ckrun {verb} --help`")


@pytest.mark.parametrize(("args", "missing"), [
    (["validate"], "the following arguments are required: recipe;"),
    (["cp", "gpt2"], "the following arguments are required: dest;"),
    (["tune", "bert_tiny"], "the following arguments are required: --max-mem;"),
    (["estimate", "bert_tiny", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["ls", "--json", "--json=1"], "ignored explicit argument '1'"),
])
def test_a_missing_or_bad_argument_is_one_line(args, missing):
    code, out, err = call(*args)
    assert code == 2 and out == "" and err.count("\n") == 1 and missing in err, err


def test_help_is_still_argparse_help(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: ckrun")
    for name, (_, help_line) in VERBS.items():
        assert name in out and help_line.split()[0] in out
    with pytest.raises(SystemExit) as done:
        main(["tune", "--help"])
    assert done.value.code == 0 and "--max-mem SIZE" in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["estimate", "tune"])
def test_gpu_help_names_every_gpu_of_the_device_table(capsys, verb):
    """The --gpu help is read from runner/predict/hardware.py's table, in both verbs that take it."""
    from ckrun.runner.predict.hardware import known_names

    with pytest.raises(SystemExit):
        main([verb, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at any space
    shown = out.rsplit("--gpu NAME", 1)[1].split(" --", 1)[0]  # the option, not the usage line
    assert all(f"{name}," in shown or f"{name})" in shown for name in known_names() if name != "cpu"), shown


@pytest.mark.parametrize("verb", [["validate"], ["show"], ["estimate"], ["estimate", "--gpu", "h100"], []])
def test_a_typo_is_said_before_torch_or_transformers_are_imported(verb, ckrun):
    """A recipe's mistake costs no torch import (4-13 s on a busy machine): the verbs that read a recipe say it first
    (with the model's check kept from an earlier pass: tests/runner/builders/test_check_cache.py)."""
    assert ckrun("validate", "bert_tiny")[0] == 0  # the pass kept in this test's user cache, which the child reads
    code = ("import sys\nfrom ckrun.runner.cli import main\n"
            f"status = main([*{verb!r}, 'bert_tiny', 'train.stepz=3'])\n"
            "print(status, sorted(m for m in ('torch', 'transformers', 'torch.distributed') if m in sys.modules))")
    done = children.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.splitlines()[-1] == "2 []", done.stderr[-2000:]
    assert "train.stepz: unknown key (did you mean steps?)" in done.stderr
