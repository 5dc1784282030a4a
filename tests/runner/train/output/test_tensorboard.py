"""`output.tensorboard: true`: every step and evaluation as TensorBoard scalars, readable by
TensorBoard's own EventAccumulator; without the package, one line at the key."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed (pip install 'ckrun[tensorboard]')")
def test_tensorboard_events_hold_every_record(tmp_path, ckrun):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=4", "eval={every: 2, batches: 1}", "output.tensorboard=true",
                         f"output.dir={out}")
    assert code == 0, err
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out)
    steps = [r for r in records if "loss" in r]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == [(r["step"], r["loss"]) for r in steps]
    evals = [r for r in records if "eval" in r]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/perplexity")] == \
           [(r["step"], r["eval"]["perplexity"]) for r in evals] and len(evals) == 2
    assert {"train/lr", "train/samples_per_s", "train/peak_mem_bytes", "eval/loss"} <= set(events.Tags()["scalars"])


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed")
def test_tensorboard_missing_is_one_line_at_the_key(tmp_path, ckrun):
    code, _, err = ckrun("validate", BERT_TINY, "output.tensorboard=true")
    assert code == 2
    assert err.splitlines() == ["override 'output.tensorboard=true': output.tensorboard: the tensorboard package is "
                                "not installed; pip install 'ckrun[tensorboard]', or set output.tensorboard: false"]
