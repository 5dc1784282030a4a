"""Probes with memory.compile: a timeout of their own (their first step compiles, 1-2 minutes cold
for BERT-large on an H100), and compile's disk caches on in every probe, so that the next probe of
the same graph loads what the first compiled."""

from __future__ import annotations

import os

import pytest

from ckrun.autotune.probes.probe import COLD_COMPILE_S, ProbeRunner, ProbeSettings, child_env
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe

EAGER = load_recipe(BERT_TINY, TINY_BERT)
COMPILED = load_recipe(BERT_TINY, [*TINY_BERT, "memory.compile=true"])


@pytest.mark.parametrize(("settings", "eager_s", "compiled_s"), [
    (ProbeSettings(timeout_s=60), 60, 60 + COLD_COMPILE_S),
    (ProbeSettings(timeout_s=60, compile_timeout_s=900), 60, 900),
])
def test_compile_probes_get_their_own_timeout(tmp_path, monkeypatch, settings, eager_s, compiled_s):
    given = []
    monkeypatch.setattr(ProbeRunner, "_run", lambda self, what, recipe, stem, extra, timeout_s, trial:
                        given.append(timeout_s) or '{"status": "ok"}')
    probe_runner = ProbeRunner(tmp_path, settings)
    probe_runner.probe(EAGER, 0)
    probe_runner.probe(COMPILED, 1)
    assert given == [eager_s, compiled_s]


def test_probes_keep_compiles_disk_caches_on_unless_the_user_turned_them_off(monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    env = child_env(COMPILED)
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1" and env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "0"


@pytest.mark.slow
def test_a_second_compiled_probe_loads_what_the_first_compiled(tmp_path, monkeypatch):
    """Two real probes of one compiled plan on the CPU, from an empty inductor cache: the first fills
    it, the second (a fresh process) takes less time."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # on the CPU the first two steps run under the live-bytes tracker, a dispatch mode dynamo does not
    # trace under: the third step is the one that compiles
    probe_runner = ProbeRunner(tmp_path / "study", ProbeSettings(timeout_s=300, warmup_steps=2, timed_steps=2))
    first, second = probe_runner.probe(COMPILED, 0), probe_runner.probe(COMPILED, 1)
    assert first.status == second.status == "ok", (first, second)
    assert any((tmp_path / "inductor").rglob("*")), "nothing was cached"
    assert second.probe_s < first.probe_s, (first.probe_s, second.probe_s)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
