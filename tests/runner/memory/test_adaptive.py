"""Adaptive plans: checkpointing per batch length, switched between steps without a rebuild. The
switch is exact (losses and weights identical to a run under a fixed plan, fp32, dropout on) and
real (each step recomputes as its bucket says, counted by block forwards)."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.data import Batch
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.memory.adaptive import batch_length
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.train.trainer import Trainer

SHORT, LONG = 12, 32  # bucket max_len, and the longest line (data.seq_len)
BUCKETS = f"memory.adaptive=[{{max_len: {SHORT}, checkpointing: {{policy: none}}}}]"


def corpus(tmp_path, short_lines: int = 15) -> str:
    """Lines of 4-10 bytes and one of LONG: with batch 8 of 16 lines, each epoch has one long batch."""
    lines = [("ab cd " * 3)[: 4 + i % 7] for i in range(short_lines)] + ["x" * LONG]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def recipe(tmp_path, *overrides):
    return load_recipe(BERT_TINY, [*TINY_BERT, "data.source=text", f"data.paths=[{corpus(tmp_path)}]",
                                   "data.split=lines", f"data.seq_len={LONG}", "model.config.num_hidden_layers=3",
                                   f"output.dir={tmp_path / 'run'}", *overrides])


def count_block_forwards(monkeypatch) -> list[int]:
    """Every call of a BertLayer's forward, the checkpoint's recompute included."""
    calls = [0]
    original = transformers.models.bert.modeling_bert.BertLayer.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)
    monkeypatch.setattr(transformers.models.bert.modeling_bert.BertLayer, "forward", counted)
    return calls


def run_steps(trainer: Trainer, steps: int, calls: list[int] | None = None) -> list[tuple[float, int, int]]:
    """(loss, batch length, block forwards) per step."""
    out = []
    for _ in range(steps):
        before = calls[0] if calls else 0
        length = batch_length(trainer.data.global_batch(trainer.step))
        loss = trainer.train_step()["loss"]
        out.append((loss, length, (calls[0] - before) if calls else 0))
    return out


def test_switches_are_exact_and_recompute_per_bucket(tmp_path, monkeypatch):
    calls = count_block_forwards(monkeypatch)
    adaptive = Trainer(recipe(tmp_path, BUCKETS, "memory.checkpointing={policy: full}"))
    switched = run_steps(adaptive, 4, calls)
    assert {length <= SHORT for _, length, _ in switched} == {True, False}  # both buckets ran
    for _, length, forwards in switched:
        # 3 blocks: forward only in the short bucket, forward and recompute in the long one
        assert forwards == (3 if length <= SHORT else 6), switched
    assert adaptive.plan.switch.steps == {0: 2, 1: 2}
    for fixed in ("none", "full"):
        other = Trainer(recipe(tmp_path, f"memory.checkpointing={{policy: {fixed}}}"))
        assert [loss for loss, _, _ in run_steps(other, 4)] == [loss for loss, _, _ in switched]
        for a, b in zip(adaptive.model.parameters(), other.model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_selective_and_every_buckets_through_the_cli(tmp_path, ckrun):
    runs = {}
    for name, plan in [("adaptive", [f"memory.adaptive=[{{max_len: 8, checkpointing: {{policy: selective}}}}, "
                                     f"{{max_len: {SHORT}, checkpointing: {{policy: every, every: 2}}}}]",
                                     "memory.checkpointing={policy: full}"]), ("none", [])]:
        base = [*TINY_BERT, "data.source=text", f"data.paths=[{corpus(tmp_path)}]", "data.split=lines",
                f"data.seq_len={LONG}", "train.steps=4", f"output.dir={tmp_path / name}"]
        code, _, err = ckrun(BERT_TINY, *base, *plan)
        assert code == 0, err
        runs[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    assert runs["adaptive"] == runs["none"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=4))
def test_buckets_must_go_from_short_to_long(lengths):
    buckets = [{"max_len": n, "checkpointing": {"policy": "full"}} for n in lengths]
    if lengths == sorted(set(lengths)):
        plan = MemoryPlan.model_validate({"adaptive": buckets})
        assert [b.max_len for b in plan.adaptive] == lengths
    else:
        with pytest.raises(ValidationError, match="from short to long"):
            MemoryPlan.model_validate({"adaptive": buckets})


def test_a_bad_bucket_is_one_line(tmp_path, ckrun):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "memory.adaptive=[{max_len: 8, checkpointing: {policy: sqrt}}]",
                         f"output.dir={tmp_path}")
    assert code == 2 and len(err.splitlines()) == 1 and "memory.adaptive: " in err and "policy sqrt" in err, err


def test_bucket_for_a_length():
    plan = MemoryPlan.model_validate({"adaptive": [{"max_len": 8, "checkpointing": {"policy": "none"}},
                                                   {"max_len": 16, "checkpointing": {"policy": "none"}}]})
    from ckrun.runner.memory.adaptive import PlanSwitch
    from ckrun.runner.memory.blocks import BlockList

    switch = PlanSwitch(plan, BlockList("", []))
    assert [switch.bucket_for(n) for n in (1, 8, 9, 16, 17, None)] == [0, 0, 1, 1, 2, 2]
    images = Batch({"images": torch.zeros(2, 3, 4, 4)}, torch.zeros(2, dtype=torch.long), False)
    assert batch_length(images) is None


# --- measuring batches of varying length -------------------------------------------------------


def test_each_new_batch_length_is_measured(tmp_path):
    """On CPU the tracker skips steps whose shapes it has measured; a new length is measured."""
    trainer = Trainer(recipe(tmp_path, "output.log_every=1000"))
    records = [(trainer.train_step(), batch_length(trainer.data.global_batch(trainer.step - 1))) for _ in range(6)]
    by_length = {}
    for record, length in records[1:]:  # the first step has no optimizer state yet
        by_length.setdefault(length, set()).add(record["peak_mem_bytes"])
    assert len(by_length) == 2 and all(len(peaks) == 1 for peaks in by_length.values())
    assert max(by_length[LONG]) > max(next(p for n, p in by_length.items() if n != LONG))


def test_a_probe_measures_the_longest_batch_of_each_bucket(tmp_path):
    from ckrun.runner.train.measure.probe import SCAN_STEPS, probe, warmup_steps_for

    lossy_free = recipe(tmp_path, BUCKETS, "memory.checkpointing={policy: full}")
    trainer = Trainer(lossy_free)
    lengths = [batch_length(trainer.data.global_batch(step)) for step in range(SCAN_STEPS)]
    warmup = warmup_steps_for(trainer, 1)
    assert [lengths[step] for step in warmup] == [LONG, LONG, max(n for n in lengths if n <= SHORT)]
    # the probe's peak is the largest a step of either bucket reaches
    whole = Trainer(recipe(tmp_path, BUCKETS, "memory.checkpointing={policy: full}", "output.log_every=1"))
    peaks = [whole.train_step()["peak_mem_bytes"] for _ in range(4)]
    assert probe(lossy_free, 1, 1).peak_mem_bytes == max(peaks[1:])
