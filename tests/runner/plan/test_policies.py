"""Memory policies are types: every choice is one class that answers for itself, and nothing outside
runner/plan/policies.py decides by a policy's name."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT
from ckrun.runner.plan import policies
from ckrun.runner.plan.memory_plan import POLICY_FIELDS, MemoryPlan, plan_problems
from ckrun.runner.plan.policies import (CHECKPOINTING, COMPRESSION, OFFLOAD, CheckpointingPolicy, CompressionPolicy, OffloadPolicy,
                             checkpointing_choices, compression_choices, offload_choices, sqrt_segments)
from ckrun.runner.plan.choices import choice_fields
from ckrun.runner.recipe.data import SECTIONS as DATA_SECTIONS


@dataclass
class Layout:
    count: int
    containers: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.count


def _compares_name(node: ast.AST, field: str = "policy", names: set[str] | None = None) -> bool:
    """`x.policy == "sqrt"`, `part.policy in (...)`, `policy != "none"`: deciding by a policy's (or, with
    field="strategy", a distributed strategy's) name; with `names`, only by one of those (a data
    source's, not a model's `source: transformers`)."""
    if not isinstance(node, ast.Compare):
        return False
    operands = [node.left, *node.comparators]
    named = any(isinstance(o, ast.Attribute) and o.attr == field or isinstance(o, ast.Name) and o.id == field
                for o in operands)
    constants = [o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)]
    constants += [e.value for o in operands if isinstance(o, ast.Tuple | ast.List | ast.Set) for e in o.elts
                  if isinstance(e, ast.Constant)]
    listed = any(isinstance(o, ast.Tuple) for o in operands)
    return named and (bool(names & set(constants)) if names is not None else bool(constants) or listed)


def _name_comparisons(folders: tuple[str, ...], field: str, home: str, names: set[str] | None = None) -> list[str]:
    found = []
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / home:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if _compares_name(node, field, names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_code_outside_the_policy_types_decides_by_a_policy_name():
    found = _name_comparisons(("runner", "autotune", "bench"), "policy", "runner/plan/policies.py")
    assert not found, f"ask the policy type instead: {found}"


def test_no_runner_code_decides_by_a_distributed_strategys_name():
    """runner/plan/strategies.py answers for each strategy (shards, mesh_dims, data_parallel, world_problem);
    autotune's `sharding` choices are strings of the tuner's own and are not checked here."""
    found = _name_comparisons(("runner", "bench"), "strategy", "runner/plan/strategies.py")
    assert not found, f"ask the strategy type instead: {found}"


def test_no_code_outside_the_data_sections_decides_by_a_data_sources_name():
    """runner/recipe/data.py's sections answer for themselves (tasks, finite, held_out, tokenised,
    varying_length); `model.source` (transformers, torchvision, python) is another field and not checked."""
    found = _name_comparisons(("runner", "autotune", "bench"), "source", "runner/recipe/data.py",
                              {cls.tag() for cls in DATA_SECTIONS})
    assert not found, f"ask the data section instead: {found}"


def test_the_check_finds_what_it_looks_for():
    tree = ast.parse('a = x.policy == "sqrt"\nb = policy in ("full", "none")\nc = x.every == 2\nd = s.strategy != "fsdp"')
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    assert [_compares_name(n) for n in compares] == [True, True, False, False]
    assert [_compares_name(n, "strategy") for n in compares] == [False, False, False, True]
    sources = ast.parse('a = data.source != "synthetic"\nb = spec.source == "transformers"\nc = d.source in ("text", "x")')
    compares = [n for n in ast.walk(sources) if isinstance(n, ast.Compare)]
    assert [_compares_name(n, "source", {"synthetic", "text"}) for n in compares] == [True, False, True]


def test_every_policy_class_is_in_its_union():
    defined = [cls for cls in vars(policies).values() if isinstance(cls, type) and cls.__module__ == policies.__name__]
    for base, union in ((CheckpointingPolicy, CHECKPOINTING), (OffloadPolicy, OFFLOAD), (CompressionPolicy, COMPRESSION)):
        assert {c for c in defined if issubclass(c, base) and c is not base} == set(union)


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 40), stacks=st.integers(1, 3))
def test_each_tuner_choice_reads_back_as_its_policy_and_acts_on_real_blocks(count, stacks):
    layout = Layout(count, [f"stack{i * stacks // count}" for i in range(count)])
    for label in checkpointing_choices(layout):
        policy = MemoryPlan.model_validate({"checkpointing": choice_fields(CHECKPOINTING, label)}).checkpointing
        assert policy.label() == label
        chosen = policy.chosen(layout)
        assert chosen == sorted(set(chosen)) and all(0 <= i < count for i in chosen)
        assert sorted(i for region in policy.regions(layout) for i in region) == chosen
        assert policy.recomputes == bool(chosen) or label == "sqrt"
    for label in offload_choices("cuda") + compression_choices():
        kind = OFFLOAD if label in offload_choices("cuda") else COMPRESSION
        key = "offload" if kind is OFFLOAD else "compression"
        assert getattr(MemoryPlan.model_validate({key: choice_fields(kind, label), "allow_lossy": True}), key).label() == label


@given(stride=st.integers(1, 64))
def test_selective_at_a_product_stride_reads_back_from_its_label(stride):
    """A recipe's selective plan keeps its stride through the tuner's label (its starting plan, tuned.yaml)."""
    policy = MemoryPlan.model_validate({"checkpointing": {"policy": "selective", "products_kept_every": stride}}).checkpointing
    again = MemoryPlan.model_validate({"checkpointing": choice_fields(CHECKPOINTING, policy.label())}).checkpointing
    assert again == policy


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 30), data=st.data())
def test_a_policy_written_for_a_set_of_blocks_acts_on_exactly_those(count, data):
    """What the per-block solver writes (`on_blocks`) is a plan whose policy acts on the blocks it was
    given, and says so in its `block_action`; a class that cannot say the set answers None."""
    chosen = data.draw(st.one_of(st.just([]), st.just(list(range(count))),
                                 st.lists(st.integers(0, count - 1), unique=True).map(sorted)))
    for key, classes in POLICY_FIELDS.items():
        for cls in classes:
            written = cls.on_blocks(chosen, count)
            if written is None:
                continue
            policy = getattr(MemoryPlan.model_validate({key: written, "allow_lossy": True}), key)
            assert type(policy) is cls and policy.block_action is not None
            assert policy.chosen(Layout(count)) == chosen
            assert (policy.block_action == "keep") == (not chosen)


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 30), layers=st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True))
def test_a_layer_list_names_blocks_that_exist_or_says_which_does_not(count, layers):
    policy = MemoryPlan.model_validate({"checkpointing": {"policy": "layers", "layers": layers}}).checkpointing
    if max(layers) < count:
        assert policy.chosen(Layout(count)) == sorted(layers)
        assert choice_fields(CHECKPOINTING, policy.label()) == {"policy": "layers", "layers": sorted(layers)}
    else:
        with pytest.raises(ValueError, match=r"memory.checkpointing.layers: block (\d+) is out of range") as refused:
            policy.chosen(Layout(count))
        named = int(refused.value.args[0].split("block ")[1].split()[0])
        assert named in layers and named >= count


def test_sqrt_segments_keep_the_last_and_stay_inside_their_container():
    layout = Layout(10, ["encoder"] * 5 + ["decoder"] * 5)
    assert sqrt_segments(layout) == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]
    sqrt = MemoryPlan.model_validate({"checkpointing": {"policy": "sqrt"}}).checkpointing
    assert sqrt.regions(layout) == [[0, 1, 2], [3, 4], [5, 6, 7]] and sqrt.spans_blocks and not sqrt.switchable


PLANS = st.fixed_dictionaries({
    "checkpointing": st.sampled_from([{"policy": "none"}, {"policy": "full"}, {"policy": "sqrt"}, {"policy": "selective"},
                                      {"policy": "every", "every": 2}]),
    "offload": st.sampled_from([{"policy": "none"}, {"policy": "all"}]),
    "compression": st.sampled_from([{"policy": "none"}, {"policy": "bf16"}]),
    "compile": st.booleans(), "allow_lossy": st.booleans(),
    "adaptive": st.sampled_from([[], [{"max_len": 8, "checkpointing": {"policy": "full"}}]]),
    "activation_memory_budget": st.sampled_from([None, 0.5]),
})


@settings(max_examples=200, deadline=None)
@given(data=PLANS)
def test_a_plan_is_refused_exactly_where_its_policies_cannot_combine(data):
    plan = MemoryPlan.model_validate(data)
    spans, moves, lossy = plan.checkpointing.spans_blocks, plan.offload.moves, plan.compression.lossy
    expected = {
        ("activation_memory_budget",): data["activation_memory_budget"] is not None and not plan.compile,
        ("adaptive",): bool(plan.adaptive) and spans,
        ("checkpointing",): plan.compile and spans,
        ("offload",): moves and (plan.compile or spans),
        ("compression",): lossy and (not plan.allow_lossy or plan.compile or spans),
    }
    assert {path for path, _ in plan_problems(plan)} == {path for path, refused in expected.items() if refused}
    assert all(message.startswith(f"memory.{path[0]}:") for path, message in plan_problems(plan))
