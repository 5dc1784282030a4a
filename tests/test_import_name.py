"""ckrun owns one import name (issue 41): installed, the folders runner/, autotune/ and recipes/ are
ckrun.runner, ckrun.autotune and ckrun.recipes, and a working directory holding a user's runner.py,
autotune/ or recipes/ package changes no command. Before, those names were top-level in site-packages,
and the tuner's children, which ran with the working directory first on their path, imported the
user's runner.py instead: every `ckrun tune` there failed, blamed on the model."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib


import children
from conftest import BERT_TINY, ROOT, TINY_BERT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
SHADOW = "import sys; sys.stderr.write('the user module {} was imported\\n'); sys.exit(7)\n"


def test_every_package_installs_under_the_one_name_and_none_is_left_out():
    folders = {"ckrun." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in ("runner", "autotune", "recipes") for p in (ROOT / top).rglob("__init__.py")}
    assert set(PYPROJECT["packages"]) == folders | {"ckrun"}
    assert {name.split(".")[0] for name in PYPROJECT["packages"]} == {"ckrun"}  # the wheel's: tests/runner/recipe/test_library.py


def test_import_ckrun_gives_the_public_api_without_importing_torch():
    code = ("import sys, ckrun; assert 'torch' not in sys.modules, 'torch imported'; "
            "print(sorted(ckrun.__all__)); print(ckrun.auto_checkpoint.__module__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert done.returncode == 0, done.stderr
    names, module = done.stdout.splitlines()
    assert {"auto_checkpoint", "plan_memory", "apply_memory_plan"} <= set(eval(names))
    assert module == "ckrun.autotune.api"


def _users_folder(tmp_path):
    """A working directory as a user's project often is: its own runner.py, autotune/ and recipes/ packages,
    each of which ends any process that imports it."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "runner.py").write_text(SHADOW.format("runner.py"))
    for package in ("autotune", "recipes"):
        (folder / package).mkdir()
        (folder / package / "__init__.py").write_text(SHADOW.format(f"{package}/"))
    return folder


def _ckrun(folder, *args):
    """The installed `ckrun` script, as a user runs it, from `folder`."""
    script = os.path.join(os.path.dirname(sys.executable), "ckrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return children.run([script, *map(str, args)], cwd=folder, env=env)


def test_a_users_runner_py_and_packages_change_no_command(tmp_path):
    folder = _users_folder(tmp_path)
    for args in (["ls"], ["validate", BERT_TINY], ["show", "bert_tiny"]):
        done = _ckrun(folder, *args)
        assert done.returncode == 0 and "was imported" not in done.stderr, (args, done.stderr[-1500:])
    done = _ckrun(folder, BERT_TINY, *TINY_BERT, "train.steps=2", f"output.dir={tmp_path / 'run'}")
    assert done.returncode == 0 and "was imported" not in done.stderr, done.stderr[-1500:]
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_the_tuners_children_do_not_import_the_users_runner_py(tmp_path):
    """The probe and the model child start with the working directory first no more (python -P)."""
    folder = _users_folder(tmp_path)
    done = _ckrun(folder, "tune", BERT_TINY, *TINY_BERT, "--max-mem", "1GB", "--trials", "1", "--finalists", "0",
                  "--no-train", "--output", tmp_path / "tune")
    assert done.returncode == 0, done.stderr[-2000:]
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "tune").rglob("*.log"))
    assert "was imported" not in done.stderr + logs
    assert (tmp_path / "tune" / "tuned.yaml").is_file()
