"""Distributed settings that cannot work end in one line naming the key (or --nproc), exit 2, before
any rank starts; and the split of the global batch over ranks, for every size, covers it exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from ckrun.runner.parallel.ranks import Ranks, check_world, join
from ckrun.runner.recipe.load import load_recipe_document
from ckrun.runner.problems import InputError

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=8", "train.device=cpu"]

CASES = [  # (arguments, the fragment of the one line)
    (["distributed.strategy=ddp", "--nproc", "3"], "train.batch_size: 8 does not split over 3 ranks"),
    (["distributed.strategy=fsdp", "memory.micro_batch=4", "--nproc", "4"], "memory.micro_batch: 4 does not divide a rank's share 2"),
    (["--nproc", "2"], "distributed.strategy: --nproc 2 needs ddp, fsdp, hsdp or tp"),
    (["distributed.strategy=ddp", "--nproc", "0"], "--nproc: needs a rank count of 1 or more, got 0"),
    (["memory.sharding.offload=cpu"], "memory.sharding: sharding knobs apply to FSDP, but distributed.strategy is none"),
    (["distributed.strategy=ddp", "memory.sharding.reshard_after_forward=false"], "distributed.strategy is ddp"),
    (["distributed.strategy=fsdp", "precision=fp16"], "precision: fp16 with distributed.strategy fsdp is not supported"),
    (["distributed.strategy=fsdp", "memory.checkpointing={policy: sqrt}", "--nproc", "2"],
     "memory.checkpointing: sqrt segments do not work with distributed.strategy fsdp"),
    (["distributed.strategy=fsdp", "memory.sharding.offload=gpu"], "memory.sharding.offload: 'gpu' is not one of none, cpu"),
    (["distributed.strategy=zero3"], "distributed: unknown strategy 'zero3'"),
    (["distributed.strategy=ddp", "memory.optimizer_step={policy: in_backward}", "train.grad_clip=null"],
     "memory.optimizer_step: in_backward would update each parameter with this rank's own gradient: DDP averages it"),
    (["distributed.strategy=fsdp", "memory.optimizer_step={policy: in_backward}", "train.grad_clip=null",
      "memory.micro_batch=2", "--nproc", "2"],
     "memory.optimizer_step: in_backward updates each parameter as soon as its gradient is accumulated, but "
     "memory.micro_batch 2 makes 2 micro-batches of a rank's share 4"),
    (["distributed.strategy=ddp", "memory.optimizer_offload={policy: cpu}"],
     "memory.optimizer_offload: ckrun's host optimizer keeps its state in a form the ranks' sharded checkpoint"),
    (["distributed.strategy=hsdp", "distributed.shard=2", "memory.optimizer_offload={policy: cpu}"],
     "memory.optimizer_offload: under distributed.strategy hsdp the host offload is FSDP2's own: set "
     "memory.sharding.offload: cpu"),
]


@pytest.mark.parametrize(("args", "fragment"), CASES, ids=[c[1][:40] for c in CASES])
def test_a_bad_combination_is_one_line_before_any_rank_starts(ckrun, tmp_path, args, fragment):
    code, _, err = ckrun(STACK, *TINY, f"output.dir={tmp_path / 'run'}", *args)
    assert code == 2
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nproc_under_torchrun_is_refused(ckrun, tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}.items():  # all torchrun sets: a partial set is refused earlier
        monkeypatch.setenv(key, value)
    code, _, err = ckrun(STACK, *TINY, "distributed.strategy=ddp", f"output.dir={tmp_path}", "--nproc", "2")
    assert code == 2 and err.count("\n") == 1 and "already runs under torchrun" in err


def test_two_ranks_with_strategy_none_are_refused_before_joining(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    recipe, _ = load_recipe_document(STACK, TINY)
    with pytest.raises(InputError, match="none trains one process, but 2 ranks would each train alone"):
        join(recipe, STACK)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 96), world=st.integers(1, 12), micro=st.one_of(st.none(), st.integers(1, 96)))
def test_a_world_is_accepted_exactly_when_batch_and_micro_batch_divide(batch, world, micro):
    recipe, _ = load_recipe_document(STACK, [*TINY, f"train.batch_size={batch}"])
    recipe = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"micro_batch": micro})})
    fits = batch % world == 0 and (micro is None or (batch // world) % micro == 0)
    try:
        check_world(recipe, world, STACK)
    except InputError as err:
        assert not fits
        assert len(err.problems) == 1 and "\n" not in str(err.problems[0])
        return
    assert fits


@given(world=st.integers(1, 16), per_rank=st.integers(1, 16))
def test_the_ranks_shares_cover_the_global_batch_once_in_order(world, per_rank):
    batch = world * per_rank
    shares = [Ranks(rank, world).share(batch) for rank in range(world)]
    assert [i for start, stop in shares for i in range(start, stop)] == list(range(batch))


def test_resuming_another_model_on_ranks_is_one_line_before_any_rank_starts(ckrun, tmp_path):
    """Issue 25, defect 5: what resume refuses was found by every rank, after each had started, and
    said once per rank; the launcher checks the newest checkpoint against the recipe first."""
    out = f"output.dir={tmp_path / 'run'}"
    code, _, err = ckrun(STACK, *TINY, "train.steps=2", out)
    assert code == 0, err
    code, _, err = ckrun(STACK, *TINY, "model.config.width=32", "distributed.strategy=fsdp", out, "--nproc", "2",
                         "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert "model.config.width: --resume: step-00000002 was trained with a different model" in err
