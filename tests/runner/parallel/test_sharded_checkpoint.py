"""The DCP checkpoint format in one process (DCP runs without a process group): what is saved loads
back exactly, a save that never got its marker is invisible, and a shard file cut short after the
save is caught by the sizes in the marker and set aside, never loaded."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from ckrun.runner.disk.checkpoint_files import MARKER, CheckpointError
from ckrun.runner.recipe.load import load_recipe_document
from ckrun.runner.train.trainer import Trainer
from ckrun.runner.train.checkpoint.sharded import is_sharded, load_sharded, pick_sharded, save_sharded
from ckrun.runner.parallel.ranks import SINGLE

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=4", "train.device=cpu",
        "precision=fp32"]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def trained(steps: int) -> Trainer:
    recipe, _ = load_recipe_document(STACK, TINY)
    trainer = Trainer(recipe, STACK)
    for _ in range(steps):
        trainer.train_step()
    return trainer


def test_a_sharded_checkpoint_loads_back_exactly(tmp_path):
    trainer = trained(2)
    assert trainer.ranks == SINGLE
    saved, saved_rng = save_sharded(trainer, tmp_path, keep=2), torch.get_rng_state()
    assert is_sharded(saved) and (saved / MARKER).is_file()
    fresh = trained(0)
    checkpoint, state = pick_sharded(tmp_path, fresh.ranks)
    load_sharded(fresh, checkpoint, state)
    assert fresh.step == 2
    assert torch.equal(torch.get_rng_state(), saved_rng)
    for (name, want), got in zip(trainer.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    restored = torch.get_rng_state()  # the checkpoint's: the one process-wide RNG both trainers draw dropout from
    fresh_loss = fresh.train_step()["loss"]
    torch.set_rng_state(restored)
    assert fresh_loss == trainer.train_step()["loss"]  # optimizer state, schedule and dropout stream too


def test_an_unmarked_save_is_invisible_and_a_cut_shard_is_set_aside(tmp_path):
    trainer = trained(1)
    save_sharded(trainer, tmp_path, keep=3)
    trainer.train_step()
    second = save_sharded(trainer, tmp_path, keep=3)
    unmarked = tmp_path / ".tmp-step-00000003-dcp"  # as a kill before the marker leaves it
    unmarked.mkdir()
    assert pick_sharded(tmp_path, SINGLE)[0] == second
    shard = next(second.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    checkpoint, _ = pick_sharded(tmp_path, SINGLE)
    assert checkpoint.name == "step-00000001"
    assert (tmp_path / "damaged-step-00000002").is_dir() and not second.exists()
    next(checkpoint.glob("*.distcp")).unlink()
    with pytest.raises(CheckpointError, match="missing or cut short"):
        pick_sharded(tmp_path, SINGLE)
