"""The child of tests/runner/plan/test_pool_table.py: a new kind of pool added to the one table
(runner/plan/pool_policies.py's POOL_KINDS) before anything else of ckrun is imported, as the developer's guide
says to add one (its policy classes, one entry, its applier), then what every consumer of the pools makes
of it, printed as one JSON object. Run as `python dummy_pool.py RECIPE OVERRIDE...`."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import ClassVar, Literal

from ckrun.runner.plan import pool_policies
from ckrun.runner.plan.policy_base import PoolPolicy


class DummyPolicy(PoolPolicy):
    """How the dummy pool is held: `kept`, or `squeezed` at a `level` (lossy)."""

    section: ClassVar[str] = "dummy"
    pool: ClassVar[str] = "loss"


class KeptDummy(DummyPolicy):
    policy: Literal["kept"] = "kept"
    """As it is."""
    active: ClassVar[bool] = False


class SqueezedDummy(DummyPolicy):
    policy: Literal["squeezed"]
    """Held otherwise (lossy)."""
    level: int = 1
    """How strongly."""
    lossy: ClassVar[bool] = True

    def label(self) -> str:
        return "squeezed" if self.level == 1 else f"squeezed:{self.level}"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"level": int(argument)}


pool_policies.POOL_KINDS["dummy"] = (KeptDummy, SqueezedDummy)  # the one entry; every import below comes after it

import torch  # noqa: E402 - the table is extended first
from torch import nn  # noqa: E402

from ckrun.autotune.probes.model_child import model_facts  # noqa: E402
from ckrun.autotune.space import pool_floor, pool_knobs  # noqa: E402
from ckrun.autotune.space.candidate import Candidate  # noqa: E402
from ckrun.autotune.space.facts import Device, ModelFacts  # noqa: E402
from ckrun.autotune.space.knobs import KNOBS, build_space  # noqa: E402
from ckrun.runner.plan.choices import choice_fields  # noqa: E402
from ckrun.runner.recipe.load import load_recipe  # noqa: E402
from ckrun.runner.memory import apply  # noqa: E402
from ckrun.runner.plan.memory_plan import POLICY_FIELDS, MemoryPlan, StepFacts, plan_problems  # noqa: E402
from ckrun.runner.problems import InputError  # noqa: E402
from ckrun.runner.recipe.recipe import Recipe  # noqa: E402
from ckrun.runner.train.checkpoint.fingerprint import fingerprint  # noqa: E402
from ckrun.runner.train.measure.update_error import lossy_labels  # noqa: E402

CPU = Device("cpu", "cpu", 0, ("fp32", "bf16"), "2.x")


@contextlib.contextmanager
def _marked(model: nn.Module, policy: SqueezedDummy):
    """The dummy pool's applier: marks the model while the plan is on it."""
    model.dummy_level = getattr(policy, "level", 0)
    try:
        yield f"applied {policy.label()}"
    finally:
        del model.dummy_level


def plan_side(recipe_path: str, overrides: list[str]) -> dict:
    on = [*overrides, "memory.dummy.policy=squeezed", "memory.dummy.level=3"]
    try:
        load_recipe(recipe_path, on)
        refused = []
    except InputError as err:
        refused = err.lines()
    recipe = load_recipe(recipe_path, [*on, "memory.allow_lossy=true"])
    plain = load_recipe(recipe_path, overrides)
    lossy_plan = MemoryPlan.model_validate({"dummy": {"policy": "squeezed"}, "allow_lossy": True})
    ranks = StepFacts(batch_size=8, grad_clip=False, precision="fp32", adamw=True, distributed=True)
    return {
        "fields": list(MemoryPlan.model_fields), "doc": MemoryPlan.model_fields["dummy"].description,
        "schema": sorted(Recipe.model_json_schema()["$defs"]["MemoryPlan"]["properties"]),
        "default": MemoryPlan().dummy.label(), "policy_fields": list(POLICY_FIELDS),
        "refused": refused, "changes": recipe.memory.pool_changes(),
        "read_back": choice_fields(pool_policies.POOL_KINDS["dummy"], "squeezed:3"),
        "fingerprints": [json.loads(fingerprint(r)["memory"]).get("dummy") for r in (plain, recipe)],
        "lossy_labels": lossy_labels(recipe),
        "on_ranks": [path for path, _ in plan_problems(lossy_plan, ranks)],
    }


def applied_side() -> dict:
    apply.POOL_APPLIERS["dummy"] = _marked  # the new pool's applying module gives its entry
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)])
    plan = MemoryPlan.model_validate({"dummy": {"policy": "squeezed", "level": 2}, "allow_lossy": True})
    applied = apply.apply_plan(model, plan, "cpu")
    during, part = getattr(model, "dummy_level", None), applied.pools.get("dummy")
    applied.remove()
    failing, linear = plan.model_copy(update={"blocks": "nowhere"}), nn.Linear(4, 4)
    try:  # the plan fails finding its blocks, after the dummy's part was applied
        apply.apply_plan(linear, failing, "cpu")
        failed = None
    except ValueError as err:
        failed = str(err)
    return {"during": during, "part": part, "after": hasattr(model, "dummy_level"), "failed": failed,
            "after_failure": hasattr(linear, "dummy_level")}


def tuner_side(recipe_path: str, overrides: list[str]) -> dict:
    recipe = load_recipe(recipe_path, overrides)
    facts = ModelFacts.from_json(model_facts(recipe))
    closed = build_space(recipe, facts, CPU)
    opened = build_space(recipe, facts, CPU, allow_lossy=True)
    knob = next(k for k in KNOBS if k.name == "dummy")
    written = knob.to_plan({"dummy": "squeezed:3"}, opened)
    candidate = Candidate(MemoryPlan.model_validate(written["memory"]), "fp32")
    return {
        "knobs": [k.name for k in KNOBS], "closed": closed.fixed.get("dummy"), "opened": opened.choices.get("dummy"),
        "reasons": [r for r in opened.reasons if r.startswith("dummy")],
        "written": written, "read": knob.from_plan(candidate, opened), "words": knob.words(candidate),
        "space_values": pool_knobs.space_values(opened).get("dummy"),
        "floor_plan": pool_floor.pool_plan({"dummy": "squeezed"}).model_dump(include={"dummy", "allow_lossy"}),
        "tuner_lossy": pool_knobs.lossy_labels("dummy"),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    path, overrides = sys.argv[1], sys.argv[2:]
    print(json.dumps({**plan_side(path, overrides), **applied_side(), **tuner_side(path, overrides)}))
