"""The training path end to end through the real CLI: metrics, micro-batching, output safety."""

import math

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics

KEYS = {"step", "loss", "lr", "samples_per_s", "peak_mem_bytes"}


def test_bert_tiny_trains_20_steps_and_the_loss_goes_down(tmp_path, ckrun):
    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, "train.steps=20", f"output.dir={out}")
    assert code == 0, err
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert all(KEYS <= set(m) for m in metrics)
    assert all(m["peak_mem_bytes"] > 0 and m["samples_per_s"] > 0 for m in metrics)
    first, last = sum(m["loss"] for m in metrics[:3]) / 3, sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < first - 0.5, (first, last)
    assert (out / "recipe.yaml").read_text().startswith("description:")  # the resolved recipe sits beside them


def test_micro_batches_give_the_same_losses_as_one_batch(tmp_path, ckrun):
    no_dropout = ["model.config.hidden_dropout_prob=0.0", "model.config.attention_probs_dropout_prob=0.0"]
    common = [BERT_TINY, *TINY_BERT, *no_dropout, "train.batch_size=16", "train.steps=4"]
    assert ckrun(*common, f"output.dir={tmp_path / 'whole'}")[0] == 0
    assert ckrun(*common, "memory.micro_batch=4", f"output.dir={tmp_path / 'micro'}")[0] == 0
    whole = [m["loss"] for m in read_metrics(tmp_path / "whole")]
    micro = [m["loss"] for m in read_metrics(tmp_path / "micro")]
    assert micro == pytest.approx(whole, rel=1e-5)


def test_a_directory_holding_a_run_is_never_overwritten(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", f"output.dir={out}")[0] == 0
    before = (out / "metrics.jsonl").read_text()
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", f"output.dir={out}")
    assert code == 2 and "already holds a run; pass --resume" in err and len(err.splitlines()) == 1
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_on_cpu(tmp_path, ckrun, precision):
    out = tmp_path / precision
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=3", f"precision={precision}", f"output.dir={out}")
    assert code == 0, err
    assert all(math.isfinite(m["loss"]) for m in read_metrics(out))


def test_memory_cap_stops_the_run_with_one_line(tmp_path, ckrun, monkeypatch):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=3", "memory.max_mem=1MB", f"output.dir={tmp_path / 'r'}")
    line = err.strip().splitlines()[-1]
    assert code == 3 and "memory cap 1.0 MB: `ckrun estimate` predicts a peak of" in line  # before step 1
    from ckrun.runner import api

    monkeypatch.setattr(api, "predicted", lambda *args: None)  # a model fake tensors cannot run: step 1 measures
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=3", "memory.max_mem=1MB", f"output.dir={tmp_path / 's'}")
    line = err.strip().splitlines()[-1]
    assert code == 3 and "memory cap 1.0 MB exceeded: step 1 peaked at" in line


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["{policy: none}", "{policy: full}"])
def test_compiled_model_trains_close_to_eager(tmp_path, ckrun, policy):
    # dropout off: inductor draws its masks with its own RNG, so they differ from eager's
    no_dropout = ["model.config.hidden_dropout_prob=0.0", "model.config.attention_probs_dropout_prob=0.0"]
    common = [BERT_TINY, *TINY_BERT, *no_dropout, "train.steps=3", f"memory.checkpointing={policy}"]
    assert ckrun(*common, f"output.dir={tmp_path / 'eager'}")[0] == 0
    code, _, err = ckrun(*common, "memory.compile=true", f"output.dir={tmp_path / 'compiled'}")
    assert code == 0, err
    eager = [m["loss"] for m in read_metrics(tmp_path / "eager")]
    compiled = [m["loss"] for m in read_metrics(tmp_path / "compiled")]
    assert compiled == pytest.approx(eager, rel=1e-4)  # inductor fuses and reorders float ops
