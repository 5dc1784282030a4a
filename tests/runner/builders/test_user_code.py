"""User code that exits, crashes, hangs or leaves threads, through the CLI: never a silent end.

Every fault is one line and a non-zero status (status 0 only when it trained): at import (tried
in a fork first), in the factory and in the forward; exit codes 0 and not 0. The faults that end or
block a whole process (a hang in the factory, a stray thread) run ckrun in a subprocess.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import children

ROOT = Path(__file__).resolve().parents[3]
RECIPE = """model: {{source: python, name: "{module}:build"}}
data: {{source: synthetic, image_size: 4, task: image_classification, num_classes: 3}}
train: {{batch_size: 2, steps: 1, device: cpu}}
output: {{dir: {out}}}
"""
FAULTS = {
    "sys_exit": "sys.exit({code})",
    "os_exit": "os._exit({code})",
    "raise": "raise RuntimeError('boom')",
    "segfault": "ctypes.string_at(0)",  # reads address 0: SIGSEGV
    "hang": "while True: pass",
    "thread": "threading.Thread(target=time.sleep, args=(3600,), name='poller').start()",
}
_names = itertools.count()


def _model_module(folder: Path, place: str, fault: str, code: int = 0) -> str:
    """A module `mN` whose import, factory or forward runs `fault`; its name is new to this process."""
    name = f"fault_model_{os.getpid()}_{next(_names)}"
    statement = FAULTS[fault].format(code=code)
    at = {where: statement if where == place else "pass" for where in ("import", "factory", "forward")}
    (folder / f"{name}.py").write_text(textwrap.dedent(f"""
        import ctypes, os, sys, threading, time
        import torch
        {at["import"]}

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(48, 3)

            def forward(self, images):
                {at["forward"]}
                return self.lin(images.flatten(1))

        def build():
            {at["factory"]}
            return Net()
    """))
    return name


def _recipe(folder: Path, module: str) -> Path:
    path = folder / f"{module}.yaml"
    path.write_text(RECIPE.format(module=module, out=folder / f"run-{module}"))
    return path


def _expected(place: str, fault: str, code: int) -> str:
    if place == "import":
        return {"sys_exit": "SystemExit", "os_exit": f"ended the process (exit status {code}",
                "raise": "RuntimeError: boom", "segfault": "crashed the process (SIGSEGV",
                "hang": "did not finish in 1 s"}[fault]
    return {"sys_exit": f"called sys.exit({code})", "os_exit": f"called os._exit({code})",
            "raise": "raised RuntimeError: boom"}[fault]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@settings(max_examples=14, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(["import", "factory", "forward"]), fault=st.sampled_from(["sys_exit", "os_exit", "raise"]),
       code=st.sampled_from([0, 3]))
def test_an_exit_or_a_raise_in_user_code_is_one_line_and_not_status_0(user_folder, ckrun, place, fault, code):
    # every example writes a module of its own name: the shared folder holds no state between them
    module = _model_module(user_folder, place, fault, code)
    verb = "validate" if place == "import" else "run"
    status, out, err = ckrun(verb, _recipe(user_folder, module))
    assert status == 2, (status, err)
    assert "Traceback" not in err and _expected(place, fault, code) in err.splitlines()[-1], err
    if place == "import":
        assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("fault", ["segfault", "hang"])
def test_an_import_that_crashes_or_hangs_is_refused_in_one_line(user_folder, ckrun, monkeypatch, fault):
    # tried in a fork: this test process survives the segfault, and the hang ends at the limit. The 1 s limit
    # is this test's only: an import that must succeed is given the default, which no busy machine reaches
    monkeypatch.setenv("CKRUN_IMPORT_TIMEOUT", "1")
    module = _model_module(user_folder, "import", fault)
    for verb in ("validate", "run"):
        status, out, err = ckrun(verb, _recipe(user_folder, module))
        assert status == 2 and len(err.splitlines()) == 1, err
        assert f"model.name: importing '{module}' " + _expected("import", fault, 0) in err, err


def _ckrun_process(recipe: Path, notice_s: float = 10.0, **environ: str) -> subprocess.Popen:
    program = (f"import ckrun.runner.builders.user_code as u; u.NOTICE_AFTER_S = {notice_s}; "
               "from ckrun.runner.cli import entry; entry()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(recipe.parent)]), **environ}
    return subprocess.Popen([sys.executable, "-c", program, "run", str(recipe)], stderr=subprocess.PIPE, text=True,
                            env=env)


@pytest.mark.parametrize("place", ["factory", "forward"])
def test_a_thread_left_running_does_not_keep_ckrun_from_ending(tmp_path, place):
    process = _ckrun_process(_recipe(tmp_path, _model_module(tmp_path, place, "thread")))
    try:
        _, stderr = process.communicate(timeout=120)  # it waited for the thread forever
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    assert "leaving 1 thread(s) the model's code started still running (poller)" in stderr.splitlines()[-1]


def test_a_factory_that_never_returns_says_what_ckrun_waits_for(tmp_path):
    module = _model_module(tmp_path, "factory", "hang")
    process = _ckrun_process(_recipe(tmp_path, module), notice_s=0.5)
    try:
        lines = iter(process.stderr.readline, "")  # ends at the line, or when a timeout kills the process
        assert any(f"still waiting for {module}:build to build the model" in line for line in lines)
    finally:
        process.kill()
        process.wait()


def test_a_factory_that_never_returns_is_ended_in_one_line_naming_it(tmp_path):
    # it waited forever, saying only that it waited
    module = _model_module(tmp_path, "factory", "hang")
    process = _ckrun_process(_recipe(tmp_path, module), notice_s=0.5, CKRUN_USER_CODE_TIMEOUT="2")
    try:
        _, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 2, stderr
    assert stderr.splitlines()[-1].endswith(f"model.name: {module}:build to build the model did not return in 2 s (an "
                                            "endless loop or a wait?); fix it, or raise CKRUN_USER_CODE_TIMEOUT (now 2 "
                                            "s) when it needs longer"), stderr


@pytest.mark.parametrize(("source", "loads_torch"), [
    ("import torch\n", True), ("from torch import nn\n", True), ("import os, torch.nn as nn\n", True),
    ("import colorsys\n", False), ("def f():\n    import torch\n", False),  # maybe never imported
    ("if False:\n    import torch\n", False), ("from .torch import x\n", False), ("import torch(\n", False),
])
def test_torch_is_loaded_before_the_fork_only_when_the_module_imports_it_itself(tmp_path, source, loads_torch):
    # else the fork imports torch (seconds) and the real import after it imports torch again
    (tmp_path / "own_code.py").write_text(source)
    code = ("import sys\nfrom ckrun.runner.builders.user_code import check_import\ncheck_import('own_code')\n"
            "print('torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = children.run([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert done.stdout.split() == [str(loads_torch)], done.stderr[-2000:]
