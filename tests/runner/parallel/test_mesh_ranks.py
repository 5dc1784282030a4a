"""HSDP and tensor parallelism on the CPU (gloo) through the real CLI: the losses of one process at the
same global batch, at 2 and 4 ranks (hsdp: 2 replicas of 1, 2 replicas of 2; tp: a tensor group of 2,
and at 4 ranks 2 of them holding FSDP2 shards, torchtitan's 2-D); the whole model exported once;
checkpoints resumed at other world sizes and strategies; and `ckrun estimate --nproc` within 5% of
each measured per-rank peak (less the reduce-scatter buffer it counts when the collective's timing holds it).

A small Llama from its config with tied embeddings (exported once), split by a recipe plan of the seven
projections its own plan (LlamaConfig.base_model_tp_plan) names: transformers 5.17 adds a vocabulary-
parallel embedding to that plan when the embeddings are tied, a style ckrun refuses. Clipping at 0.1,
so every step clips and the norm over gradients on two meshes (split layers on dp x tp, the rest on
dp) is what the update depends on. Tolerance as
in test_ranks.py: 1e-5 relative, SGD, no dropout (the only difference is the order of fp32 sums).
The fast test at the end runs the recipe-level plan of ckrun's own transformer stack on 2 ranks, with
dropout on.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import ROOT, read_metrics
from ckrun.runner.cli import main
from ckrun.runner.train.checkpoint.store import complete_checkpoints
from test_ranks import TINY as STACK_TINY
from test_ranks import STACK, assert_close, ckrun_process, finish, losses

LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")
# seq 32 x batch 16: activations dominate the rank's peak as in a real run, so the 5% check measures the
# model of the step rather than a few kB of gloo's own (docs/benchmarks_dist.md)
RUN = [LLAMA, "model.config={vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
       "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 32, tie_word_embeddings: true}",
       "data.seq_len=32", "train.batch_size=16", "train.device=cpu", "precision=fp32", "memory.micro_batch=null",
       "memory.checkpointing={policy: none}", "train.optimizer={name: sgd, lr: 0.5}", "train.scheduler={name: constant}",
       "train.grad_clip=0.1", "train.steps=4", "output.checkpoint_every=2", "output.keep_checkpoints=3"]
PLAN = ("plan: {layers.*.self_attn.q_proj: colwise, layers.*.self_attn.k_proj: colwise, layers.*.self_attn.v_proj: "
        "colwise, layers.*.self_attn.o_proj: rowwise, layers.*.mlp.gate_proj: colwise, layers.*.mlp.up_proj: colwise, "
        "layers.*.mlp.down_proj: rowwise}")
TP = "{strategy: tp, tensor: 2, " + PLAN + "}"
LAYOUTS = {  # name: (distributed section, ranks)
    "tp2": (TP, 2),
    "hsdp2": ("{strategy: hsdp, shard: 1}", 2),
    "tp4": (TP, 4),
    "hsdp4": ("{strategy: hsdp, shard: 2}", 4),
}


def ranks_run(out, layout: str, *extra):
    section, nproc = LAYOUTS[layout]
    return ckrun_process(*RUN, f"distributed={section}", f"output.dir={out}", *extra, "--nproc", nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every layout for 4 steps (checkpoints at 2 and 4), all at once; one process for 4 and 6."""
    base = tmp_path_factory.mktemp("mesh")
    started = {name: ranks_run(base / name, name) for name in LAYOUTS}
    assert main([*RUN, "train.steps=6", f"output.dir={base / 'single'}"]) == 0
    assert main([*RUN, f"output.dir={base / 'single4'}"]) == 0
    for process in started.values():
        code, err = finish(process)
        assert code == 0, err
    return base


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hsdp_and_tp_train_the_losses_of_one_process(runs, layout):
    records = read_metrics(runs / layout)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["world_size"] == LAYOUTS[layout][1] for r in records)
    assert_close(losses(runs / layout), losses(runs / "single")[:4])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp4", "hsdp4"])
def test_the_export_of_split_ranks_is_the_whole_model_with_tied_weights_once(runs, layout):
    from safetensors.torch import load_file

    split, single = runs / layout / "model" / "model.safetensors", runs / "single4" / "model" / "model.safetensors"
    weights, want = load_file(split), load_file(single)
    assert weights.keys() == want.keys() and "lm_head.weight" not in weights  # tied to the embedding: stored once
    assert split.stat().st_size == single.stat().st_size
    for name, tensor in want.items():
        assert (weights[name] - tensor).abs().max() <= 1e-5, name


def resumed(runs, tmp_path, source: str, layout: str | None):
    """`source`'s run copied and resumed to step 6 on `layout`'s ranks (None: one process)."""
    out = tmp_path / "run"
    shutil.copytree(runs / source, out)
    if layout is None:
        assert main([*RUN, "train.steps=6", f"output.dir={out}", "--resume"]) == 0
        return out, ""
    code, err = finish(ranks_run(out, layout, "train.steps=6", "--resume"))
    assert code == 0, err
    return out, err


@pytest.mark.slow
@pytest.mark.parametrize(("source", "layout"), [("tp4", "hsdp2"), ("hsdp4", None), ("hsdp2", "tp4")],
                         ids=["tp-4-ranks-on-hsdp-2", "hsdp-4-ranks-on-one-process", "hsdp-2-ranks-on-tp-2d"])
def test_a_checkpoint_resumes_at_another_world_size_and_strategy(runs, tmp_path, source, layout):
    out, err = resumed(runs, tmp_path, source, layout)
    assert layout is None or f"saved by {LAYOUTS[source][1]} rank(s)" in err, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert_close(losses(out), losses(runs / "single"))


@pytest.mark.slow
def test_a_single_process_checkpoint_resumes_on_tensor_parallel_ranks(runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs / "single", out)
    for later in complete_checkpoints(out / "checkpoints")[1:]:  # step 2's state.pt is the newest left
        shutil.rmtree(later)
    code, err = finish(ranks_run(out, "tp2", "train.steps=6", "--resume"))
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert_close(losses(out), losses(runs / "single"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimate_per_rank_is_within_5_percent_of_the_measured_per_rank_peak(runs, ckrun, layout):
    measured = max(r["peak_mem_bytes"] for r in read_metrics(runs / layout))  # the highest rank's
    section, nproc = LAYOUTS[layout]
    code, out, err = ckrun("estimate", *RUN, f"distributed={section}", "--device", "cpu", "--json", "--nproc", nproc)
    assert code == 0, err
    estimate = json.loads(out)
    # the estimate counts one block's gradients still in their reduce-scatter (fsdp, hsdp, tp over fsdp): gloo
    # held that buffer in 4 of 5 runs at 2 ranks and in neither run measured at 4, so a run's peak is within 5% of the
    # estimate with or without it, and the estimate is never more than 5% under the run's
    in_flight = estimate["breakdown"].get("reduce_in_flight", 0)
    predicted = estimate["peak_bytes"]
    assert 0.95 * measured <= predicted and predicted - in_flight <= 1.05 * measured, (predicted, in_flight, measured)


def test_a_recipe_plan_splits_your_own_models_mlp_on_two_ranks_to_the_losses_of_one_process_dropout_on(tmp_path):
    """ckrun's transformer stack ships no plan: the recipe's splits each block's feed-forward pair. Dropout
    is on: the ranks of a tensor group draw from the stream one process draws from (seeded by their
    data-parallel index, 0 here), and this model drops only activations each rank holds whole, so
    their masks are one process's masks and the losses match it."""
    plan = "distributed={strategy: tp, tensor: 2, plan: {blocks.*.ff_in: colwise, blocks.*.ff_out: rowwise}}"
    run = [STACK, *STACK_TINY, "model.config.dropout=0.1", "train.steps=2", "output.checkpoint_every=0"]
    process = ckrun_process(*run, plan, f"output.dir={tmp_path / 'tp'}", "--nproc", 2)
    assert main([*run, f"output.dir={tmp_path / 'single'}"]) == 0
    code, err = finish(process)
    assert code == 0, err
    assert "tp: 4 linear layers split over 2 ranks (2 colwise, 2 rowwise)" in err
    assert_close(losses(tmp_path / "tp"), losses(tmp_path / "single"))
