"""`ckrun tune --nproc N`: the sharding knob in the space, the candidate recipes it makes, how a
probe group's ranks' results become one, and the checks made before anything starts (the choices'
labels, hsdp and tp: test_tune_sharding.py)."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckrun.autotune.records import TrialRecord
from ckrun.autotune.probes.rank_probe import combine
from ckrun.autotune.records import ProbeResult
from ckrun.autotune.outputs.rank_tune import check_devices, check_ranks, ranks_comment
from ckrun.autotune.space.sharding import ShardingChoice
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space, describe
from ckrun.autotune.space.validity import invalid_reason
from ckrun.autotune.outputs.tuned import tuned_data
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.problems import InputError
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.recipe.yamlio import Document

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "test")
GPU = Device("cuda", "gpu", 80 * 10**9, ("fp32", "fp16", "bf16"), "test", count=2)
FACTS = ModelFacts.from_json({"container_name": "encoder.layer", "blocks": [f"encoder.layer.{i}" for i in range(4)],
                              "containers": ["encoder.layer"] * 4})


def _recipe(*overrides: str) -> Recipe:
    return load_recipe(BERT_TINY, [*TINY_BERT, *overrides])


def test_without_nproc_the_space_has_no_sharding_knob():
    space = build_space(_recipe(), FACTS, CPU)
    assert "sharding" not in space.choices and "sharding" not in space.fixed
    assert space.candidate(space.all_params()[0]).strategy is None


def test_with_nproc_ddp_and_fsdp_are_searched_and_micro_batches_divide_a_ranks_share():
    space = build_space(_recipe("train.batch_size=8"), FACTS, CPU, nproc=2)
    assert space.choices["sharding"] == ["ddp", "fsdp", "fsdp:keep"]  # CPU offload needs CUDA
    assert space.choices["micro_batch"] == [1, 2, 4]  # the divisors of 8 / 2
    assert any("the tuner chooses how the ranks share the work" in reason for reason in space.reasons)
    gpu = build_space(_recipe("train.batch_size=8"), FACTS, GPU, nproc=2)
    assert "fsdp:cpu" in gpu.choices["sharding"]


def test_a_recipes_strategy_is_kept_ddp_pinned_and_fsdp_searched_from_its_own_knobs():
    pinned = build_space(_recipe("distributed.strategy=ddp"), FACTS, CPU, nproc=2)
    assert pinned.fixed["sharding"] == "ddp" and "sharding" not in pinned.choices
    fsdp = build_space(_recipe("distributed.strategy=fsdp", "memory.sharding.reshard_after_forward=false"),
                       FACTS, CPU, nproc=2)
    assert fsdp.choices["sharding"][0] == "fsdp:keep"  # the recipe's own first: the starting points use it
    assert set(fsdp.choices["sharding"]) == {"fsdp", "fsdp:keep"}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_point_of_a_ranked_space_is_a_recipe_the_trainer_accepts_or_is_told_invalid(data):
    nproc = data.draw(st.sampled_from([2, 4]), label="nproc")
    space = build_space(_recipe("train.batch_size=8"), FACTS, GPU, search_precision=True, nproc=nproc)
    params = data.draw(st.sampled_from(space.all_params()), label="params")
    candidate = space.candidate(params)
    choice = ShardingChoice(candidate.strategy, candidate.plan.sharding)
    assert choice.label() == params["sharding"]
    strategy = candidate.strategy.strategy
    reason = invalid_reason(candidate, space)
    if candidate.strategy.shards and (candidate.precision == "fp16" or candidate.plan.checkpointing.spans_blocks):
        assert reason and f"distributed.strategy {strategy}" in reason  # the recipe refuses it: no probe is spent
    if reason:
        return  # also a plan apply_plan refuses (offload with sqrt segments), as without --nproc
    recipe = candidate.recipe(_recipe("train.batch_size=8"), 10**9)  # told valid: the schema accepts it
    again = Recipe.model_validate_json(recipe.model_dump_json())  # what the probe child reads
    assert again.distributed == candidate.strategy
    assert (again.memory.sharding is not None) == (choice.knobs is not None)
    assert (8 // nproc) % again.memory.micro_batch == 0
    assert describe(candidate).startswith(choice.strategy.label())


def test_plans_that_differ_only_in_sharding_have_different_keys_and_labels():
    space = build_space(_recipe(), FACTS, CPU, nproc=2)
    base = space.all_params()[0]
    candidates = [space.candidate({**base, "sharding": value}) for value in space.choices["sharding"]]
    assert len({c.key for c in candidates}) == len(candidates)
    assert ShardingChoice.from_label("fsdp:keep").describe() == "fsdp (reshard_after_forward false)"


def test_tuned_yaml_carries_the_winners_strategy():
    doc = Document(data={"model": {}, "distributed": {"strategy": "fsdp"}}, text="", source="r.yaml")
    winner = TrialRecord(state="feasible", plan={"micro_batch": 2, "sharding": None}, precision="fp32",
                         strategy={"strategy": "ddp"})
    assert tuned_data(doc, winner, "1GB")["distributed"] == {"strategy": "ddp"}
    assert "2 ranks" in ranks_comment(2) and ranks_comment(1) is None


@pytest.mark.parametrize("overrides, nproc, message", [
    (["train.batch_size=6"], 4, "does not split over 4 ranks"),
    ([], 0, "needs a rank count of 1 or more"),
])
def test_bad_rank_counts_are_one_line(overrides, nproc, message):
    with pytest.raises(InputError, match=message):
        check_ranks(_recipe(*overrides), "r.yaml", nproc)


def test_a_micro_batch_the_recipe_pinned_does_not_stop_the_tuner_choosing_another(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    check_ranks(_recipe("train.batch_size=8", "memory.micro_batch=8"), "r.yaml", 2)  # 8 does not divide 4: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="already runs under torchrun"):
        check_ranks(_recipe(), "r.yaml", 2)


def test_more_ranks_than_gpus_is_refused():
    with pytest.raises(InputError, match="this machine has 2"):
        check_devices(GPU, 4)
    check_devices(CPU, 8)  # ranks on the CPU share its cores


# --- a probe group's ranks' results --------------------------------------------------------------

OK = ProbeResult(status="ok", samples_per_s=10.0, measured_peak_bytes=100)
REPORTS = {
    "ok": OK, "over_cap": ProbeResult(status="over_cap", reason="memory cap 1 MB exceeded", measured_peak_bytes=200),
    "oom": ProbeResult.failed("oom", "out of memory"), "bad_input": ProbeResult.failed("bad_input", "bad key"),
    "crash": ProbeResult.failed("crash", "RuntimeError: Connection closed by peer"), "none": None,
}
CODES = st.sampled_from([1, -signal.SIGKILL, -signal.SIGTERM, -signal.SIGSEGV])


@given(kinds=st.lists(st.sampled_from(sorted(REPORTS)), min_size=2, max_size=4), codes=st.lists(CODES, max_size=4))
def test_a_groups_result_names_the_rank_whose_failure_caused_the_others(kinds, codes):
    results = {rank: REPORTS[kind] for rank, kind in enumerate(kinds)}
    exit_codes = {rank: code for rank, code in enumerate(codes) if rank < len(kinds) and kinds[rank] != "ok"}
    combined = combine(results, exit_codes)
    assert ProbeResult.from_json(combined.to_json()) == combined  # written as the probe's result file
    if all(kind == "ok" for kind in kinds):
        assert combined.status == "ok" and combined.world_size == len(kinds)
        return
    assert combined.status != "ok" and combined.reason.startswith("rank ")
    if {"over_cap", "oom"} & set(kinds):
        assert combined.status in ("over_cap", "oom")  # the memory is the news, not the peers that lost it
    elif "bad_input" in kinds:
        assert combined.status == "bad_input"
    rank = int(combined.reason.split()[1])
    assert kinds[rank] != "ok"
    killed = [r for r, code in exit_codes.items() if kinds[r] == "none" and code not in (1, -signal.SIGTERM)]
    if killed and not {"over_cap", "oom", "bad_input"} & set(kinds):
        assert rank in killed and "was killed by" in combined.reason  # not a survivor torchrun stopped


def test_a_starting_point_moves_on_to_fsdp_when_no_ddp_micro_batch_is_predicted_to_fit():
    space = build_space(_recipe("train.batch_size=8"), FACTS, CPU, nproc=2)
    fits = lambda candidate: candidate.strategy.shards  # noqa: E731 - a prediction where only sharding fits
    starts = space.starting_points(_recipe(), fits)
    assert starts and all(start["sharding"] == "fsdp" and start["micro_batch"] == 4 for start in starts)
    assert all(start["sharding"] == "ddp" for start in space.starting_points(_recipe(), None))  # unpredicted: first


def test_an_invalid_plan_is_not_predicted_so_the_log_never_says_it_is_probed():
    """Issue 25, defect 6: the log said a fsdp+sqrt plan 'is probed' (the predictor's line for a plan
    it cannot model) while the trial marked it invalid; an invalid plan is never asked about."""
    import optuna

    from ckrun.autotune.cap import Cap
    from ckrun.autotune.search.tuner import Tuner

    space = build_space(_recipe("train.batch_size=8"), FACTS, CPU, nproc=2)
    asked = []
    tuner = Tuner(optuna.create_study(direction="maximize"), space, Cap(10**9, 0.05), evaluate=None,
                  predict=lambda candidate: asked.append(describe(candidate)) or 1000)
    base = {**space.all_params()[0], "sharding": "fsdp"}
    invalid, valid = (space.candidate({**base, "checkpointing": policy}) for policy in ("sqrt", "full"))
    assert invalid_reason(invalid, space) and not invalid_reason(valid, space)
    assert tuner.screening.peak(invalid) is None and tuner.screening.peak(valid) == 1000
    assert asked == [describe(valid)]
