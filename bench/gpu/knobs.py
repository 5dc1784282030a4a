"""Step of the GPU campaign: the pool knobs beside the activation policies (the optimizer step in backward,
the optimizer's offload to the host with its pinned copies and host AdamW, the loss over chunks, torchao's
8-bit, 4-bit and fp8 AdamW, bf16 weights with a stochastically rounded update) each measured against the
same plan without it, and a mixture of experts run by transformers' grouped_mm kernel against its eager
loop: predicted against measured peak and step time for each.

    python bench/gpu/knobs.py OUT_DIR [--dry-run] [--budget-s 120]
    python bench/gpu/knobs.py --list            # what this checkout offers, without measuring

Nothing here names a knob. A knob is a field of the recipe's memory plan (ckrun.runner.plan.memory_plan.MemoryPlan)
that the plans step does not already measure (`MEASURED_ELSEWHERE`), whose type is a union of
policy classes (runner/plan/choices.py); each tag of each policy other than the field's default is one knob
to measure, written `memory.FIELD={DISCRIMINATOR: TAG}`; a flag (bool) is one knob, set true. A lossy
policy is measured with memory.allow_lossy=true beside it (its error is the trainer's own measurement).

Each knob runs on the plan that lets the most knobs be exact: the whole batch in one pass with full
checkpointing (small activations, so the pools the knobs act on show); where the recipe refuses it
there (the optimizer step in backward is exact only without global clipping), once more with
train.grad_clip=null, or precision=bf16 (bf16 weights need bf16 autocast), and the refusal is recorded
either way. Beside each base, the same plan without
any knob (`none`). Measured with the plans step's engine (plans.measure_entries): step time, peaks,
losses; each entry's prediction (the committed file's, or made on the GPU machine's CPU at the end when
the budget leaves time) sits beside it. The experts comparison (`EXPERTS`) runs on a Mixtral recipe and
lands in knobs.json's "experts". A dry run runs the same code at toy size on the CPU: knobs a CPU
refuses (the host offload is CUDA only) are recorded refused with the reason, and still predicted.
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
LOSSY = "memory.allow_lossy=true"
HALF = "precision=bf16"  # bf16 weights need bf16 autocast: the base for them where the recipe trains in fp32 (the dry run)
KNOB_S = 10  # one knob's plan on an H100: build, 7 steps, a counted one (BERT-large: 0.22 s a step)


def _policy_classes(annotation) -> tuple[type, ...] | None:
    """The policy classes a field's type is a union of (or the one it is); None for anything else."""
    from ckrun.runner.plan.choices import Choice

    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    classes = [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]
    if classes and all(isinstance(c, type) and issubclass(c, Choice) for c in classes):
        return tuple(classes)
    return None


def present(plan_class=None) -> tuple[list[dict], list[dict]]:
    """(knobs to measure, fields looked at and left out with the reason) in this checkout's plan."""
    from ckrun.runner.plan.memory_plan import MemoryPlan

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
            lossy = bool(getattr(cls, "lossy", False))
            for tag in cls.tags():
                knobs.append({"field": field, "label": f"{field} {tag}", "policy": cls.__name__, "lossy": lossy,
                              "override": f"memory.{field}={{{cls.discriminator}: {tag}}}",
                              "extra": [LOSSY] if lossy else []})
    return knobs, left


def _accepted(campaign, overrides: list[str]) -> str | None:
    """None where the recipe takes the overrides, else the first line of why not."""
    from ckrun.runner.recipe.load import load_recipe

    try:
        load_recipe(campaign.recipe_path, overrides)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - a refusal is a finding
        return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return None


def knob_entries(campaign, knobs: list[dict]) -> list[dict]:
    """Entries for the plans engine: each base's `none` first, then its knobs; refusals recorded."""
    from bench.gpu import predictions
    from ckrun.runner.recipe.load import load_recipe

    batch = load_recipe(campaign.recipe_path, list(campaign.base)).train.batch_size
    bases = {(): [*campaign.base, *KNOB_BASE], (UNCLIPPED,): [*campaign.base, *KNOB_BASE, UNCLIPPED],
             (HALF,): [*campaign.base, *KNOB_BASE, HALF]}
    placed: dict[tuple, list[dict]] = {key: [] for key in bases}
    for knob in knobs:
        refusals = []
        for key, base in bases.items():
            why = _accepted(campaign, [*base, *_knob_overrides(knob)])
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
            overrides = [*bases[key], *(_knob_overrides(knob) if knob else [])]
            entry = {"name": name + suffix, "micro_batch": batch, "key": f"{name}{suffix} @ {batch}",
                     "overrides": overrides, "knob": knob}
            if knob and knob.get("status") == "refused":
                entry.update(status="skipped", reason="refused: " + "; ".join(r["reason"] for r in knob["refused"]))
            else:
                entry["recipe_hash"] = predictions.recipe_hash(campaign, overrides)
            entries.append(entry)
    return entries


def _knob_overrides(knob: dict) -> list[str]:
    return [knob["override"], *knob.get("extra", [])]


# a mixture of experts: transformers' grouped_mm experts (one grouped product over all experts) against its
# eager loop over the experts hit, on Mixtral's layer at a width that fills an H100 (the dry run: a toy's)
EXPERTS = ("experts grouped_mm", "experts eager")
# the dry run's: recipes/mixtral_tiny.yaml made smaller still (2 blocks of 32, 4 experts, 32 positions), so its two
# measured plans and predictions take a second each on a CPU, not several
MOE_DRY_RUN = ("train.device=cpu", "model.config.vocab_size=256", "model.config.hidden_size=32",
               "model.config.intermediate_size=64", "model.config.num_hidden_layers=2", "model.config.num_local_experts=4",
               "model.config.max_position_embeddings=32", "data.seq_len=32", "train.batch_size=4")
MOE_GPU = ("train.device=cuda", "model.config.hidden_size=1024", "model.config.intermediate_size=2048",
           "model.config.num_attention_heads=16", "model.config.num_key_value_heads=4",
           "model.config.max_position_embeddings=1024", "data.seq_len=1024", "train.batch_size=16")


def experts_campaign(dry_run: bool):
    from dataclasses import replace

    from bench.gpu import plans

    base = plans.DRY_RUN if dry_run else plans.GPU
    return replace(base, recipe="recipes/mixtral_tiny.yaml", base=MOE_DRY_RUN if dry_run else MOE_GPU,
                   micro_batches=(None,), solver_limit=None)


def experts_entries(campaign) -> list[dict]:
    from bench.gpu import predictions

    entries = []
    for name in EXPERTS:
        overrides = [*campaign.base, f"model.config.experts_implementation={name.split()[-1]}"]
        entries.append({"name": name, "micro_batch": None, "key": f"{name} @ whole batch", "overrides": overrides,
                        "knob": {"field": "model.config.experts_implementation", "label": name},
                        "recipe_hash": predictions.recipe_hash(campaign, overrides)})
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU")
    parser.add_argument("--budget-s", type=float, default=120.0, help="this step's share of the call (default 120)")
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
    looked = {"looked_for": "fields of ckrun.runner.plan.memory_plan.MemoryPlan beyond " + ", ".join(sorted(MEASURED_ELSEWHERE)),
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
    results["experts"] = measure_experts(args, budget)
    write_json(args.out / "knobs.json", results)
    return 0


def measure_experts(args, budget) -> dict:
    """The experts comparison, measured through the same engine into a file of its own, then folded into
    knobs.json (a call brings back at most 8 files)."""
    from bench.gpu import plans

    campaign = experts_campaign(args.dry_run)
    if not args.dry_run and not budget.allows(2 * campaign.plan_s):
        return {"status": "skipped", "reason": f"{budget.left():.0f} s left of the knobs step"}
    results = {**plans.start_results(campaign, None, {}), "status": "measured", "peak_flops_per_s": None,
               "snapshot": {"status": "skipped", "reason": "not taken for the experts"}}
    scratch = args.out / "experts.json"
    try:
        return plans.measure_entries(campaign, experts_entries(campaign), results, args.out, budget, scratch.name)
    finally:
        scratch.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
