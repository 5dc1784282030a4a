"""Training as a call (runner/api.py): `ckrun.train` runs what `ckrun RECIPE` runs, prints nothing, and
returns the run's steps, losses and output directory; bad input is the CLI's one line, as an error."""

from __future__ import annotations

import pytest

import ckrun
from conftest import BERT_TINY, TINY_BERT, read_metrics


def test_train_returns_the_runs_steps_losses_and_output_dir_and_prints_nothing(tmp_path, capfd):
    result = ckrun.train(BERT_TINY, [*TINY_BERT, "train.steps=3", f"output.dir={tmp_path}"])
    assert capfd.readouterr().out == ""
    assert isinstance(result, ckrun.RunResult) and result.output_dir == tmp_path
    assert result.steps_done == result.total_steps == 3 and not result.stopped_by
    assert result.losses == [record["loss"] for record in read_metrics(tmp_path) if "loss" in record]
    resumed = ckrun.train(BERT_TINY, [*TINY_BERT, "train.steps=5", f"output.dir={tmp_path}"], resume=True)
    assert resumed.resumed_at == 3 and resumed.steps_done == 5 and len(resumed.losses) == 2


def test_bad_input_is_the_clis_one_line_raised(tmp_path):
    with pytest.raises(ckrun.CkrunError) as err:
        ckrun.train(BERT_TINY, [*TINY_BERT, "train.steps=-1", f"output.dir={tmp_path}"])
    lines = err.value.lines()
    assert len(lines) == 1 and "train.steps" in lines[0] and err.value.exit_status == 2
    assert not (tmp_path / "metrics.jsonl").exists()
