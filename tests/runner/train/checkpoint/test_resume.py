"""--resume with a damaged checkpoint falls back to the one before it; with a changed model or
optimizer it says what differs. Damage is generated: every truncation point and flipped byte."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.checkpoint.store import MARKER, CheckpointError, complete_checkpoints, load_latest, save_checkpoint

CPU = torch.device("cpu")
RUN = [BERT_TINY, *TINY_BERT, "output.checkpoint_every=2", "output.keep_checkpoints=3"]


def damage(path: Path, data: st.DataObject) -> None:
    raw = path.read_bytes()
    if data.draw(st.booleans(), label="truncate"):
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")])
    else:
        at = data.draw(st.integers(0, len(raw) - 1), label="flip at")
        path.write_bytes(raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255), label="xor")]) + raw[at + 1:])


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_loaded(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("c") / "checkpoints"
    save_checkpoint(root, 1, {"step": 1, "w": torch.arange(64.0)}, keep=3)
    save_checkpoint(root, 2, {"step": 2, "w": torch.arange(64.0) * 2}, keep=3)
    damage(root / "step-00000002" / "state.pt", data)
    state = load_latest(root, CPU)
    assert state["step"] == 1 and torch.equal(state["w"], torch.arange(64.0))
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000001"]
    assert (root / "damaged-step-00000002" / "state.pt").is_file()  # kept, never deleted


def test_the_fallback_is_one_line_naming_both_checkpoints(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, {"step": step}, keep=3)
    (root / "step-00000002" / "state.pt").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="ckrun"):
        assert load_latest(root, CPU)["step"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "weights_only" not in warnings[0]
    assert warnings[0].startswith("--resume: step-00000002: state.pt is damaged")
    assert "resuming from step-00000001 instead" in warnings[0]


def test_when_every_checkpoint_is_damaged_resume_stops_with_one_line(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=4", f"output.dir={out}")[0] == 0
    for checkpoint in complete_checkpoints(out / "checkpoints"):
        (checkpoint / "state.pt").write_bytes(b"PK\x03\x04")
    before = (out / "metrics.jsonl").read_text()
    code, _, err = ckrun(*RUN, "train.steps=6", f"output.dir={out}", "--resume")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "output.dir: --resume: no complete checkpoint in" in err and "weights_only" not in err
    assert (out / "metrics.jsonl").read_text() == before  # nothing lost


def test_resume_past_a_truncated_checkpoint_reproduces_the_straight_run(tmp_path, ckrun):
    assert ckrun(*RUN, "train.steps=6", f"output.dir={tmp_path / 'straight'}")[0] == 0
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=4", f"output.dir={out}")[0] == 0
    newest = out / "checkpoints" / "step-00000004" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a copy cut short, after the marker was written
    code, _, err = ckrun(*RUN, "train.steps=6", f"output.dir={out}", "--resume")
    assert code == 0, err
    straight = [m["loss"] for m in read_metrics(tmp_path / "straight")]
    assert [m["loss"] for m in read_metrics(out)] == straight


@pytest.mark.parametrize("change, key, expected", [
    ("model.config.hidden_size=64", "model.config.hidden_size",
     "was trained with a different model: model.config.hidden_size 32 in the checkpoint, 64 now"),
    ("train.optimizer={name: sgd, lr: 0.01}", "train.optimizer.name",
     'was trained with a different optimizer: train.optimizer.name "adamw" in the checkpoint, "sgd" now'),
    ("train.optimizer.lr=0.5", "train.optimizer.lr", "train.optimizer.lr 0.001 in the checkpoint, 0.5 now"),
])
def test_resume_with_a_changed_model_or_optimizer_says_what_differs(tmp_path, ckrun, change, key, expected):
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=2", f"output.dir={out}")[0] == 0
    code, _, err = ckrun(*RUN, "train.steps=4", change, f"output.dir={out}", "--resume")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"override '{change}': {key}: --resume: step-00000002 ") and expected in err, err
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_resume_may_change_the_plan_and_the_step_count(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=2", f"output.dir={out}")[0] == 0
    code, _, err = ckrun(*RUN, "train.steps=4", "memory.micro_batch=4", "memory.checkpointing={policy: full}",
                         f"output.dir={out}", "--resume")
    assert code == 0, err
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_a_checkpoint_from_before_fingerprints_is_still_checked_by_shape(tmp_path, ckrun):
    out = tmp_path / "run"
    assert ckrun(*RUN, "train.steps=2", f"output.dir={out}")[0] == 0
    checkpoint = out / "checkpoints" / "step-00000002"
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    del state["recipe"]
    torch.save(state, checkpoint / "state.pt")
    (checkpoint / MARKER).write_text("2\n")  # the marker format before digests
    code, _, err = ckrun(*RUN, "train.steps=4", "model.config.intermediate_size=96", f"output.dir={out}", "--resume")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "model: --resume: step-00000002 does not fit the model and optimizer the recipe builds" in err
    assert "size mismatch" in err


def test_loading_an_unknown_object_is_a_checkpoint_error(tmp_path):
    checkpoint = tmp_path / "step-00000001"
    checkpoint.mkdir()
    torch.save([1, 2, 3], checkpoint / "state.pt")
    (checkpoint / MARKER).write_text("1\n")
    with pytest.raises(CheckpointError, match="holds no training state"):
        load_latest(tmp_path, CPU)
