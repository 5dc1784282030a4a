"""The rank layout as a device mesh, and the tensor-parallel plan, without starting ranks: which share of
the global batch each rank trains on (a tensor group's ranks the same one), which modules a plan splits,
and every plan or layout that cannot work refused in one line, exit 2, before any rank starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import ROOT
from ckrun.runner.builders.model import build_model
from ckrun.runner.recipe.load import load_recipe_document
from ckrun.runner.parallel.mesh import data_coordinate
from ckrun.runner.parallel.ranks import Ranks, join
from ckrun.runner.builders.tensor_plan import matches, resolve
from ckrun.runner.problems import InputError
from ckrun.runner.plan.strategies import HybridSharded, TensorParallel, strategy_from_label

STACK = str(ROOT / "recipes" / "classic_transformer_stack.yaml")
TINY = ["model.config.vocab_size=64", "model.config.width=16", "model.config.depth=2", "model.config.heads=2",
        "model.config.max_len=16", "data.seq_len=16", "data.vocab_size=64", "train.batch_size=8", "train.device=cpu"]
MLP_PLAN = "{blocks.*.ff_in: colwise, blocks.*.ff_out: rowwise}"
LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")
TINY_LLAMA = ["model.config={vocab_size: 256, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
              "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 32}", "data.seq_len=16",
              "train.batch_size=8", "train.device=cpu", "memory.micro_batch=null"]


@given(data=st.integers(1, 6), tensor=st.integers(1, 4), per_group=st.integers(1, 4))
def test_a_tensor_groups_ranks_share_one_slice_and_the_groups_cover_the_batch(data, tensor, per_group):
    world, batch = data * tensor, data * per_group
    strategy = strategy_from_label(f"tp:{tensor}") if tensor > 1 else strategy_from_label("fsdp")
    shares = [Ranks(rank, world, data=data_coordinate(strategy, rank, world)).share(batch) for rank in range(world)]
    for rank in range(world):  # mesh dp x tp, row-major: ranks 0..tensor-1 are one tensor group
        assert shares[rank] == shares[rank - rank % tensor]
    distinct = sorted(set(shares))
    assert [i for start, stop in distinct for i in range(start, stop)] == list(range(batch))


def test_hsdp_lays_out_replicas_of_shard_groups_and_every_rank_sees_its_own_samples():
    strategy = HybridSharded(strategy="hsdp", shard=2)
    assert strategy.mesh_dims(8) == {"replicate": 4, "shard": 2}
    assert [data_coordinate(strategy, rank, 8) for rank in (0, 5)] == [(0, 8), (5, 8)]


@given(st.lists(st.sampled_from(["layers", "0", "12", "mlp", "up_proj"]), min_size=1, max_size=5))
def test_a_star_stands_for_exactly_one_name(names):
    name = ".".join(names)
    assert matches(name, name)
    assert matches(".".join("*" for _ in names), name)
    assert not matches(".".join(["*", *names]), name)  # one star more: one name more


def test_a_llamas_own_plan_splits_its_seven_projections_a_layer_under_its_base_model():
    recipe, _ = load_recipe_document(LLAMA, TINY_LLAMA)
    model = build_model(recipe.model, "meta")
    plan, problems = resolve(model, TensorParallel(strategy="tp", tensor=2))
    assert problems == []
    assert len(plan) == 2 * 7 and all(name.startswith("model.layers.") for name in plan)
    assert plan["model.layers.1.self_attn.o_proj"] == "rowwise" and plan["model.layers.0.mlp.up_proj"] == "colwise"


TP = "distributed={strategy: tp, tensor: 2, plan: %s}"
CASES = [  # (recipe, arguments, the fragment of the one line)
    (STACK, ["distributed={strategy: hsdp, shard: 3}", "--nproc", "4"],
     "distributed.shard: shard groups of 3 ranks do not divide 4 ranks; use 2 or 4"),
    (STACK, [TP % MLP_PLAN, "--nproc", "3"], "distributed.tensor: tensor groups of 2 ranks do not divide 3 ranks; use 3"),
    (STACK, [TP % MLP_PLAN, "train.batch_size=5", "--nproc", "4"],
     "train.batch_size: 5 does not split over 2 data-parallel groups of 4 ranks"),
    (STACK, ["distributed={strategy: tp, tensor: 2}", "--nproc", "2"],
     "distributed.plan: TransformerStack ships no tensor-parallel plan"),
    (STACK, [TP % "{blocks.*.ffn_in: colwise}", "--nproc", "2"],
     "distributed.plan.blocks.*.ffn_in: blocks.*.ffn_in (distributed.plan) matches no module of TransformerStack"),
    (STACK, [TP % "{blocks.*.ln_attn: colwise}", "--nproc", "2"], "blocks.0.ln_attn is a LayerNorm, not an nn.Linear"),
    (STACK, [TP % "{blocks.*.ff_in: gather}", "--nproc", "2"], "distributed.plan.blocks.*.ff_in: 'gather' is not one of colwise, rowwise"),
    (STACK, ["distributed={strategy: tp, tensor: 3, plan: {blocks.*.ff_in: colwise}}", "--nproc", "3"],
     "blocks.0.ff_in has 64 output features, which do not split over 3 ranks"),
    (LLAMA, [*TINY_LLAMA[1:], "distributed={strategy: tp, tensor: 4}", "--nproc", "4"],
     "distributed.tensor: 4 ranks cannot split 2 attention heads (model.config.num_key_value_heads)"),
]


@pytest.mark.parametrize(("recipe", "args", "fragment"), CASES, ids=[c[2][:40] for c in CASES])
def test_a_layout_or_plan_that_cannot_work_is_one_line_before_any_rank_starts(ckrun, tmp_path, recipe, args, fragment):
    base = TINY if recipe == STACK else TINY_LLAMA[:1]
    code, _, err = ckrun(recipe, *base, f"output.dir={tmp_path / 'run'}", *args)
    assert code == 2
    assert err.count("\n") == 1 and fragment in err, err
    assert not (tmp_path / "run").exists()


def test_a_model_whose_own_plan_has_a_style_ckrun_does_not_apply_is_refused_at_validate(ckrun):
    """Phi-3 ships a plan of colwise_gather_output / rowwise_split_input (transformers' own styles)."""
    config = ("model.config={vocab_size: 64, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, "
              "num_attention_heads: 2, num_key_value_heads: 2, max_position_embeddings: 16, pad_token_id: 0}")
    code, _, err = ckrun("validate", LLAMA, "model.name=Phi3ForCausalLM", config, "data.seq_len=16",
                         "distributed={strategy: tp, tensor: 2}")
    assert code == 2 and err.count("\n") == 1, err
    assert ("distributed.tensor: Phi3ForCausalLM's base_model_tp_plan splits layers in styles ckrun does not apply (it "
            "applies colwise and rowwise): colwise_gather_output (layers.*.self_attn.qkv_proj, layers.*.mlp.gate_up_proj); "
            "rowwise_split_input") in err


def test_torchrun_ranks_an_hsdp_shard_does_not_divide_are_refused_before_joining(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    recipe, _ = load_recipe_document(STACK, [*TINY, "distributed={strategy: hsdp, shard: 3}"])
    with pytest.raises(InputError, match="distributed.shard: shard groups of 3 ranks do not divide 4 ranks"):
        join(recipe, STACK)


def test_a_2d_layout_whose_inner_groups_span_machines_is_named():
    from ckrun.runner.parallel.mesh import node_problem

    assert node_problem(TensorParallel(strategy="tp", tensor=4).mesh_dims(8), 2).startswith(
        "tp groups of 4 ranks do not fit the 2 ranks of a machine")
    assert node_problem(HybridSharded(strategy="hsdp", shard=8).mesh_dims(16), 8) is None
    assert node_problem({"dp": 16}, 8) is None  # one dimension: nothing inside a machine to keep together
