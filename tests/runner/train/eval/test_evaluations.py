"""What users of HF Trainer and Lightning expect of evaluation: the whole held-out set by default,
their own metrics from a python path, early stopping on a metric (exact across --resume), and an
evaluation of the weights a Ctrl-C stop leaves."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.trainer import Trainer

CLASSIFIER = [*TINY_BERT, "model.name=BertForSequenceClassification", "model.config.num_labels=3"]
METRICS = '''import torch

def seen(predictions, labels):
    return {"count": len(labels), "label_sum": int(labels.sum())}

def right(predictions, labels):
    return torch.tensor(float((predictions == labels).float().mean()))

def broken(predictions, labels):
    return 1 / 0

def words(predictions, labels):
    return "high"

def nan(predictions, labels):
    return float("nan")

def many(predictions, labels):
    return torch.zeros(1000)

def leaves(predictions, labels):
    import sys
    sys.exit(0)

def quits(predictions, labels):
    import os
    os._exit(0)

def hangs(predictions, labels):
    import time
    while True:
        time.sleep(0.05)
'''


@pytest.fixture
def records(tmp_path, monkeypatch):
    """train.jsonl (40 rows) and valid.jsonl (13 rows, label ids 0-2), and my_metrics importable."""
    for name, count in (("train", 40), ("valid", 13)):
        with (tmp_path / f"{name}.jsonl").open("w") as out:
            for i in range(count):
                out.write(json.dumps({"text": f"row {i} " * (1 + i % 3), "label": str(i % 3)}) + "\n")
    (tmp_path / "my_metrics.py").write_text(METRICS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = f"data={{source: records, paths: [{tmp_path / 'train.jsonl'}], seq_len: 16}}"
    return [BERT_TINY, *CLASSIFIER, data, "train.batch_size=4", "train.steps=2"], tmp_path


def _eval(tmp_path, extra: str = "") -> str:
    return f"eval={{data: {{source: records, paths: [{tmp_path / 'valid.jsonl'}], seq_len: 16}}{extra}}}"


def test_the_whole_held_out_set_is_evaluated_once_by_default(records, ckrun):
    run, folder = records
    code, _, err = ckrun(*run, _eval(folder, ", metrics: ['my_metrics:seen', 'my_metrics:right']"),
                         f"output.dir={folder / 'run'}")
    assert code == 0, err
    [evaluation] = [r["eval"] for r in read_metrics(folder / "run") if "eval" in r]
    # 13 rows at batch 4: four batches, the last cut to one row; every label once (ids 0,1,2,0,... sum 12)
    assert evaluation["samples"] == 13 and evaluation["count"] == 13 and evaluation["label_sum"] == 12
    assert 0 <= evaluation["right"] <= 1 and evaluation["right"] == pytest.approx(evaluation["accuracy"])


@pytest.mark.parametrize("metric, line", [
    ("my_metrics:broken", "eval.metrics.0: my_metrics:broken raised ZeroDivisionError: division by zero "
                          "(at my_metrics.py:10)"),
    ("my_metrics:words", "eval.metrics.0: my_metrics:words returned 'high' for 'words'; return a finite number"),
])
def test_a_metric_that_fails_is_one_line_naming_it(records, ckrun, metric, line):
    run, folder = records
    code, _, err = ckrun(*run, _eval(folder, f", metrics: ['{metric}']"), f"output.dir={folder / 'run'}")
    assert code == 2 and line in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("metric, line", [
    ("broken", "eval.metrics.0: my_metrics:broken raised ZeroDivisionError"),
    ("nan", "eval.metrics.0: my_metrics:nan returned 'nan' for 'nan'; return a finite number"),
    ("many", "eval.metrics.0: my_metrics:many returned 'tensor([0., 0., 0.,"),
    ("leaves", "ckrun: sys.exit(0) was called at my_metrics.py:"),
    ("quits", "ckrun: os._exit(0) was called at my_metrics.py:"),
    ("hangs", "eval.metrics.0: the evaluation metric my_metrics:hangs did not return in 1 s (an endless loop or a "
              "wait?); fix it, or raise CKRUN_USER_CODE_TIMEOUT"),
])
def test_a_failing_metric_keeps_the_training_so_far(records, ckrun, monkeypatch, metric, line):
    # the run ended in one line, but the checkpoint due at that step was never written and metrics.jsonl was
    # moved aside as an attempt with nothing to resume; a metric that hung hung the run silently
    if metric == "hangs":  # the others must return, and on a busy machine even a quick call may pass 1 s
        monkeypatch.setenv("CKRUN_USER_CODE_TIMEOUT", "1")
    run, folder = records
    out = folder / "run"
    code, _, err = ckrun(*run, "train.steps=4", "output.checkpoint_every=2",
                         _eval(folder, f", every: 2, batches: 1, metrics: ['my_metrics:{metric}']"), f"output.dir={out}")
    lines = [text for text in err.splitlines() if not re.match(r"[WI]\d{4} ", text)]  # torch's import-time log
    assert code == 2 and line in err and len(lines) == 1, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").is_file()
    fixed = [*run, "train.steps=4", "output.checkpoint_every=2", _eval(folder, ", every: 2, batches: 1"), f"output.dir={out}"]
    assert ckrun(*fixed, "--resume")[0] == 0
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4]


def test_a_metric_path_that_does_not_resolve_is_found_by_validate(records, ckrun):
    run, folder = records
    code, _, err = ckrun("validate", *run, _eval(folder, ", metrics: ['my_metrics:seen', 'my_metrics:sene']"))
    assert code == 2 and "eval.metrics.1: module 'my_metrics' has no 'sene' (did you mean seen?)" in err, err


# loss falls on this data, so "max" never improves: the run stops after `patience` evaluations without
STOPPING = ["train.steps=12", "train.scheduler={name: constant}", "output.checkpoint_every=2",
            "eval={every: 1, batches: 1, early_stopping: {metric: loss, mode: max, patience: 2}}"]


def test_early_stopping_ends_the_run_as_a_finished_one(tmp_path, ckrun, caplog):
    caplog.set_level("INFO", logger="ckrun")
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *STOPPING, f"output.dir={tmp_path}")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3]
    assert "early stopping after step 3 of 12: eval loss has not improved by more than 0 over its best for 2 " \
           "evaluations (best" in "\n".join(caplog.messages)
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "checkpoints" / "step-00000003").is_dir()


def test_early_stopping_after_a_resume_stops_where_the_straight_run_did(tmp_path, ckrun, monkeypatch):
    assert ckrun(BERT_TINY, *TINY_BERT, *STOPPING, "eval.early_stopping.patience=3", f"output.dir={tmp_path / 'a'}")[0] == 0
    real_step = Trainer.train_step

    def killed_in_step_4(trainer):
        if trainer.step == 3:
            raise KeyboardInterrupt  # the checkpoint of step 2 holds one evaluation without improvement
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", killed_in_step_4)
    assert ckrun(BERT_TINY, *TINY_BERT, *STOPPING, "eval.early_stopping.patience=3", f"output.dir={tmp_path / 'b'}")[0] == 130
    monkeypatch.undo()
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, *STOPPING, "eval.early_stopping.patience=3", f"output.dir={tmp_path / 'b'}",
                         "--resume")
    assert code == 0, err

    def values(out):
        return [(r["step"], r["eval"]["loss"]) if "eval" in r else (r["step"], r["loss"]) for r in read_metrics(out)]
    assert values(tmp_path / "b") == values(tmp_path / "a")
    assert [r["step"] for r in read_metrics(tmp_path / "b") if "loss" in r] == [1, 2, 3, 4]


def test_early_stopping_needs_evaluations_and_a_metric_they_report(ckrun):
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "eval={early_stopping: {metric: f1}}")
    assert code == 2 and "eval.every: eval.early_stopping needs evaluations during the run" in err, err
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "eval={every: 2, early_stopping: {metric: f1}}")
    assert code == 2 and "eval.early_stopping.metric: the evaluation reports loss and perplexity or accuracy, " \
                         "not 'f1'" in err, err
    # found by validate, not after the first training steps and evaluation
    code, _, err = ckrun("validate", BERT_TINY, *TINY_BERT, "eval={every: 2, early_stopping: {metric: accuracy}}")
    assert code == 2 and "eval.early_stopping.metric: a masked_lm model's evaluation reports loss and perplexity, " \
                         "not accuracy; name one of them, or a metric eval.metrics returns" in err, err
    code, _, err = ckrun("validate", BERT_TINY, *CLASSIFIER, "eval={every: 2, early_stopping: {metric: perplexity}}")
    assert code == 2 and "a sequence_classification model's evaluation reports loss and accuracy, not perplexity" in err


def test_a_ctrl_c_stop_evaluates_the_weights_it_leaves(tmp_path, ckrun, monkeypatch):
    real_step = Trainer.train_step

    def signalled_during_step_3(trainer):
        if trainer.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the run stops after step 3
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", signalled_during_step_3)
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=8", "eval={every: 2, batches: 1}", f"output.dir={tmp_path}")
    assert code == 130, err
    assert [r["step"] for r in read_metrics(tmp_path) if "eval" in r] == [2, 3]


def test_early_stopping_on_perplexity_when_the_loss_is_past_exps_range():
    from ckrun.runner.recipe.eval import EarlyStopping
    from ckrun.runner.train.eval.early_stop import EarlyStop

    early = EarlyStop(EarlyStopping(metric="perplexity", patience=1))
    assert early.observe({"step": 1, "eval": {"loss": 2.0, "perplexity": 7.4}}) is None
    # the evaluation leaves perplexity out past loss 700: no improvement, not "the evaluation reports loss"
    assert "has not improved" in early.observe({"step": 2, "eval": {"loss": 800.0}})
