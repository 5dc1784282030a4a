"""The tuner's knob table (autotune/space/knobs.py): every knob reads back what it wrote, from a point of the
space to a plan and back (the values the space searches, drawn by hypothesis), and from a plan to a
point and back (the recipe's own plan, drawn from the policy types); the space, the log line and the
CLI's flags come from the table alone, so a new knob is one entry."""

from __future__ import annotations

import copy
import importlib.util
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckrun.autotune.cli_tune import add_arguments
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import KNOBS, build_space, describe
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.space import UNSAID, Space, grid_of
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.plan.choices import choice_class, choice_fields
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.pool_policies import POOL_KINDS
from ckrun.runner.plan.policies import CHECKPOINTING, COMPRESSION, OFFLOAD, checkpointing_choices, compression_choices

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")
GPU = Device("cuda", "NVIDIA H100", 80 * 10**9, ("fp32", "fp16", "bf16"), "2.x", "12.8")
OPEN = {knob.flag.dest: True for knob in KNOBS if knob.flag}  # every flag given: every knob searched


@cache
def _space(device: Device, nproc: int, flags: bool) -> Space:
    """bert_tiny with 4 blocks on text of varying length (the short-batch knob): every knob of the
    table joins a space on some device, world size and flags."""
    corpus = _corpus()
    recipe = load_recipe(BERT_TINY, [*TINY_BERT, "data.source=text", f"data.paths=[{corpus}]", "data.split=lines",
                                     "model.config.num_hidden_layers=4"])
    return build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device, nproc, **(OPEN if flags else {}))


@cache
def _corpus() -> str:
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="knob-table-")) / "lines.txt"
    path.write_text("short\n" * 10 + "a longer line of text\n")
    return str(path)


SPACES = [(GPU, 2, True), (GPU, 1, True), (CPU, 1, True), (CPU, 1, False)]


@st.composite
def _points(draw, space: Space) -> dict:
    """A value of every searched knob: a category, or a step of a numeric knob's grid."""
    return {name: draw(st.sampled_from(values)) for name, values in
            {**space.choices, **{name: _grid(space, name) for name in space.numeric}}.items()}


def _grid(space: Space, name: str) -> list:
    return grid_of(space.numeric[name])


def test_every_knob_of_the_table_is_searched_or_says_why_not():
    """A knob the spaces below never search would go untested here: each is searched in the open space
    or gives its reason (a torch without the feature)."""
    space = _space(GPU, 2, True)
    for knob in KNOBS:
        assert space.searched(knob.name) or any(knob.name in line for line in space.reasons), knob.name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), which=st.sampled_from(SPACES))
def test_each_knob_reads_back_the_value_it_wrote_into_the_plan(data, which):
    """point -> plan -> point -> plan: each knob's from_plan gives its value back, or (a value the plan
    does not keep: the budget of a plan that does not compile) one that makes the same plan."""
    space = _space(*which)
    point = data.draw(_points(space))
    candidate = space.candidate(point)
    read = {knob.name: knob.from_plan(candidate, space) for knob in space.knobs if space.searched(knob.name)}
    assert UNSAID not in read.values()
    assert space.candidate(read).key == candidate.key
    for name, value in read.items():
        assert value == point[name] or space.candidate({**point, name: value}).key == candidate.key, name


def _plans(space: Space) -> st.SearchStrategy[MemoryPlan]:
    """Plans a recipe may hold, over the space's blocks: the policies' own tuner labels and per-block
    lists (which join the choices), micro-batches that divide the batch, the allocators, compile with a
    budget on its grid, and a short-batch bucket at the space's short length."""
    count = len(_facts().blocks)
    subsets = st.lists(st.integers(0, count - 1), min_size=1, max_size=count, unique=True).map(sorted)
    checkpointing = st.one_of(st.sampled_from(checkpointing_choices(_facts().blocks)),
                              subsets.map(lambda s: "layers:" + ",".join(map(str, s))))
    offload = st.one_of(st.sampled_from(space.choices.get("offload", ["none"])),
                        subsets.map(lambda s: "layers:" + ",".join(map(str, s))))
    short = st.sampled_from(space.choices["short_checkpointing"])

    @st.composite
    def plan(draw):
        compiled = draw(st.booleans())
        label = draw(short)
        data = {"micro_batch": draw(st.sampled_from(space.choices["micro_batch"])),
                "checkpointing": choice_fields(CHECKPOINTING, draw(checkpointing)),
                "offload": choice_fields(OFFLOAD, draw(offload)),
                "allocator": draw(st.sampled_from([None, "expandable_segments:True"])), "compile": compiled,
                "activation_memory_budget": draw(st.sampled_from(_grid(space, "activation_memory_budget")))
                if compiled and space.numeric else None,
                "adaptive": [] if label == "same" else [{"max_len": space.fixed["short_len"],
                                                         "checkpointing": choice_fields(CHECKPOINTING, label)}]}
        compression = draw(st.sampled_from(compression_choices()))
        data.update({"compression": choice_fields(COMPRESSION, compression)})
        pools = {section: draw(st.sampled_from(space.choices.get(section, [space.fixed.get(section)])))
                 for section in POOL_KINDS if section in space.choices or section in space.fixed}
        data.update({section: choice_fields(POOL_KINDS[section], label) for section, label in pools.items()})
        data["allow_lossy"] = compression != "none" or any(choice_class(POOL_KINDS[s], label).lossy
                                                           for s, label in pools.items())
        return MemoryPlan.model_validate(data)

    return plan()


@cache
def _facts() -> ModelFacts:
    return ModelFacts.from_json(model_facts(_space(GPU, 1, True).base))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), precision=st.sampled_from(["fp32", "bf16", "fp16"]))
def test_a_recipes_own_plan_reads_as_a_point_that_makes_the_same_plan(data, precision):
    """plan -> point -> plan, for any plan a recipe may hold: its per-block lists join the choices."""
    space = copy.deepcopy(_space(GPU, 1, True))
    plan = data.draw(_plans(space))
    recipe = space.base.model_copy(update={"memory": plan, "precision": precision})
    point = space.own_point(recipe)
    assert point is not None
    candidate = space.candidate(point)
    assert candidate.plan == plan.model_copy(update={"blocks": space.blocks_path})
    assert candidate.precision == precision


def test_the_pool_knobs_search_their_exact_policies_by_default_and_lossy_ones_only_when_opened():
    """On a GPU every pool knob the model allows is searched; lossy labels join only with --allow-lossy."""
    closed, opened = _space(GPU, 1, False), _space(GPU, 1, True)
    for section in POOL_KINDS:
        assert not any(choice_class(POOL_KINDS[section], v).lossy for v in closed.choices.get(section, [])), section
        assert any(section in line for line in closed.reasons), section
    assert closed.choices["optimizer_offload"] == ["none", "cpu:0.5", "cpu", "master"]
    assert "fp32:uncached" not in closed.choices.get("weights", []) or closed.fixed.get("precision") != "fp32"
    if importlib.util.find_spec("torchao") is not None:
        assert {"8bit", "4bit"} <= set(opened.choices["optimizer_state"])
    cpu = _space(CPU, 1, False)
    assert "optimizer_offload" not in cpu.choices and cpu.fixed["optimizer_offload"] == "none"


def test_the_log_line_says_each_knob_in_the_tables_order():
    space = _space(GPU, 2, True)
    point = {name: values[-1] for name, values in space.choices.items()} | {"activation_memory_budget": 0.5}
    line = describe(space.candidate(point))
    words = [w for knob in KNOBS if (w := knob.words(space.candidate(point)))]
    assert line == ", ".join(words) and len(words) >= 8
    assert [line.index(w) for w in words] == sorted(line.index(w) for w in words)


def test_the_tune_command_has_each_knobs_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    assert {knob.flag.option for knob in KNOBS if knob.flag} <= options
