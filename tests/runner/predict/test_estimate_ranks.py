"""`ckrun estimate --nproc N` counts one rank: FSDP really shards the fake model over a fake group of
N ranks, so a rank holds exactly 1/N of the parameters and of AdamW's moments (every dimension here
splits evenly); DDP holds them whole plus gradient buckets as large as the gradients. The comparison
with measured per-rank peaks is in tests/runner/parallel/test_ranks.py (slow: it starts ranks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import DeviceFacts
from ckrun.runner.predict.per_rank import per_rank

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=8", "precision=fp32"]


def estimate(ckrun, *args) -> dict:
    code, out, err = ckrun("estimate", STACK, *TINY, "--device", "cpu", "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_rank_holds_its_share_of_parameters_and_optimizer_state(ckrun, nproc):
    whole = estimate(ckrun, "train.batch_size=2", "distributed.strategy=fsdp")  # one process: nothing to shard
    rank = estimate(ckrun, f"train.batch_size={2 * nproc}", "distributed.strategy=fsdp", "--nproc", str(nproc))
    assert rank["breakdown"]["parameters"] * nproc == whole["breakdown"]["parameters"]
    # AdamW's two moments shard with their parameters; its step counters (a scalar each) do not
    counters = whole["breakdown"]["optimizer_state"] - 2 * whole["breakdown"]["parameters"]
    assert rank["breakdown"]["optimizer_state"] == 2 * rank["breakdown"]["parameters"] + counters
    assert rank["notes"][0].startswith(f"one of {nproc} ranks (fsdp): its share of 2 samples")


def test_fsdp_counts_one_blocks_gradients_in_their_reduce_scatter(ckrun):
    # the fake group ends each reduce-scatter at once; gloo held one block's buffer on in 4 of 5 runs at 2 ranks,
    # so the estimate was 4.5% low with no warning
    rank = estimate(ckrun, "train.batch_size=4", "distributed.strategy=fsdp", "--nproc", "2")
    # the stack's block in fp32: attention (4 x 16 x 16 + 4 x 16), MLP (16 x 64 + 64 + 64 x 16 + 16), 2 norms (2 x 32)
    assert rank["breakdown"]["reduce_in_flight"] == (4 * 16 * 16 + 4 * 16 + 16 * 64 + 64 + 64 * 16 + 16 + 2 * 32) * 4
    assert sum(rank["breakdown"].values()) == rank["peak_bytes"]
    assert any("one block's gradients still in their reduce-scatter" in note for note in rank["notes"])


def test_ddp_rank_holds_the_whole_model_and_gradient_buckets(ckrun):
    whole = estimate(ckrun, "train.batch_size=4", "distributed.strategy=ddp")
    rank = estimate(ckrun, "distributed.strategy=ddp", "--nproc", "2")
    assert rank["breakdown"]["gradient_buckets"] == whole["breakdown"]["parameters"]
    assert rank["peak_bytes"] == whole["peak_bytes"] + whole["breakdown"]["parameters"]


def test_a_batch_that_does_not_split_is_one_line(ckrun):
    code, _, err = ckrun("estimate", STACK, *TINY, "distributed.strategy=fsdp", "--nproc", "3")
    assert code == 2 and err.count("\n") == 1 and "does not split over 3 ranks" in err


FACTS = DeviceFacts(name="test gpu", matmul_tflops={"fp32": 1.0, "tf32": 1.0, "bf16": 4.0, "fp16": 4.0},
                    memory_gbs=100.0, peer_gbs=50.0, capability=(9, 0), matmul_efficiency=1.0, memory_efficiency=1.0)
LLAMA = """
model:
  source: transformers
  name: LlamaForCausalLM
  config: {vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 4, max_position_embeddings: 64, tie_word_embeddings: false}
data: {source: synthetic, seq_len: 32}
train: {batch_size: 8, steps: 2, device: cpu}
precision: bf16
"""


def _of_class(estimate, op_class: str, what: str = "flops") -> float:
    return sum(getattr(op, what) for op in estimate.work.ops if op.op_class == op_class)


@pytest.fixture(scope="module")
def whole_llama():
    """One process's step at the batch one data-parallel group takes below (4 samples)."""
    return Estimator(recipe_from_text(LLAMA.replace("batch_size: 8", "batch_size: 4")), "cuda", FACTS).estimate()


def test_a_fsdp_rank_steps_the_optimizer_on_its_shard(whole_llama):
    """FSDP's optimizer step and clipping run on each rank's shard of parameters, gradients and moments,
    though they reach the clock as DTensors of the whole shape: a rank of 4 moves a quarter of the bytes
    (less AdamW's step counters and learning rate, which every rank keeps whole)."""
    whole = Estimator(recipe_from_text(LLAMA.replace("batch_size: 8", "batch_size: 2")), "cuda", FACTS).estimate()
    rank = per_rank(4)(recipe_from_text(LLAMA + "distributed: {strategy: fsdp}\n"), "cuda", FACTS).estimate()
    moved, whole_moved = _of_class(rank, "optimizer", "nbytes"), _of_class(whole, "optimizer", "nbytes")
    assert moved == pytest.approx(whole_moved / 4, rel=1e-3)
    assert rank.time.update_s < whole.time.update_s


def test_a_tensor_parallel_rank_counts_its_share_of_the_flops(whole_llama):
    """tp: 2 on 4 ranks: each rank runs half of every split product (Llama's plan splits the attention and
    MLP projections; the output head stays whole) on its group's 4 samples, and half of the attention
    heads; MFU is that share over one device's peak, as ddp's is its whole model over one device."""
    rank = per_rank(4)(recipe_from_text(LLAMA + "distributed: {strategy: tp, tensor: 2}\n"), "cuda", FACTS).estimate()
    head = 3 * 2 * (4 * 32) * 64 * 256  # the output head's product, forward and two in backward
    assert _of_class(rank, "matmul") == (_of_class(whole_llama, "matmul") - head) / 2 + head
    assert _of_class(rank, "attention") == _of_class(whole_llama, "attention") / 2
    assert rank.time.mfu == pytest.approx(rank.time.model_flops / rank.time.seconds / 4e12)


def test_tensor_parallel_collectives_block_and_a_rank_is_never_as_fast_as_one_alone(whole_llama):
    """Eager tensor parallelism waits for its DTensor collectives (functional, blocking): all of their time shows.
    Data parallelism's collectives hide only where compute is longer, never all of them (the first gather, the
    last reduction, DDP's last bucket): a DDP rank, doing one process's work and its all-reduce, is slower per
    sample than the process alone (an FSDP rank also steps only its shard of the optimizer)."""
    from ckrun.runner.predict.roofline import price

    rank = per_rank(4)(recipe_from_text(LLAMA + "distributed: {strategy: tp, tensor: 2}\n"), "cuda", FACTS).estimate()
    blocking = [c for c in rank.work.collectives if c.blocking]
    assert blocking and all(len(c.ranks) == 2 for c in blocking)  # the tensor groups' own: 2 of the 4 ranks
    ledger = price(rank.work, FACTS)
    shown = sum(c.nbytes / 2 / (FACTS.peer_gbs * 1e9) for c in blocking if c.phase != "update" and c.kind == "first")
    assert ledger.comm_exposed["first"] >= shown * (1 - 1e-9)
    for strategy in ("ddp", "fsdp"):  # each of 2 ranks takes 4 samples, as the process alone does
        split = per_rank(2)(recipe_from_text(LLAMA + f"distributed: {{strategy: {strategy}}}\n"), "cuda",
                            FACTS).estimate()
        assert split.time.comm_s > 0, strategy
        if strategy == "ddp":
            assert split.time.samples_per_s / 2 < whole_llama.time.samples_per_s


@pytest.mark.slow
def test_a_13b_fsdp_run_on_64_ranks_prices_the_optimizer_step_on_the_shard(ckrun):
    """`ckrun estimate --gpu a100 --nproc 64` of Llama 2 13B (torchtitan's setup): fused AdamW reads a
    parameter, its gradient and two moments and writes three of them back (28 bytes a parameter in fp32),
    and a rank does so for its 1/64th only. Bounds from the rank's own parameter bytes and the datasheet
    bandwidth: no faster than that traffic at the full 2039 GB/s, and far from the whole model's 64 times
    as much (clipping and the efficiencies add at most a few times the traffic, never 64)."""
    code, out, err = ckrun("estimate", str(ROOT / "bench" / "published" / "llama2_13b.yaml"), "--gpu", "a100",
                           "--json", "--nproc", "64")
    assert code == 0, err
    record = json.loads(out)
    parameters_on_rank = record["breakdown"]["parameters"] / 4  # fp32 shards
    assert 12.5e9 / 64 < parameters_on_rank < 13.5e9 / 64
    shard_at_full_bandwidth = 28 * parameters_on_rank / 2039e9
    assert shard_at_full_bandwidth <= record["time"]["update_s"] < 4 * shard_at_full_bandwidth


def test_fsdp_gathered_parameters_are_freed_after_each_block():
    """FSDP2 frees a block's gathered parameters by resizing their storage to 0 (no aten op): counted as
    freed, each extra fully checkpointed block adds its shards of parameters, gradients and AdamW state (8
    bytes a parameter on each of 2 ranks) and its small checkpoint input, not its whole bf16 copy too."""
    recipe = LLAMA.replace("hidden_size: 64, intermediate_size: 128", "hidden_size: 256, intermediate_size: 512")
    recipe += "memory: {checkpointing: {policy: full}}\ndistributed: {strategy: fsdp}\n"
    peaks = {layers: per_rank(2)(recipe_from_text(recipe.replace("num_hidden_layers: 2", f"num_hidden_layers: {layers}")),
                                 "cuda").estimate().live_peak_bytes for layers in (2, 6)}
    layer_parameters = 4 * 256 * 256 + 3 * 256 * 512 + 2 * 256
    per_block = (peaks[6] - peaks[2]) / 4
    assert 8 * layer_parameters <= per_block < 8 * layer_parameters + 2 * layer_parameters / 2


BIG_LLAMA = LLAMA.replace("vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2",
                          "vocab_size: 32000, hidden_size: 2048, intermediate_size: 8192, num_hidden_layers: 8")
BIG_LLAMA_FP32_BYTES = 4 * (8 * (4 * 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2 * 32000 * 2048 + 2048)  # 2.7 GB


# the estimate in a process of its own, which then says the most it held resident (Linux: kB)
MEASURED_ESTIMATE = """
import resource, sys
from ckrun.runner.cli import main
code = main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])  # one path; ddp: -m slow
def test_a_rank_estimate_holds_none_of_the_models_weights(tmp_path, strategy):
    """`estimate --nproc` runs on fake tensors: the whole process stays under the model's fp32 weights. (The
    gradient sizes behind DDP's buckets and FSDP's in-flight reduce-scatter were once counted on a model built
    by name on the CPU, real: a 13B model on 64 ranks was killed at 24 GB with no line.)"""
    recipe = tmp_path / "big.yaml"
    recipe.write_text(BIG_LLAMA.replace("seq_len: 32", "seq_len: 8") + f"distributed: {{strategy: {strategy}}}\n")
    done = subprocess.run([sys.executable, "-c", MEASURED_ESTIMATE, "estimate", str(recipe), "--gpu", "a100",
                           "--nproc", "8", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["breakdown"]["parameters"] > 0
    assert int(done.stderr.splitlines()[-1]) < BIG_LLAMA_FP32_BYTES


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_a_ranks_weights_line_says_what_it_counts(strategy):
    """FSDP2's mixed precision gathers bf16 weights, so autocast casts none and the line says so; DDP's
    whole fp32 model is cast by autocast, as one process's is."""
    rank = per_rank(2)(recipe_from_text(LLAMA + f"distributed: {{strategy: {strategy}}}\n"), "cuda", FACTS).estimate()
    line = next(note for note in rank.notes if note.startswith("weights:"))
    if strategy == "fsdp":
        assert rank.breakdown["weight_casts"] == 0 and "shards" in line and "autocast casts none" in line
    else:
        assert rank.breakdown["weight_casts"] > 0 and "cast by autocast" in line


def test_a_tensor_parallel_rank_reduce_scatters_its_share_of_a_block():
    """tp: 2 over FSDP on 4 ranks: a rank reduce-scatters its own pieces of the block's split projections
    (half of each) and its whole norms; tp alone (every rank one tensor group) reduce-scatters nothing."""
    two_d = per_rank(4)(recipe_from_text(LLAMA + "distributed: {strategy: tp, tensor: 2}\n"), "cuda", FACTS).estimate()
    projections, norms = 4 * 64 * 64 + 3 * 64 * 128, 2 * 64
    assert two_d.breakdown["reduce_in_flight"] == (projections // 2 + norms) * 4
    alone = per_rank(2)(recipe_from_text(LLAMA + "distributed: {strategy: tp, tensor: 2}\n"), "cuda", FACTS).estimate()
    assert "reduce_in_flight" not in alone.breakdown
