"""`model.source: python` finds the user's module beside the recipe or in the working directory,
without PYTHONPATH, as `python script.py` finds a module beside the script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import children
from conftest import ROOT

RECIPE = """model: {source: python, name: 'beside_models:tied_lm', config: {vocab_size: 64, width: 16}}
data: {source: synthetic, task: causal_lm, seq_len: 16}
train: {batch_size: 4, steps: 2, device: cpu}
"""


def ckrun_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter that, like the `ckrun` script, searches neither cwd nor a script's folder (-P)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # ckrun itself only: not the user's folders
    return children.run([sys.executable, "-P", "-m", "ckrun", *args], cwd=cwd, env=env)


@pytest.mark.parametrize("module_in", ["the recipe's folder", "the working directory"])
def test_a_users_module_is_found_without_pythonpath(tmp_path, module_in):
    recipes, elsewhere = tmp_path / "recipes", tmp_path / "elsewhere"
    recipes.mkdir(), elsewhere.mkdir()
    (recipes / "my.yaml").write_text(RECIPE + f"output: {{dir: {tmp_path / 'run'}}}\n")
    beside = recipes if module_in == "the recipe's folder" else elsewhere
    shutil.copy(ROOT / "tests" / "user_models.py", beside / "beside_models.py")
    done = ckrun_in(elsewhere, str(recipes / "my.yaml"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_a_module_found_nowhere_says_where_ckrun_looked(tmp_path):
    (tmp_path / "my.yaml").write_text(RECIPE)
    done = ckrun_in(tmp_path, "validate", str(tmp_path / "my.yaml"))
    assert done.returncode == 2
    [line] = done.stderr.splitlines()
    assert "model.name: cannot import 'beside_models': ModuleNotFoundError" in line, line
    assert f"the recipe's folder and the working directory ({tmp_path.resolve()})" in line, line
