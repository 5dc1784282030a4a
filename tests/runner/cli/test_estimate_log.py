"""`ckrun estimate` prints the prediction, not the lines a run prints while it applies the plan."""

from __future__ import annotations

import logging

from conftest import BERT_TINY, TINY_BERT

PLAN = ["memory.checkpointing.policy=full"]


def test_estimate_keeps_the_plan_lines_quiet_and_a_run_still_prints_them(ckrun, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="ckrun")
    code, out, err = ckrun("estimate", BERT_TINY, *TINY_BERT, *PLAN, "--device", "cpu")
    assert code == 0 and "predicted peak" in out, err
    assert not [r for r in caplog.records if r.name.startswith("ckrun.runner.memory")]
    assert logging.getLogger("ckrun.runner.memory").level == logging.NOTSET  # put back: a later run logs again
    caplog.clear()
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *PLAN, "train.steps=1", f"output.dir={tmp_path}")
    assert code == 0, err
    assert any(r.name == "ckrun.runner.memory.checkpointing" and "checkpointing 2 of 2 blocks" in r.message
               for r in caplog.records)
