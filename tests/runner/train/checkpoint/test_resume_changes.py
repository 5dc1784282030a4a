"""--resume refuses a change that makes the resumed steps other than the run's own (the batch size, the
data, seq_len, the seed, the precision, clipping, the schedule), naming each; --resume-changed
continues with it, logs it and records it in metrics.jsonl. The memory plan and train.steps may change."""

from __future__ import annotations

import json

import pytest

from conftest import BERT_TINY, TINY_BERT, read_metrics

RUN = [BERT_TINY, *TINY_BERT, "train.steps=2"]


@pytest.fixture
def finished(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(*RUN, f"output.dir={out}")[0] == 0
    return out


@pytest.mark.parametrize("change, key, said", [
    ("train.batch_size=4", "train.batch_size", "train.batch_size 8 in the checkpoint, 4 now"),
    ("data.seq_len=16", "data.seq_len", "data.seq_len 32 in the checkpoint, 16 now"),
    ("precision=bf16", "precision", 'precision "fp32" in the checkpoint, "bf16" now'),
    ("train.seed=7", "train.seed", "train.seed 0 in the checkpoint, 7 now"),
    ("train.grad_clip=null", "train.grad_clip", "train.grad_clip 1.0 in the checkpoint, null now"),
])
def test_a_changed_setting_is_refused_then_accepted_and_recorded(finished, ckrun, caplog, change, key, said):
    code, _, err = ckrun(*RUN, "train.steps=3", change, f"output.dir={finished}", "--resume")
    assert code == 2 and len(err.splitlines()) == 1, err  # was accepted silently
    assert f"{key}: --resume: step-00000002 was trained with other settings: {said}" in err
    assert "pass --resume-changed" in err
    code, _, err = ckrun(*RUN, "train.steps=3", change, f"output.dir={finished}", "--resume-changed")
    assert code == 0, err
    assert f"--resume-changed: continuing step-00000002 with {key}" in caplog.text
    records = read_metrics(finished)
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    [recorded] = [r for r in records if "resumed_with_changes" in r]
    assert recorded["step"] == 2 and key in recorded["resumed_with_changes"], json.dumps(recorded)


def test_the_memory_plan_and_the_steps_may_change(finished, ckrun):
    code, _, err = ckrun(*RUN, "train.steps=3", "memory.checkpointing={policy: full}", "memory.micro_batch=4",
                         f"output.dir={finished}", "--resume")
    assert code == 0, err
    assert not any("resumed_with_changes" in r for r in read_metrics(finished))


@pytest.mark.parametrize("flag", ["--resume", "--resume-changed"])
def test_fewer_steps_than_the_checkpoint_reached_is_one_line_and_leaves_the_run_as_it_was(finished, ckrun, caplog, flag):
    """A checkpoint holds the state after its step: a shorter run cannot be had from it (it exited 0 silently,
    exporting the weights it had)."""
    caplog.set_level("INFO", logger="ckrun")
    metrics, export = (finished / "metrics.jsonl").read_text(), (finished / "model" / "model.safetensors").read_bytes()
    code, _, err = ckrun(*RUN, "train.steps=1", "train.seed=3", f"output.dir={finished}", flag)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.steps: --resume: step-00000002 is at step 2, already past the run's end at train.steps 1" in err
    assert (finished / "metrics.jsonl").read_text() == metrics
    assert (finished / "model" / "model.safetensors").read_bytes() == export
    code, _, err = ckrun(*RUN, f"output.dir={finished}", flag)  # a requeued job that had finished: nothing to do
    assert code == 0, err
    assert "step-00000002 is the run's last step (train.steps 2): nothing to train" in caplog.text
