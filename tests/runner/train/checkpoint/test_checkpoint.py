"""Checkpoints are complete or invisible, and resuming reproduces the uninterrupted run."""

import pytest
import torch

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.checkpoint import store
from ckrun.runner.train.trainer import Trainer
from ckrun.runner.train.checkpoint.store import CheckpointError, complete_checkpoints, load_latest, save_checkpoint


def test_an_interrupted_save_leaves_the_previous_checkpoint_and_is_not_picked(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 10, {"step": 10, "w": torch.ones(3)})
    real_save = torch.save

    def save_then_fail(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)  # the file is written...
        raise OSError("disk full")  # ...but the save dies before its marker

    monkeypatch.setattr(store.torch, "save", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 20, {"step": 20, "w": torch.zeros(3)})
    monkeypatch.undo()
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000010"]
    state = load_latest(root, torch.device("cpu"))
    assert state["step"] == 10 and torch.equal(state["w"], torch.ones(3))


def test_a_directory_without_its_marker_is_never_picked(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 5, {"step": 5})
    (root / "step-00000009").mkdir()  # e.g. copied by hand, or renamed by something else
    (root / "step-00000009" / "state.pt").write_bytes(b"garbage")
    assert load_latest(root, torch.device("cpu"))["step"] == 5


def test_a_directory_of_a_checkpoints_name_that_ckrun_did_not_write_is_kept(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-00000009").mkdir(parents=True)
    (root / "step-00000009" / "notes.txt").write_text("the user's\n")  # used to be deleted by the save of step 9
    save_checkpoint(root, 9, {"step": 9})
    assert (root / "step-00000009.not-a-checkpoint" / "notes.txt").read_text() == "the user's\n"
    assert load_latest(root, torch.device("cpu"))["step"] == 9
    save_checkpoint(root, 9, {"step": 9, "again": 1})  # its own earlier save of the step is replaced
    assert load_latest(root, torch.device("cpu"))["again"] == 1


def test_loading_refuses_pickled_code(tmp_path):
    root = tmp_path / "checkpoints"
    save_checkpoint(root, 1, {"step": 1, "evil": torch.nn.Linear(2, 2)})  # a module object is pickled code
    with pytest.raises(CheckpointError, match="holds pickled Python objects") as caught:
        load_latest(root, torch.device("cpu"))
    assert "weights_only" not in str(caught.value)  # torch's advice to turn the safety off is never passed on


def test_resume_after_step_10_of_20_gives_identical_losses(tmp_path, ckrun, monkeypatch):
    common = [BERT_TINY, *TINY_BERT, "train.steps=20", "output.checkpoint_every=5"]  # dropout stays on
    assert ckrun(*common, f"output.dir={tmp_path / 'straight'}")[0] == 0
    broken = tmp_path / "broken"
    real_step = Trainer.train_step

    def killed_during_step_12(trainer):
        if trainer.step == 11:
            raise KeyboardInterrupt  # Ctrl-C in step 12: step 11 is in metrics but not in a checkpoint
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", killed_during_step_12)
    assert ckrun(*common, f"output.dir={broken}")[0] == 130
    assert read_metrics(broken)[-1]["step"] == 11
    monkeypatch.undo()
    code, _, err = ckrun(*common, f"output.dir={broken}", "--resume")
    assert code == 0, err
    straight = [m["loss"] for m in read_metrics(tmp_path / "straight")]
    resumed = [m["loss"] for m in read_metrics(broken)]
    assert resumed == straight  # bit-identical: same data, same RNG, same optimizer state


@pytest.mark.parametrize("left_by", ["12345", "dcp"])  # a killed single-process save, a killed sharded one
def test_one_prune_rule_for_both_writers(tmp_path, left_by):
    """A temporary directory goes once a complete checkpoint of its step or a later one exists; one of a
    later step may be a save still in progress (another rank's, an async one) and stays."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    stale, later = root / f".tmp-step-00000002-{left_by}", root / f".tmp-step-00000009-{left_by}"
    stale.mkdir(), later.mkdir()
    for step in (1, 3, 5):
        save_checkpoint(root, step, {"step": step}, keep=2)
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000003", "step-00000005"]
    assert not stale.exists() and later.exists()
    save_checkpoint(root, 9, {"step": 9}, keep=2)
    assert not later.exists()
