"""The user's own model (model.source: python) faulting during `ckrun tune`, through the real CLI
in a subprocess: a forward that hangs, segfaults or calls os._exit costs a timeout or a probe, and
the tune still ends with one line, a status and a report naming the fault. Nothing the tuner or
its children started outlives it."""

import json
import os
import sys
import textwrap

import pytest

import children
from conftest import ROOT, lstm_step_reaches
from tune_helpers import launches, report, survivors, use_fake_child

USER_MODEL = '''
import os, signal, time
from torch import nn


class Net(nn.Module):
    """Three repeated blocks over a flattened 1x4x4 image; `fault` breaks the forward."""

    def __init__(self, fault="none", width=16, batchnorm=False):
        super().__init__()
        norm = (lambda: nn.BatchNorm1d(width)) if batchnorm else nn.Identity
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), norm()) for _ in range(3)])
        self.head = nn.Linear(width, 4)
        self.fault = fault

    def forward(self, images):
        if self.fault == "hang":
            time.sleep(3600)
        elif self.fault == "segfault":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif self.fault == "exit":
            os._exit(7)
        return self.head(self.blocks(images.flatten(1)))


def net(**config):
    return Net(**config)
'''


def write_user_model(directory, module="user_net") -> str:
    (directory / f"{module}.py").write_text(textwrap.dedent(USER_MODEL))
    return f"{module}:net"


def user_recipe(directory, name: str, config: dict, batch_size: int = 8) -> str:
    recipe = directory / "recipe.yaml"
    recipe.write_text(textwrap.dedent(f"""\
        model: {{source: python, name: "{name}", config: {json.dumps(config)}}}
        data: {{source: synthetic, task: image_classification, image_size: 4, channels: 1, num_classes: 4}}
        train: {{batch_size: {batch_size}, steps: 2, device: cpu}}
        output: {{dir: "{directory / 'run'}"}}
        """))
    return str(recipe)


def tune(directory, recipe, *flags):
    """`ckrun tune` as a user runs it, the user's module on PYTHONPATH; a hang (no CPU used) fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1"}
    return children.run([sys.executable, "-m", "ckrun", "tune", recipe, "--max-mem", "1GB", "--output",
                         str(directory / "tune"), *flags], cwd=ROOT, env=env)


# what the line says, and the limit of each child: only the hang waits for it (the others must not
# run into it while torch imports on a busy machine)
FAULTS = {"hang": ("timed out after 15 s", "15"), "segfault": ("killed by SIGSEGV", str(children.STALL_S * 5)),
          "exit": ("exited with status 7", str(children.STALL_S * 5))}


@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.slow) if f == "hang" else f for f in FAULTS])
def test_a_forward_that_faults_ends_the_tune_with_a_report(tmp_path, fault):
    recipe = user_recipe(tmp_path, write_user_model(tmp_path), {"fault": fault})
    words, limit = FAULTS[fault]
    done = tune(tmp_path, recipe, "--time-budget", "1s", "--probe-timeout", limit)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ckrun tune: ") and words in last  # the one line names the fault
    found = report(tmp_path / "tune")
    assert found["screening"]["state"] == "off" and words in found["screening"]["reason"]
    assert found["trials"][0]["state"] in ("timeout", "died") and words in found["trials"][0]["reason"]
    assert not survivors([launch["pid"] for launch in launches(tmp_path / "tune")])


def test_the_tuner_shows_the_estimates_warnings(ckrun, monkeypatch, tmp_path):
    """An LSTM's estimate is low (its fake kernel has no workspace): the tuner says so and the report keeps it."""
    models = ROOT / "tests" / "runner" / "predict"  # estimate_models.py: tiny_lstm
    use_fake_child(monkeypatch)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(models), os.environ["PYTHONPATH"])))
    monkeypatch.syspath_prepend(str(models))
    recipe = user_recipe(tmp_path, "estimate_models:tiny_lstm", {"vocab": 64, "width": 32})
    code, out, err = ckrun("tune", recipe, "data={source: synthetic, task: sequence_classification, seq_len: 16, "
                           "vocab_size: 64, num_classes: 4}", "--max-mem", "100MB", "--output", tmp_path / "tune",
                           "--trials", "1", "--finalists", "0", "--no-train")
    assert code == 0, err
    screening = report(tmp_path / "tune")["screening"]
    assert screening["state"] == "on"
    if screening["warnings"]:
        assert all(f"estimate warning: {w}" in out for w in screening["warnings"])
    if lstm_step_reaches("aten::mkldnn_rnn_layer"):
        assert any(w.startswith("aten.mkldnn_rnn_layer: ") for w in screening["warnings"])

