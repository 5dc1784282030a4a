"""The plans call's conclusions, recomputed from whatever has been measured so far (the call writes
plans.json after every plan, so a call cut short still concludes): predictions against the measured
peaks, the loss noise floor, and MFU beside HFU.

MFU and HFU. FlopCounterMode counts the FLOPs a step dispatches, recompute included. MFU counts the
model's FLOPs, those of the step with no plan (`none`), whatever the plan does; HFU counts the
FLOPs the plan's step really ran (full checkpointing about 4/3 of them: one more forward of the
blocks). A compiled step is counted as its eager step: dynamo does not trace under a dispatch mode,
and the partitioner's own recompute is pointwise work, which FLOP counting leaves out anyway.
"""

from __future__ import annotations

import statistics

REPEAT = "none (repeat)"  # the second run of `none`: the loss noise floor
NOISE_MULTIPLE = 3  # a plan's loss difference within 3x the floor is run-to-run noise
LOSS_ATOL = 1e-6  # where the floor is 0 (deterministic CPU steps), float rounding of the loss itself
EAGER_MFU_GOAL, COMPILED_MFU_GOAL = 0.35, 0.45
PEAK_ERROR_GOALS = (0.03, 0.08)  # median, worst |predicted - measured| / measured


def attach_predictions(results: dict, committed: dict | None, here: dict | None) -> None:
    card = results.get("versions", {}).get("device")
    for entry in results["plans"]:
        if "recipe_hash" not in entry:  # a knob the recipe refuses: nothing to predict
            continue
        key, wanted = entry["key"], entry["recipe_hash"]
        made = (committed or {}).get(key)
        if made and made.get("recipe_hash") == wanted and "peak_bytes" in made:
            entry["predicted_bytes"] = made["peak_bytes"]
            step = step_on(made.get("predicted_step_s"), card)  # the time model's, on this call's card
            if step is not None:
                entry["predicted_step_s"] = step
        elif made:
            entry["predicted_note"] = "the committed prediction is for another recipe or failed: not used"
        if here and key in here and "peak_bytes" in here[key]:
            entry["predicted_here_bytes"] = here[key]["peak_bytes"]
            step = step_on(here[key].get("predicted_step_s"), card)
            if step is not None and "predicted_step_s" not in entry:  # the committed one, where there is one
                entry["predicted_step_s"] = step


def step_on(predicted, card: str | None) -> float | None:
    """The predicted step time for `card` from {card name: seconds} (a bare number: made for any card)."""
    if isinstance(predicted, dict):
        return predicted.get(card)
    return predicted


def conclude(results: dict) -> None:
    ok = [p for p in results["plans"] if p["status"] == "ok"]
    for plan in ok:
        for source, target in (("predicted_bytes", "error"), ("predicted_here_bytes", "error_here")):
            if plan.get(source) is not None and plan["measured_peak_bytes"]:
                plan[target] = (plan[source] - plan["measured_peak_bytes"]) / plan["measured_peak_bytes"]
    use_committed = any("predicted_bytes" in p for p in results["plans"])
    if not use_committed:  # no committed prediction: this machine's is the only one
        for plan in ok:
            if "error_here" in plan:
                plan["error"] = plan["error_here"]
    results["predictions_from"] = results["committed"]["source"] if use_committed else \
        "this machine's CPU, in the same call"
    results["summary"] = error_summary(ok, "error")
    results["summary_here"] = error_summary(ok, "error_here")
    results["noise_floor"] = loss_checks(results["plans"])
    attach_rates(results)


def error_summary(plans: list[dict], key: str) -> dict:
    errors = sorted(((abs(p[key]), p) for p in plans if p.get(key) is not None and p["name"] != REPEAT),
                    key=lambda pair: pair[0])
    if not errors:
        return {"plans": 0}
    worst = errors[-1][1]
    return {"plans": len(errors), "median_abs_error": statistics.median(e for e, _ in errors),
            "worst_abs_error": errors[-1][0], "worst_plan": f"{worst['name']} @ micro-batch {worst['micro_batch']}"}


def loss_checks(plans: list[dict]) -> dict:
    """Noise floor per micro-batch (none against its repeat); every plan's loss difference to none."""
    find = lambda name, micro: next((p for p in plans if p["name"] == name and p["micro_batch"] == micro  # noqa: E731
                                     and p["status"] == "ok"), None)
    floors = {}
    for micro in sorted({p["micro_batch"] for p in plans}):
        none, repeat = find("none", micro), find(REPEAT, micro)
        floor = max_loss_diff(none, repeat) if none and repeat else None
        floors[str(micro)] = floor
        for plan in (p for p in plans if p["micro_batch"] == micro and p["status"] == "ok" and p is not none):
            if none:
                plan["loss_diff_vs_none"] = max_loss_diff(plan, none)
                plan["loss_within_noise"] = None if floor is None else \
                    plan["loss_diff_vs_none"] <= NOISE_MULTIPLE * floor + LOSS_ATOL
    return floors


def max_loss_diff(a: dict, b: dict) -> float:
    # strict=False: a run that stopped early is compared over the steps it has
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=False))


def attach_rates(results: dict) -> None:
    """Per plan: the FLOPs its step ran (its own count, or its plan's at another micro-batch: the
    global batch is the same), achieved FLOP/s, MFU and HFU (module docstring)."""
    counted = {p["name"]: p["flops"] for p in results["plans"] if p.get("flops")}
    model = counted.get("none")
    results["model_flops"] = model
    peak = results.get("peak_flops_per_s")
    for plan in (p for p in results["plans"] if p["status"] == "ok"):
        flops = counted.get(plan["name"], model if plan["name"] in (REPEAT, "compile") else None)
        plan["hardware_flops"] = flops
        step = plan["step_time_s"]
        plan["achieved_flops_per_s"] = flops / step if flops else None
        plan["mfu"] = model / step / peak if model and peak else None
        plan["hfu"] = flops / step / peak if flops and peak else None


def figures(results: dict) -> dict:
    """P4 (peak predictions) and P6 (MFU, eager and compiled) from the plans measured."""
    summary = results.get("summary") or {}
    ok = [p for p in results["plans"] if p["status"] == "ok" and p.get("mfu") is not None]
    best = lambda plans: max(plans, key=lambda p: p["mfu"], default=None)  # noqa: E731
    eager, compiled = best([p for p in ok if p["name"] != "compile"]), best([p for p in ok if p["name"] == "compile"])
    return {
        "P4": {"median_abs_error": summary.get("median_abs_error"), "worst_abs_error": summary.get("worst_abs_error"),
               "plans": summary.get("plans", 0), "goals": PEAK_ERROR_GOALS,
               "predictions_from": results.get("predictions_from")},
        "P6": {"eager_mfu": eager and eager["mfu"], "eager_plan": eager and eager["key"],
               "compiled_mfu": compiled and compiled["mfu"], "compiled_plan": compiled and compiled["key"],
               "goals": (EAGER_MFU_GOAL, COMPILED_MFU_GOAL)},
    }
