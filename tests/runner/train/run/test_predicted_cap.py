"""A run whose predicted peak is over memory.max_mem stops before its first step (issue 43), with the estimate's
figure, status 3, nothing trained or written but the lock; a cap the step fits under trains. A prediction the
estimate does not claim exact (CUDA's allocator model, eager experts' routing) stops only when clearly over."""

from __future__ import annotations

import json

import torch
from hypothesis import given, strategies as st

from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.problems import EXIT_OVER_CAP
from ckrun.runner.train.run import memory_cap
from ckrun.runner.units import format_bytes


def test_a_run_predicted_over_its_cap_stops_before_step_one_with_the_estimates_figure(ckrun, tmp_path):
    code, out, err = ckrun("estimate", BERT_TINY, *TINY_BERT, "--device", "cpu", "--json")
    assert code == 0, err
    peak = json.loads(out)["peak_bytes"]
    run = tmp_path / "over"
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", f"memory.max_mem={peak - 1}", f"output.dir={run}")
    assert code == EXIT_OVER_CAP and len(err.splitlines()) == 1, err
    assert f"`ckrun estimate` predicts a peak of {format_bytes(peak)} per step on cpu" in err
    assert "so the run stops before step 1" in err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=2", f"memory.max_mem={peak}", f"output.dir={tmp_path / 'at'}")
    assert code == 0, err  # exactly at the cap: the step measures what was predicted, and fits


@given(peak=st.integers(1, 10**12), cap=st.integers(1, 10**12), exact=st.booleans(), cuda=st.booleans(),
       context=st.integers(0, 10**9))
def test_the_prediction_stops_a_run_exactly_over_the_cap_or_clearly_over_it(peak, cap, exact, cuda, context):
    prediction = memory_cap.Prediction(None, peak, exact, "batch 8")
    device = torch.device("cuda" if cuda else "cpu")
    counted = peak + (context if cuda else 0)  # the card's context counts against a card-level cap
    over = counted > cap * (1 if exact else 1 + memory_cap.ROUGH)
    try:
        memory_cap.check_predicted_peak(prediction, cap, device, context if cuda else None)
    except memory_cap.PredictedOverCap as err:
        assert over and err.exit_status == EXIT_OVER_CAP and format_bytes(counted) in str(err)
    else:
        assert not over
