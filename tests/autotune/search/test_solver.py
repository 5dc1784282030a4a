"""The per-block solver: its dynamic programme is optimal (against brute force over random small
cost tables), and its plans are the recipe's own fields."""

from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from ckrun.autotune.search.solver import Option, plan_for, solve
from ckrun.runner.plan.memory_plan import MemoryPlan


def brute_force(blocks: list[list[Option]], budget: int) -> float | None:
    """The least total seconds over every assignment that satisfies the same conditions as solve()."""
    best = None
    for picks in itertools.product(*(range(len(options)) for options in blocks)):
        units, seconds, fits = 0, 0.0, True
        for options, pick in zip(blocks, picks, strict=True):
            option = options[pick]
            if units + option.transient > budget or units + option.saved > budget:
                fits = False
                break
            units, seconds = units + option.saved, seconds + option.seconds
        if fits and (best is None or seconds < best):
            best = seconds
    return best


def _feasible_seconds(blocks, picks, budget) -> float:
    units, seconds = 0, 0.0
    for options, pick in zip(blocks, picks, strict=True):
        option = options[pick]
        assert units + option.transient <= budget and units + option.saved <= budget
        units, seconds = units + option.saved, seconds + option.seconds
    return seconds


options = st.builds(Option, st.sampled_from(["keep", "recompute", "offload"]), st.integers(0, 40),
                    st.integers(0, 50).map(float), st.integers(0, 60))
tables = st.lists(st.lists(options, min_size=1, max_size=3), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(tables, st.integers(0, 150))
def test_the_programme_finds_the_brute_force_optimum(blocks, budget):
    expected = brute_force(blocks, budget)
    solved = solve(blocks, budget)
    if expected is None:
        assert solved is None
        return
    seconds, picks = solved
    assert seconds == expected
    assert _feasible_seconds(blocks, picks, budget) == seconds  # the picks it returns do what it says


def test_a_bigger_budget_never_costs_more_time():
    blocks = [[Option("keep", 10, 0.0), Option("recompute", 1, 3.0, 10)] for _ in range(8)]
    times = [solve(blocks, budget)[0] for budget in range(18, 90, 7)]
    assert times == sorted(times, reverse=True)


def test_choices_become_the_recipes_own_plan_fields():
    base = MemoryPlan(micro_batch=4)
    assert plan_for(["keep", "keep"], base).checkpointing.policy == "none"
    assert plan_for(["recompute", "recompute"], base).checkpointing.policy == "full"
    mixed = plan_for(["recompute", "keep", "offload", "recompute"], base)
    assert (mixed.checkpointing.policy, mixed.checkpointing.layers) == ("layers", [0, 3])
    assert (mixed.offload.policy, mixed.offload.layers, mixed.micro_batch) == ("layers", [2], 4)


@settings(max_examples=60, deadline=None)
@given(blocks=st.integers(1, 6), keep=st.integers(10_000, 50_000), recompute=st.integers(100, 2_000),
       head=st.integers(0, 200_000), slack=st.integers(0, 5_000))
def test_whenever_full_checkpointing_is_predicted_to_fit_the_solver_proposes_a_plan(blocks, keep, recompute,
                                                                                   head, slack):
    """A language model's base_bytes is mostly its head and loss (logits), gone before any block
    recomputes: a recompute must not be charged its activations on top of them."""
    from ckrun.autotune.search.solver import propose
    from ckrun.runner.predict.block_costs import BlockCost, CostTable

    base = 100_000 + head
    costs = [BlockCost(i, f"h.{i}", keep, recompute, keep // 2, None, None, 0.01, 0.01, 0.01, None)
             for i in range(blocks)]
    full_peak = base + blocks * recompute
    table = CostTable(4, "fp32", "cpu", base + blocks * keep, full_peak, base, costs)

    def predict(plan: MemoryPlan) -> int:  # the tracker's exact sum: no block's recompute goes over full_peak
        recomputed = set(range(blocks)) if plan.checkpointing.policy == "full" else \
            set(getattr(plan.checkpointing, "layers", []))
        return base + sum(recompute if i in recomputed else keep for i in range(blocks))

    proposal = propose(table, full_peak + slack, predict, MemoryPlan(micro_batch=4))
    assert proposal is not None and proposal.predicted_peak <= full_peak + slack


def test_the_blocks_choices_are_what_the_policy_types_declare():
    from ckrun.autotune.search.solver import actions

    assert [(a.name, a.field, a.per_block) for a in actions()] == [
        ("recompute", "checkpointing", True), ("selective", "checkpointing", False), ("offload", "offload", True)]
    assert [a.name for a in actions(offload=False)] == ["recompute", "selective"]


def test_a_policy_type_that_can_name_its_blocks_is_planned_block_by_block(monkeypatch):
    """No list of the solver's names the choices: once selective checkpointing says it can act on some
    blocks (`on_blocks`), the solver weighs it per block against recompute, and picks it where its
    costs are lower; until then it is only the every-block alternative."""
    from ckrun.autotune.search.solver import propose
    from ckrun.runner.plan.memory_plan import SelectiveCheckpointing
    from ckrun.runner.predict.block_costs import BlockCost, CostTable

    # selective saves nearly as much as recompute at a tenth of its time; 4 blocks, room for 2 kept
    costs = [BlockCost(i, f"h.{i}", 1000, 100, 150, None, None, 0.01, 0.01, 0.001, None) for i in range(4)]
    table = CostTable(4, "fp32", "cpu", 4000 + 500, 400 + 500, 500, costs)
    chosen = {}

    def predict(plan: MemoryPlan) -> int:
        chosen["plan"] = plan
        return 0  # everything fits: the costs decide

    limit = 500 + 2 * 1000 + 2 * 150
    whole = propose(table, limit, predict, MemoryPlan(micro_batch=4))
    assert whole.plan.checkpointing.policy == "selective" and "of every block" in whole.reason

    monkeypatch.setattr(SelectiveCheckpointing, "on_blocks", classmethod(
        lambda cls, blocks, count: {"policy": "layers", "layers": blocks} if blocks else None))
    per_block = propose(table, limit, predict, MemoryPlan(micro_batch=4))
    assert per_block.reason.startswith("micro_batch 4, fp32: selective blocks 2,3 (2 of 4 recomputed"), per_block.reason
    assert per_block.added_s < whole.added_s


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 4), keep=st.integers(10_000, 50_000), slack=st.integers(-30_000, 60_000),
       context=st.sampled_from([0, 804_000_000]), deadline=st.sampled_from([None, -1.0]))
def test_every_limit_the_solver_names_is_the_tunes_limit_context_included(blocks, keep, slack, context, deadline):
    """The header says `limit 22.8 GB` (the cap less the margin, the CUDA context counted); the solver
    works on the estimator's peaks (without the context) but must name the same limit, and a passed
    deadline (a --time-budget's share) stops it with a line instead of a plan."""
    import re
    from types import SimpleNamespace

    import ckrun.runner.predict.block_costs as block_costs
    from ckrun.autotune.search.solver import frontier
    from ckrun.runner.predict.block_costs import BlockCost, CostTable
    from ckrun.runner.units import format_bytes

    base, recompute = 100_000, 1_000
    costs = [BlockCost(i, f"h.{i}", keep, recompute, keep // 2, None, None, 0.01, 0.01, 0.01, None)
             for i in range(blocks)]
    table = CostTable(4, "fp32", "cpu", base + blocks * keep, base + blocks * recompute, base, costs)

    def estimate(plan, precision):
        recomputed = set(range(blocks)) if plan.checkpointing.policy in ("full", "selective") else \
            set(getattr(plan.checkpointing, "layers", []))
        return SimpleNamespace(peak_bytes=base + sum(recompute if i in recomputed else keep for i in range(blocks)))

    limit = base + blocks * keep // 2 + slack  # the estimator's limit: the card's less the context
    real, block_costs.cost_table = block_costs.cost_table, lambda *args, **kwargs: table
    try:
        _, lines = frontier(SimpleNamespace(estimate=estimate), [(4, "fp32")], limit, MemoryPlan(micro_batch=4),
                            context=context, seconds=deadline)
    finally:
        block_costs.cost_table = real
    named = [found for line in lines for found in re.findall(r"(?:limit|under) (\d+\.\d+ [kMG]?B)", line)]
    assert all(found == format_bytes(limit + context) for found in named), (format_bytes(limit + context), lines)
    if deadline is not None:
        assert lines == [lines[0]] and "not solved, the time budget's share" in lines[0]


def test_the_solvers_time_ends_between_any_two_estimates(monkeypatch):
    """A large model's cost table is many estimates: past its seconds the solver stops at the next one,
    keeping the lines so far, instead of finishing the micro-batch it is in."""
    import time as clock
    from types import SimpleNamespace

    from ckrun.autotune.search.solver import frontier
    from ckrun.runner.predict import block_costs

    def slow(plan, precision):
        clock.sleep(0.05)
        return SimpleNamespace(peak_bytes=10**12)  # nothing fits: the cost table is asked for next

    def table(estimator, *args, **kwargs):
        estimator.estimate(MemoryPlan(), "fp32")  # its first estimate, past the deadline
        raise AssertionError("the estimate above should have stopped the solver")

    monkeypatch.setattr(block_costs, "cost_table", table)
    proposals, lines = frontier(SimpleNamespace(estimate=slow), [(4, "fp32"), (2, "fp32")], 10**9,
                                MemoryPlan(micro_batch=4), seconds=0.01)
    assert proposals == [] and len(lines) == 1 and "stopped mid-way" in lines[0]


def test_the_solver_starts_no_trace_its_time_cannot_hold(monkeypatch):
    """A composer's estimate that needs a new trace is not started with less time left than a trace takes, nor
    is a cost table's block bytes past the deadline (an 8B's cost table ran 16 s past its share before):
    what was solved is kept, the rest said."""
    from types import SimpleNamespace

    from ckrun.autotune.search.solver import frontier
    from ckrun.runner.predict import block_costs

    asked = []

    def estimate(plan, precision):
        asked.append(plan.micro_batch)
        return SimpleNamespace(peak_bytes=10**12)  # nothing fits: the cost table is asked for next

    def table(estimator, *args, **kwargs):
        estimator.block_bytes(MemoryPlan(), "fp32")
        raise AssertionError("the block bytes above needed a trace the time left cannot hold")

    monkeypatch.setattr(block_costs, "cost_table", table)
    composer = SimpleNamespace(estimate=estimate, block_bytes=lambda plan, precision: None, trace_s=lambda: 60.0,
                               ready=lambda plan, precision: plan.micro_batch == 4)
    proposals, lines = frontier(composer, [(4, "fp32"), (2, "fp32")], 10**9, MemoryPlan(micro_batch=4), seconds=30)
    assert asked == [4]  # traced already: estimated; its cost table's trace, and micro-batch 2's, not started
    assert proposals == [] and len(lines) == 1 and "stopped mid-way" in lines[0]
