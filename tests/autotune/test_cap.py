"""On a CPU, `ckrun tune --max-mem` caps RAM, not a GPU's memory: the tuner says so before it probes."""

from __future__ import annotations

from ckrun.autotune.cap import Cap
from conftest import BERT_TINY, TINY_BERT
from tune_helpers import use_fake_child


def test_on_a_cpu_the_cap_is_said_to_be_a_ram_cap():
    line = Cap(40 * 10**9, 0.05).meaning("cpu")
    assert line.startswith("tune: on the CPU, --max-mem 40.0 GB caps RAM: the live tensor bytes of a step")
    assert Cap(40 * 10**9, 0.05).meaning("cuda") is None


def test_tune_on_a_cpu_says_it_before_the_first_probe(ckrun, monkeypatch, tmp_path, caplog):
    caplog.set_level("INFO")
    use_fake_child(monkeypatch)
    code, _, err = ckrun("tune", BERT_TINY, *TINY_BERT, f"output.dir={tmp_path}", "--output", tmp_path, "--no-train",
                         "--no-screen", "--max-mem", "10MB", "--trials", "2", "--finalists", "0")
    assert code == 0, err
    said = [i for i, m in enumerate(caplog.messages) if m.startswith("tune: on the CPU, --max-mem 10.0 MB caps RAM")]
    probed = [i for i, m in enumerate(caplog.messages) if m.startswith("trial 0: probing")]
    assert said and probed and said[0] < probed[0], caplog.messages[:20]
