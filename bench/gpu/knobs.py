"""Step 3 of the GPU campaign: the memory knobs issue 33 adds beside the activation policies (the
optimizer step in backward, optimizer offload to the host, the loss over chunks, ...), each measured
against the same plan without it, where this checkout has them.

    python bench/gpu/knobs.py OUT_DIR [--dry-run] [--budget-s 40]
    python bench/gpu/knobs.py --list            # what this checkout offers, without measuring

Nothing here names a knob. A knob is a field of the recipe's memory plan (ckrun.runner.plan.MemoryPlan)
that the plans step does not already measure (`MEASURED_ELSEWHERE`), whose type is a union of
policy classes (runner/choices.py); each exact policy of it other than the field's default is one
knob to measure, written `memory.FIELD={DISCRIMINATOR: TAG}`; a flag (bool) is one knob, set true.
Lossy policies are left out (they need memory.allow_lossy and are measured by their own error).

Each knob runs on the plan that lets the most knobs be exact: the whole batch in one pass with full
checkpointing (small activations, so the pools the knobs act on show); where the recipe refuses it
there (issue 33: the optimizer step in backward is exact only without global clipping), once more
with train.grad_clip=null, and the refusal is recorded either way. Beside each base, the same plan
without any knob (`none`). Measured with the plans step's engine (plans.measure_entries): step time,
peaks, losses, predictions where the budget leaves time; OUT_DIR/knobs.json after every plan. With
no knob present, knobs.json says so and what was looked for: nothing is faked.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package
    sys.path.insert(0, str(REPO))

# the plan's fields as of issue 35's campaign: the plans step measures these, or they are not memory knobs
MEASURED_ELSEWHERE = frozenset({"micro_batch", "checkpointing", "offload", "blocks", "sharding", "compile",
                                "activation_memory_budget", "allocator", "adaptive", "compression", "allow_lossy",
                                "max_mem"})
KNOB_BASE = ("memory.micro_batch=null", "memory.checkpointing={policy: full}", "memory.offload={policy: none}")
UNCLIPPED = "train.grad_clip=null"
KNOB_S = 15  # one knob's plan on an H100: build, 7 steps, a counted one (as a plan of the plans step)


def _policy_classes(annotation) -> tuple[type, ...] | None:
    """The policy classes a field's type is a union of (or the one it is); None for anything else."""
    from ckrun.runner.choices import Choice

    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    classes = [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]
    if classes and all(isinstance(c, type) and issubclass(c, Choice) for c in classes):
        return tuple(classes)
    return None


def present(plan_class=None) -> tuple[list[dict], list[dict]]:
    """(knobs to measure, fields looked at and left out with the reason) in this checkout's plan."""
    from ckrun.runner.plan import MemoryPlan

    knobs, left = [], []
    for field, info in (plan_class or MemoryPlan).model_fields.items():
        if field in MEASURED_ELSEWHERE:
            continue
        if info.annotation is bool:
            knobs.append({"field": field, "label": f"{field}", "override": f"memory.{field}=true"})
            continue
        classes = _policy_classes(info.annotation)
        if classes is None:
            left.append({"field": field, "reason": f"neither a flag nor a union of policies ({info.annotation})"})
            continue
        default = info.get_default(call_default_factory=True)
        for cls in classes:
            if isinstance(default, cls):
                continue  # the plan without the knob: the baseline
            if getattr(cls, "lossy", False):
                left.append({"field": field, "policy": cls.tag(), "reason": "lossy: measured by its own error"})
                continue
            knobs.append({"field": field, "label": f"{field} {cls.tag()}", "policy": cls.__name__,
                          "override": f"memory.{field}={{{cls.discriminator}: {cls.tag()}}}"})
    return knobs, left


def _accepted(campaign, overrides: list[str]) -> str | None:
    """None where the recipe takes the overrides, else the first line of why not."""
    from ckrun.runner.load import load_recipe

    try:
        load_recipe(campaign.recipe_path, overrides)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a refusal is a finding
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return None


def knob_entries(campaign, knobs: list[dict]) -> list[dict]:
    """Entries for the plans engine: each base's `none` first, then its knobs; refusals recorded."""
    from bench.gpu import predictions
    from ckrun.runner.load import load_recipe

    batch = load_recipe(campaign.recipe_path, list(campaign.base)).train.batch_size
    bases = {(): [*campaign.base, *KNOB_BASE], (UNCLIPPED,): [*campaign.base, *KNOB_BASE, UNCLIPPED]}
    placed: dict[tuple, list[dict]] = {key: [] for key in bases}
    for knob in knobs:
        refusals = []
        for key, base in bases.items():
            why = _accepted(campaign, [*base, knob["override"]])
            if why is None:
                placed[key].append({**knob, "refused": refusals})
                break
            refusals.append({"with": list(key) or ["the recipe's training settings"], "reason": why})
        else:
            placed[()].append({**knob, "refused": refusals, "status": "refused"})
    entries = []
    for key, on_base in placed.items():
        if not on_base:
            continue
        suffix = f" ({', '.join(key)})" if key else ""
        for name, knob in [("none", None), *((k["label"], k) for k in on_base)]:
            overrides = [*bases[key], *([knob["override"]] if knob else [])]
            entry = {"name": name + suffix, "micro_batch": batch, "key": f"{name}{suffix} @ {batch}",
                     "overrides": overrides, "knob": knob}
            if knob and knob.get("status") == "refused":
                entry.update(status="skipped", reason="refused: " + "; ".join(r["reason"] for r in knob["refused"]))
            else:
                entry["recipe_hash"] = predictions.recipe_hash(campaign, overrides)
            entries.append(entry)
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU")
    parser.add_argument("--budget-s", type=float, default=40.0, help="this step's share of the call (default 40)")
    parser.add_argument("--list", action="store_true", help="print the knobs this checkout has and leave")
    args = parser.parse_args(argv)
    knobs, left = present()
    if args.list or args.out is None:
        print(json.dumps({"knobs": knobs, "left_out": left}, indent=1))
        return 0
    return measure(args, knobs, left)


def measure(args, knobs: list[dict], left: list[dict]) -> int:
    import torch

    from bench.gpu import plans
    from bench.gpu.budget import Budget, write_json

    args.out.mkdir(parents=True, exist_ok=True)
    looked = {"looked_for": "fields of ckrun.runner.plan.MemoryPlan beyond " + ", ".join(sorted(MEASURED_ELSEWHERE)),
              "knobs": knobs, "left_out": left}
    if not knobs:
        write_json(args.out / "knobs.json", {**looked, "status": "none present", "plans": []})
        print("knobs: none present in this checkout's memory plan", flush=True)
        return 0
    campaign = plans.DRY_RUN if args.dry_run else plans.GPU
    if args.dry_run:
        torch.set_num_threads(1)
    budget = Budget(args.budget_s)
    results = {**plans.start_results(campaign, None, {}), **looked, "status": "measured",
               "peak_flops_per_s": None, "snapshot": {"status": "skipped", "reason": "not taken for knobs"}}
    plans.measure_entries(campaign, knob_entries(campaign, knobs), results, args.out, budget, "knobs.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
