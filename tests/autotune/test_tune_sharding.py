"""`ckrun tune --nproc N`: a sharding choice is a strategy type and its FSDP2 knobs, written as one
label that reads back into itself (studies from before hsdp and tp included), offered where the
world size and the model allow, and carried typed into the probe's recipe, the model child's
request, the trial's record and tuned.yaml."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.records import TrialRecord, read_record, store_record
from ckrun.autotune.space.sharding import ShardingChoice
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space
from ckrun.autotune.space.tp_facts import TensorFacts, tensor_facts
from ckrun.autotune.space.validity import invalid_reason
from conftest import BERT_TINY, ROOT, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan, Sharding
from ckrun.runner.plan.strategies import DataParallel, FullySharded, HybridSharded, TensorParallel

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "test")
GPU = Device("cuda", "gpu", 80 * 10**9, ("fp32", "fp16", "bf16"), "test", count=8)
BLOCKS = {"container_name": "model.layers", "blocks": ["model.layers.0", "model.layers.1"],
          "containers": ["model.layers"] * 2}
# what the model child reports (runner/builders/tensor_plan.py's first problem per tensor size)
HEADS = "4 ranks cannot split 2 attention heads (model.config.num_key_value_heads); use a tensor size that divides 2"
LLAMA = {"model": "LlamaForCausalLM", "problems": {"2": None, "4": HEADS}}
NO_PLAN = "GPT2LMHeadModel ships no tensor-parallel plan (its config has no base_model_tp_plan); give distributed.plan"
GPT2 = {"model": "GPT2LMHeadModel", "problems": {"2": NO_PLAN, "4": NO_PLAN}}
# a tiny Llama: 2 layers of width 64, 4 heads sharing 2 key/value heads, batch 8 (4 ranks: 2 samples each)
TINY_LLAMA = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
              "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.vocab_size=256",
              "model.config.max_position_embeddings=64", "data.seq_len=32", "train.batch_size=8", "train.device=cpu",
              "precision=fp32", "memory.micro_batch=null", "memory.checkpointing={policy: none}"]


def _llama(*overrides: str):
    return load_recipe(str(ROOT / "recipes" / "llama_1b.yaml"), [*TINY_LLAMA, *overrides])


def _facts(tensor: dict | None = LLAMA) -> ModelFacts:
    return ModelFacts.from_json({**BLOCKS, **({"tensor_parallel": tensor} if tensor else {})})


# --- the label grammar ---------------------------------------------------------------------------

PLANS = st.none() | st.dictionaries(st.sampled_from(["layers.*.mlp.up_proj", "layers.*.mlp.down_proj", "*.q_proj"]),
                                    st.sampled_from(["colwise", "rowwise"]), min_size=1)
STRATEGIES = st.one_of(
    st.builds(DataParallel, strategy=st.just("ddp")), st.builds(FullySharded, strategy=st.just("fsdp")),
    st.builds(HybridSharded, strategy=st.just("hsdp"), shard=st.integers(1, 64)),
    st.builds(TensorParallel, strategy=st.just("tp"), tensor=st.integers(2, 64), plan=PLANS))
KNOBS = st.none() | st.builds(Sharding, reshard_after_forward=st.booleans(), offload=st.sampled_from(["none", "cpu"]))


@given(strategy=STRATEGIES, knobs=KNOBS)
def test_every_choice_is_written_as_one_label_that_reads_back_into_it(strategy, knobs):
    choice = ShardingChoice(strategy, knobs)
    label = choice.label()
    assert ShardingChoice.from_label(label, pinned=strategy) == choice  # tp's plan: the recipe's, lent back
    assert ShardingChoice.from_label(label).label() == label
    assert label.startswith(strategy.label()) and " " not in label
    assert (choice.knobs is None) == (knobs is None or knobs == Sharding())  # defaults spelt out: the same plan


def test_the_labels_of_studies_before_hsdp_and_tp_read_back_the_same():
    old = {"ddp": None, "fsdp": None, "fsdp:keep": {"reshard_after_forward": False},
           "fsdp:cpu": {"offload": "cpu"}, "fsdp:keep,cpu": {"reshard_after_forward": False, "offload": "cpu"}}
    for label, knobs in old.items():
        choice = ShardingChoice.from_label(label)
        assert choice.label() == label and choice.strategy.strategy == label.split(":")[0]
        assert choice.knobs == (Sharding(**knobs) if knobs else None)


@pytest.mark.parametrize("label", ["fsdp:kep", "fsdp:cpu,keep", "hsdp", "hsdp:02", "tp:1", "zero", "fsdp:2", "ddp:"])
def test_a_mistyped_label_is_refused_not_read_as_something_else(label):
    with pytest.raises(ValueError):
        ShardingChoice.from_label(label)


def test_an_older_studys_trial_reads_back_typed_with_its_plan_key(tmp_path):
    """A journal written before the types: its record's strategy was the label, its params the old
    labels, its key the label in `distributed`; resumed, each is the same plan as now."""
    from ckrun.autotune.search.study import open_study

    study, _ = open_study(tmp_path, {}, resume=False)
    space = build_space(load_recipe(BERT_TINY, TINY_BERT), _facts(None), CPU, nproc=2)
    params = {**space.all_params()[0], "sharding": "fsdp:keep"}
    plan = space.candidate(params).plan.model_dump(mode="json")
    old_key = json.dumps({"memory": plan, "precision": "fp32", "distributed": "fsdp"}, sort_keys=True)
    study.enqueue_trial(params)
    trial = study.ask(space.distributions())
    store_record(trial, TrialRecord(state="feasible", key=old_key, plan=plan, precision="fp32"))
    trial.set_user_attr("strategy", "fsdp")  # as the record was stored then
    study.tell(trial, 1.0)
    again, _ = open_study(tmp_path, {}, resume=True)
    record, stored = read_record(again.trials[0]), again.trials[0].params
    assert stored["sharding"] == "fsdp:keep" and record.strategy == FullySharded(strategy="fsdp")
    assert space.candidate(stored).key == record.key  # the same plan: a resumed study does not measure it again


# --- what the space offers -----------------------------------------------------------------------


def test_four_ranks_search_ddp_fsdp_hsdp_and_the_tp_sizes_the_heads_allow():
    space = build_space(_llama(), _facts(), CPU, nproc=4)
    assert space.choices["sharding"] == ["ddp", "fsdp", "fsdp:keep", "hsdp:2", "hsdp:2,keep", "tp:2", "tp:2,keep"]
    assert f"tp:4 not searched: {HEADS}" in space.reasons
    assert "FSDP's CPU offload not searched: it needs CUDA" in space.reasons
    assert space.choices["micro_batch"] == [1, 2, 4]  # tp:2's share is 4: its 2 groups of 2 ranks see the same
    gpu = build_space(_llama(), _facts({**LLAMA, "problems": {"2": None, "4": None}}), GPU, nproc=4)
    assert {"fsdp:cpu", "hsdp:2,cpu", "tp:2,cpu", "tp:4"} <= set(gpu.choices["sharding"])
    assert "tp:4,keep" not in gpu.choices["sharding"]  # no data-parallel ranks left for FSDP2 to split over
    assert any(line.startswith("memory.sharding not searched with tp:4") for line in gpu.reasons)


def test_a_model_without_a_plan_or_two_ranks_leave_tp_and_hsdp_out_with_their_reasons():
    space = build_space(_llama(), _facts(GPT2), CPU, nproc=2)
    assert space.choices["sharding"] == ["ddp", "fsdp", "fsdp:keep"]
    assert f"tp not searched: {NO_PLAN}" in space.reasons  # one line for every tensor size
    assert any(line.startswith("hsdp not searched: 2 ranks have no shard group") for line in space.reasons)
    six = build_space(_llama("train.batch_size=12"), _facts({**LLAMA, "problems": {"2": None, "3": None, "6": None}}),
                      CPU, nproc=6)
    assert [c for c in six.choices["sharding"] if c.startswith(("hsdp", "tp"))] == [
        "hsdp:2", "hsdp:2,keep", "hsdp:3", "hsdp:3,keep", "tp:2", "tp:2,keep", "tp:3", "tp:3,keep", "tp:6"]


def test_a_pinned_strategy_offers_its_own_variants_with_its_own_fields():
    hsdp = build_space(_llama("distributed={strategy: hsdp, shard: 2}", "memory.sharding.offload=none",
                              "memory.sharding.reshard_after_forward=false"), _facts(GPT2), CPU, nproc=4)
    assert hsdp.choices["sharding"] == ["hsdp:2,keep", "hsdp:2"]  # the recipe's own first
    plan = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    tp = build_space(_llama(f"distributed={{strategy: tp, tensor: 2, plan: {json.dumps(plan)}}}"), _facts(GPT2),
                     CPU, nproc=4)  # a plan of the recipe's own: the model's lack of one does not matter
    candidate = tp.candidate({**tp.all_params()[0], "sharding": "tp:2,keep"})
    assert candidate.strategy == TensorParallel(strategy="tp", tensor=2, plan=plan)
    assert candidate.recipe(tp.base, None).distributed.plan == plan
    ddp = build_space(_llama("distributed.strategy=ddp"), _facts(), CPU, nproc=4)
    assert ddp.fixed["sharding"] == "ddp" and "sharding" not in ddp.choices


def test_a_pinned_layout_the_ranks_do_not_fit_is_refused_before_anything_starts():
    from ckrun.autotune.outputs.rank_tune import check_ranks
    from ckrun.runner.problems import InputError

    with pytest.raises(InputError, match="shard groups of 3 ranks do not divide 4 ranks; use 2 or 4"):
        check_ranks(_llama("train.batch_size=12", "distributed={strategy: hsdp, shard: 3}"), "r.yaml", 4)


def test_a_micro_batch_over_its_strategys_share_is_told_invalid_by_the_ranks_check():
    space = build_space(_llama(), _facts(), CPU, nproc=4)
    base = space.all_params()[0]
    ddp = space.candidate({**base, "sharding": "ddp", "micro_batch": 4})
    assert invalid_reason(ddp, space) == ("memory.micro_batch: 4 does not divide a rank's share 2 (train.batch_size 8 "
                                          "over 4 ranks); use 2")
    assert invalid_reason(space.candidate({**base, "sharding": "tp:2", "micro_batch": 1}), space) is None


# --- the typed strategy on its way through the tuner's files -------------------------------------


@given(strategy=STRATEGIES, knobs=KNOBS)
def test_a_candidate_reaches_the_model_child_as_it_left(strategy, knobs):
    plan = MemoryPlan(micro_batch=2, sharding=knobs)
    candidate = Candidate(plan, "bf16", strategy)
    assert Candidate.from_request(json.loads(json.dumps(candidate.request()))) == candidate


def test_tuned_yaml_writes_the_whole_distributed_section_and_the_knobs_of_a_sharded_winner():
    from ckrun.runner.recipe.yamlio import Document

    from ckrun.autotune.outputs.tuned import tuned_data

    doc = Document(data={"model": {}, "distributed": {"strategy": "tp", "tensor": 4, "plan": {"a": "colwise"}}},
                   text="", source="r.yaml")
    plan = MemoryPlan(micro_batch=2).model_dump(mode="json")
    hsdp = TrialRecord(state="feasible", plan=plan, precision="bf16", strategy=HybridSharded(strategy="hsdp", shard=2))
    data = tuned_data(doc, hsdp, "1GB")
    assert data["distributed"] == {"strategy": "hsdp", "shard": 2}  # none of the recipe's tp fields left behind
    assert data["memory"]["sharding"] == {"reshard_after_forward": True, "offload": "none"}
    stored = TrialRecord.model_validate(hsdp.as_data())  # as the study's journal gives it back
    assert stored.strategy == hsdp.strategy


def test_the_model_child_asks_the_tensor_plan_check_for_each_size_the_ranks_offer():
    from ckrun.runner.builders.model import build_model

    llama = TensorFacts.from_json(json.loads(json.dumps(tensor_facts(build_model(_llama().model, "meta"), 4))))
    assert llama == TensorFacts("LlamaForCausalLM", {2: None, 4: HEADS})
    assert llama.problem(8) == "the model's facts say nothing of 8 ranks a tensor group"
    bert = TensorFacts.from_json(tensor_facts(build_model(load_recipe(BERT_TINY, TINY_BERT).model, "meta"), 2))
    assert bert.problem(2).startswith("BertForMaskedLM ships no tensor-parallel plan")


# --- the whole tune, predicted by a fake model child ---------------------------------------------


def test_tune_predict_on_four_ranks_ranks_every_strategy_and_writes_the_winners_section(tmp_path, monkeypatch, capsys):
    """`ckrun tune --nproc 4 --predict` through the CLI: the model child (tests/autotune/fake_model_child.py)
    reads each request back as a typed Candidate and prices it by formula (ddp never fits the cap,
    hsdp:2 keeping its gathered blocks is fastest); the space of 42 plans is predicted whole."""
    from ckrun.runner.cli import main
    from ckrun.runner.recipe.load import recipe_from_text
    from tune_helpers import HERE, report

    monkeypatch.setenv("CKRUN_MODEL_CHILD", "fake_model_child")
    monkeypatch.setenv("PYTHONPATH", f"{HERE}:{ROOT}")
    monkeypatch.setenv("FAKE_MODEL_COUNTER", str(tmp_path / "counter"))
    monkeypatch.setenv("FAKE_MODEL_TENSOR", json.dumps(LLAMA))
    code = main(["tune", str(ROOT / "recipes" / "llama_1b.yaml"), *TINY_LLAMA, "train.batch_size=4",
                 f"output.dir={tmp_path / 'run'}",
                 "--max-mem", "700MB", "--nproc", "4", "--predict", "--gpu", "cpu", "--trials", "64",
                 "--output", str(tmp_path / "tune")])
    assert code == 0, capsys.readouterr().err
    trials = report(tmp_path / "tune")["trials"]
    labels = {t["label"].split(",")[0] for t in trials if t["state"] == "feasible"}
    assert {"fsdp", "hsdp:2", "hsdp:2 (reshard_after_forward false)", "tp:2"} <= labels
    assert not any(t["label"].startswith("ddp") for t in trials if t["state"] == "feasible")  # over the cap
    told = {t["reason"].split(":")[0] for t in trials if t["state"] == "invalid"}
    assert told == {"memory.micro_batch"}  # 2 samples a micro-batch: more than a rank's share of 1 (but tp's)
    text = (tmp_path / "tune" / "tuned.yaml").read_text()
    tuned = recipe_from_text(text, "tuned.yaml")
    assert tuned.distributed == HybridSharded(strategy="hsdp", shard=2) and tuned.memory.micro_batch == 1
    assert tuned.memory.sharding == Sharding(reshard_after_forward=False)
    assert "train it:   ckrun" in text and "--nproc 4" in text
