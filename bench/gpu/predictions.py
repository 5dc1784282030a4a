"""What the plans call is judged by, made on a CPU: each plan's predicted peak, and the solver's plan.

`python bench/gpu/plans.py OUT --predict-only` writes OUT/predicted.json; committed as
bench/gpu/predicted_bert_large.json (with the versions it was made with), it is made before any GPU
time is spent. Without a committed file the GPU call predicts on its own CPU, and the tables say so.

- `predictions`: {"PLAN @ MICRO": {"peak_bytes", "live_peak_bytes", "breakdown", "recipe_hash",
  "predicted_step_s"}}: the step time the time model (runner/predict) gives on each GPU the
  campaign may be lent, keyed by the name torch reports ({"NVIDIA H100 80GB HBM3": s, ...}).
- `solver`: {"MICRO": {"memory": {checkpointing, offload}, "limit_bytes", "reason"}} or, where keeping
  every block is predicted to fit or nothing does, {"limit_bytes", "reason"} only. The limit is the
  tune call's (its cap less the margin less a CUDA context), as `ckrun tune` would ask the solver;
  untimed (`timed_steps=0`: on BERT-large every block costs the same, so the fewest recomputes win).
"""

from __future__ import annotations

import hashlib
import json

from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import GPUS

TIMED_ON = ("h100", "h200")  # the kinds this workplace lends; the plans call picks its own card's

CONTEXT_GUESS = 800 * 10**6  # the CUDA context with a BERT step's kernels, H100 + torch 2.11 (2026-11-22)


def recipe_hash(campaign, overrides: list[str]) -> str:
    """What a committed prediction must have been made for: the resolved recipe, not the override text.
    Fields at their defaults are left out, so that a field the schema gains (a new memory knob, off by
    default) leaves the recipes made before it, and their predictions, as they were."""
    recipe = load_recipe(campaign.recipe_path, overrides)
    return hashlib.sha256(recipe.model_dump_json(exclude_defaults=True).encode()).hexdigest()[:16]


def estimator_for(campaign) -> Estimator:
    return Estimator(load_recipe(campaign.recipe_path, list(campaign.base)), "cuda" if campaign.cuda else "cpu",
                     GPUS[TIMED_ON[0]])


def predict(campaign, entries: list[dict], estimator: Estimator | None = None) -> dict:
    """{plan key: prediction} for the given plans: one Estimator for all plans of the campaign's recipe (the
    micro-batch is in the plan), one more for each recipe a plan's overrides change beyond its memory plan (a
    knob's base without clipping, or in bf16)."""
    estimators = {_beyond_memory(load_recipe(campaign.recipe_path, list(campaign.base))): estimator} if estimator \
        else {}
    found = {}
    for entry in entries:
        key = entry["key"]
        if key in found:
            continue
        try:
            recipe = load_recipe(campaign.recipe_path, entry["overrides"])
            if _beyond_memory(recipe) not in estimators:
                estimators[_beyond_memory(recipe)] = Estimator(recipe, "cuda" if campaign.cuda else "cpu",
                                                               GPUS[TIMED_ON[0]])
            estimate = estimators[_beyond_memory(recipe)].estimate(recipe.memory)
            found[key] = {"peak_bytes": estimate.peak_bytes, "live_peak_bytes": estimate.live_peak_bytes,
                          "breakdown": estimate.breakdown,
                          "predicted_step_s": {name: estimate.time_on(facts).seconds
                                               for name, facts in cards(campaign).items()}}
        except Exception as err:  # an unpredictable plan is a finding, not the end of the campaign
            found[key] = {"error": one_line(err)}
        found[key]["recipe_hash"] = entry["recipe_hash"]
        print(f"predicted {key}: {found[key].get('peak_bytes', found[key].get('error'))}", flush=True)
    return found


def _beyond_memory(recipe) -> str:
    """What an Estimator is built for: the recipe but its memory plan."""
    return recipe.model_dump_json(exclude={"memory"})


def cards(campaign) -> dict:
    """{the name the plans step's versions give the device: its facts}: the GPUs this workplace lends,
    or, in a dry run, this CPU (so that the step-time comparison runs there too)."""
    if campaign.cuda:
        return {GPUS[g].name: GPUS[g] for g in TIMED_ON}
    import platform

    from ckrun.runner.predict.hardware import this_cpu

    return {f"cpu ({platform.machine()})": this_cpu()}  # as bench/gpu/facts.py's versions() names a CPU


def solve(campaign, none_overrides: dict[int, list[str]], estimator: Estimator | None = None) -> dict:
    """The solver's plan per micro-batch (see the module docstring), from `none`'s recipe at each."""
    from ckrun.autotune.search.solver import frontier

    estimator = estimator or estimator_for(campaign)
    recipe = load_recipe(campaign.recipe_path, list(campaign.base))
    found = {}
    for micro, overrides in none_overrides.items():
        base = load_recipe(campaign.recipe_path, overrides).memory
        limit = campaign.solver_limit or _midway(estimator, base, recipe.precision)
        proposals, lines = frontier(estimator, [(micro, recipe.precision)], limit, base, offload=False, timed_steps=0)
        found[str(micro)] = {"limit_bytes": limit, "reason": "; ".join(lines)}
        if proposals:
            plan = proposals[0].plan.model_dump(mode="json")
            found[str(micro)]["memory"] = {k: plan[k] for k in ("checkpointing", "offload")}
        print(f"solver @ {micro}: {found[str(micro)]['reason']}", flush=True)
    return found


def _midway(estimator: Estimator, base, precision: str) -> int:
    """A dry run's limit: halfway between keeping every block and recomputing every block, so the
    solver has a choice to make on a toy model too."""
    full = base.model_copy(update={"checkpointing": type(base).model_validate(
        {"checkpointing": {"policy": "full"}}).checkpointing})
    return (estimator.estimate(base, precision).peak_bytes + estimator.estimate(full, precision).peak_bytes) // 2


def solver_overrides(solved: dict) -> list[str] | None:
    """The solver's plan as recipe overrides, or None where it proposed none."""
    memory = solved.get("memory")
    if memory is None:
        return None
    return [f"memory.{key}={json.dumps(value)}" for key, value in memory.items()]


STALE = ("predicted_bytes", "predicted_note", "predicted_here_bytes", "predicted_step_s", "error", "error_here")


def repredict(campaign, results: dict) -> dict:
    """A call's measured plans (plans.json, knobs.json) predicted again here, with this checkout's
    model: the measurements stay the calibration data whatever the predictions were when they were
    made. A plan whose overrides now resolve to another recipe than the one measured is marked."""
    from bench.gpu import plan_results

    for entry in results["plans"]:
        for key in STALE:
            entry.pop(key, None)
        if entry["status"] == "ok" and recipe_hash(campaign, entry["overrides"]) != entry.get("recipe_hash"):
            entry["predicted_note"] = "re-predicted for what its overrides resolve to now: not the recipe measured"
    measured = [e for e in results["plans"] if e["status"] == "ok"]
    plan_results.attach_predictions(results, None, predict(campaign, measured))
    plan_results.conclude(results)
    results["figures"] = plan_results.figures(results)
    made = versions_here()
    results["predictions_from"] = f"re-predicted after the call on a CPU (torch {made['torch']}, {made['date']})"
    return results


def versions_here() -> dict:
    import datetime

    import torch

    return {"torch": torch.__version__, "date": datetime.date.today().isoformat()}


def one_line(err: BaseException) -> str:
    text = (str(err).strip().splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {text}"
