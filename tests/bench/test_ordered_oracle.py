"""The ordered oracle (bench/ordered_oracle.py) finds the plan that pricing every plan whole finds: on a
tiny Llama, a grid of plans over the knobs the oracle's bounds drop (checkpointing, activation offload,
compression) and one they keep (the micro-batch) is priced whole by the composer, and for caps from the
tightest to the loosest the oracle, which prices a plan's memory only once its step time is the
smallest left, gives the fastest plan that fits, with no step time under its bound."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckrun.runner.plan.choices import choice_fields
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.policies import CHECKPOINTING, COMPRESSION, OFFLOAD
from ckrun.runner.plan.pool_policies import POOL_KINDS
from ckrun.runner.predict.compose import Composer
from ckrun.runner.predict.parts import PartsEstimator
from ckrun.runner.recipe.load import load_recipe
from bench.ordered_oracle import ordered_optimum
from tests.runner.predict.test_compose import FACTS, LLAMA

ROOT = Path(__file__).resolve().parents[2]
GRID = {"micro_batch": [1, 4], "checkpointing": ["none", "full", "every:2", "every:3", "selective"],
        "offload": ["none", "all"], "compression": ["none", "bf16"]}  # what the oracle's bounds drop, and what they keep
WIDE = ["model.config.hidden_size=512", "model.config.intermediate_size=1024", "model.config.vocab_size=4096",
        "data.seq_len=256"]  # wide enough that the plans' peaks differ by more than the allocator's 2 MB pages
KINDS = {"checkpointing": CHECKPOINTING, "offload": OFFLOAD, "compression": COMPRESSION, **POOL_KINDS}


@dataclass(frozen=True)
class Planned:
    plan: MemoryPlan
    precision: str


def grid(composer: Composer) -> list[Planned]:
    recipe, candidates = composer.recipe, []
    for values in itertools.product(*GRID.values()):
        labels = dict(zip(GRID, values, strict=True))
        memory = {"micro_batch": labels.pop("micro_batch"), "allow_lossy": True, "blocks": recipe.memory.blocks,
                  **{section: choice_fields(KINDS[section], label) for section, label in labels.items()}}
        candidate = Planned(MemoryPlan.model_validate(memory), recipe.precision)
        try:
            composer.estimator.check(candidate.plan, candidate.precision)
        except ValueError:
            continue
        candidates.append(candidate)
    return candidates


@pytest.mark.slow  # 45 s of CPU: 40 plans priced whole, their traces made
def test_the_ordered_oracle_finds_the_fastest_plan_that_fits_as_pricing_every_plan_does():
    recipe = load_recipe(ROOT / "recipes" / "llama3_8b.yaml", [*LLAMA, *WIDE, "train.grad_clip=null",
                                                                    "memory.micro_batch=null"])
    composer = Composer(PartsEstimator(recipe, "cuda", FACTS))
    candidates = grid(composer)
    whole = [composer.estimate(c.plan, c.precision) for c in candidates]
    peaks = sorted({e.peak_bytes for e in whole})
    assert len(candidates) == 40 and len(peaks) > 20
    for limit in [peaks[0] - 1, *(peaks[int(q * (len(peaks) - 1))] for q in (0.0, 0.1, 0.3, 0.6, 1.0))]:
        fits = [e.time.samples_per_s for e in whole if e.peak_bytes <= limit]
        found = ordered_optimum(composer, candidates, limit)
        assert not found.violations
        if not fits:
            assert found.best is None
            continue
        assert found.best["samples_per_s"] == max(fits)
    assert found.priced == 1  # the loosest cap: the fastest plan fits, the only one priced
