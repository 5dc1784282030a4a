"""What `ckrun tune` does when not told: which recipe, which study directory, and training after
tuning. Probes use the deterministic fake child; training is real."""

import logging
import shutil

from conftest import BERT_TINY, TINY_BERT, read_metrics
from tune_helpers import report, use_fake_child


def test_without_a_recipe_it_takes_ckrun_yaml_else_the_library_default(ckrun, monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    assert ckrun("tune", "--max-mem", "lots")[0] == 2  # stops at the flag, after saying which recipe
    assert "no recipe given and no ./ckrun.yaml here: using the library's bert_tiny" in caplog.text
    shutil.copy(BERT_TINY, tmp_path / "ckrun.yaml")
    caplog.clear()
    assert ckrun("tune", "train.steps=2", "--max-mem", "lots")[0] == 2
    assert "no recipe given: using ./ckrun.yaml" in caplog.text


def test_tune_then_train_with_the_winner(ckrun, monkeypatch, tmp_path, caplog):
    use_fake_child(monkeypatch)
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="ckrun.autotune")
    code, out, err = ckrun("tune", BERT_TINY, *TINY_BERT, "train.steps=2", "output.dir=run", "--max-mem", "100MB",
                           "--trials", "2", "--no-screen")
    assert code == 0, err
    assert "study directory run/tune (the recipe's output.dir + /tune" in caplog.text
    assert report(tmp_path / "run/tune")["winner"] is not None
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2] and max(m["peak_mem_bytes"] for m in metrics) <= 100 * 10**6
