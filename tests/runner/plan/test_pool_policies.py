"""The pools' policies are types in the house's way: each in its union, each tuner label read back
as its policy, and `plan_problems` refusing exactly the combinations their capabilities rule out
(with the rest of the recipe too), each in one line starting with its key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from ckrun.runner.plan import pool_policies
from ckrun.runner.plan.choices import choice_fields
from ckrun.runner.plan.memory_plan import MemoryPlan, StepFacts, plan_problems
from ckrun.runner.plan.policy_base import PoolPolicy
from ckrun.runner.plan.pool_policies import POOL_KINDS


def test_every_pool_policy_class_is_in_its_union_and_says_its_pool():
    defined = [cls for cls in vars(pool_policies).values()
               if isinstance(cls, type) and cls.__module__ == pool_policies.__name__ and issubclass(cls, PoolPolicy)]
    members = {cls for kind in POOL_KINDS.values() for cls in kind}
    assert {cls for cls in defined if "policy" in cls.model_fields} == members
    for section, kind in POOL_KINDS.items():
        assert {cls.section for cls in kind} == {section}
        assert all(cls.pool in ("parameters", "gradients", "optimizer_state", "loss") for cls in kind)
        assert sum(not cls.active for cls in kind) == 1  # one default, which changes nothing
        assert MemoryPlan.model_fields[section].default_factory().active is False


@pytest.mark.parametrize("label", ["fp32", "fp32:uncached", "bf16", "full", "8bit", "4bit", "fp8", "8bit:embeddings",
                                   "after", "in_backward", "none", "cpu", "cpu:0.5", "cpu:0.25", "master", "whole",
                                   "chunked:8", "chunked:3"])
def test_a_label_reads_back_as_its_policy(label):
    section = next(s for s, kind in POOL_KINDS.items() if any(label.partition(":")[0] in c.tags() for c in kind)
                   and (s != "optimizer_offload" or label.startswith(("cpu", "none", "master"))))
    plan = MemoryPlan.model_validate({section: choice_fields(POOL_KINDS[section], label), "allow_lossy": True})
    assert getattr(plan, section).label() == label


def test_the_tuner_is_offered_only_labels_that_read_back():
    offered = {"weights": pool_policies.MasterWeights.tuner_labels("bf16") + pool_policies.BF16Weights.tuner_labels(),
               "optimizer_offload": [lab for cls in POOL_KINDS["optimizer_offload"] for lab in cls.tuner_labels("cuda")]}
    for section in ("optimizer_state", "optimizer_step", "loss"):
        offered[section] = [label for cls in POOL_KINDS[section] for label in cls.tuner_labels()]
    assert offered["optimizer_offload"] == ["none", "cpu:0.5", "cpu", "master"] and "fp32:uncached" in offered["weights"]
    assert [lab for cls in POOL_KINDS["optimizer_offload"] for lab in cls.tuner_labels("cpu")] == ["none"]
    assert pool_policies.MasterWeights.tuner_labels("fp32") == ["fp32"]  # no autocast: no cache to turn off
    for section, labels in offered.items():
        for label in labels:
            plan = MemoryPlan.model_validate({section: choice_fields(POOL_KINDS[section], label), "allow_lossy": True})
            assert getattr(plan, section).label() == label and "\n" not in getattr(plan, section).describe()


POOLS = st.fixed_dictionaries({
    "weights": st.sampled_from([{"policy": "fp32"}, {"policy": "fp32", "cast_cache": False}, {"policy": "bf16"}]),
    "optimizer_state": st.sampled_from([{"policy": "full"}, {"policy": "8bit"}, {"policy": "fp8"}]),
    "optimizer_step": st.sampled_from([{"policy": "after"}, {"policy": "in_backward"}]),
    "optimizer_offload": st.sampled_from([{"policy": "none"}, {"policy": "cpu"}, {"policy": "cpu", "fraction": 0.5},
                                          {"policy": "master"}]),
    "loss": st.sampled_from([{"policy": "whole"}, {"policy": "chunked", "chunks": 4}]),
    "allow_lossy": st.booleans(), "compile": st.booleans(), "micro_batch": st.sampled_from([None, 2, 4]),
})
FACTS = st.builds(StepFacts, batch_size=st.just(4), grad_clip=st.booleans(), precision=st.sampled_from(["fp32", "bf16", "fp16"]),
                  adamw=st.booleans(), distributed=st.booleans())


@settings(max_examples=300, deadline=None)
@given(data=POOLS, facts=st.none() | FACTS)
def test_a_plan_is_refused_exactly_where_its_pools_cannot_combine(data, facts):
    plan = MemoryPlan.model_validate(data)
    pools = {policy.section: policy for policy in plan.pool_policies()}  # a pool added to the table leaves these be
    weights, state, step, offload, loss = (pools[s] for s in ("weights", "optimizer_state", "optimizer_step",
                                                               "optimizer_offload", "loss"))
    lossy = {p.section for p in plan.pool_policies() if p.lossy and not plan.allow_lossy}
    expected = {(section,) for section in lossy}
    if offload.moves_state and (step.updates_in_backward or weights.lossy):  # low-bit state runs on the host
        expected.add(("optimizer_offload",))
    if loss.splits_head and plan.compile:
        expected.add(("loss",))
    if facts is not None:
        # on ranks a micro-batch is of a rank's share, which the world size decides: check_world judges it
        several = (plan.micro_batch or facts.batch_size) < facts.batch_size and not facts.distributed
        if step.updates_in_backward and (several or facts.grad_clip or facts.precision == "fp16"):
            expected.add(("optimizer_step",))
        if offload.moves_state and facts.precision == "fp16" or offload.masters_on_host and facts.precision != "bf16":
            expected.add(("optimizer_offload",))
        expected |= {(p.section,) for p in (weights, state) if p.library and not facts.adamw}
        if weights.holds_bf16 and facts.precision != "bf16":
            expected.add(("weights",))
    problems = plan_problems(plan, facts)
    assert {path for path, _ in problems} == expected
    assert all(message.startswith(f"memory.{path[0]}:") and "\n" not in message for path, message in problems)
