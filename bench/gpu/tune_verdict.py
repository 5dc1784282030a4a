"""The tune call's verdict, from whatever has been measured so far: medians per candidate, the ratios
the issue sets goals for, and the tuned plan's peak against the cap.

- P1: tuned / the fastest plan the same search finds with no cap (the card's memory as its cap) >= 0.97
- P2: tuned / HF's own gradient checkpointing in a plain HF loop, same batch and precision >= 1.25
- P5: the capped search's wall time <= 10 minutes (and it finished by itself)
- the tuned plan's measured peak (reserve + CUDA context) under the cap, using >= 90% of it
Ratios are of median samples/s over the comparison's own runs (fresh processes, interleaved); the
searches' own measurements of their winners are kept beside them.
"""

from __future__ import annotations

import statistics

FASTEST_GOAL = 0.97  # tuned / fastest uncapped plan: the cap should cost at most 3%
HF_GOAL = 1.25  # tuned / HF's gradient checkpointing: what tuning buys over the usual default
TUNE_GOAL_S = 600.0
CAP_USE_GOAL = 0.90


def as_json(candidate: dict) -> dict:
    from bench.gpu.tables import plan_label

    recipe = candidate["recipe"]
    memory = recipe.memory.model_dump(mode="json")
    if candidate["role"] == "hf_full_checkpointing":
        label = "HF loop, whole batch, gradient_checkpointing_enable()"
    else:
        label = plan_label({**memory, "micro_batch": recipe.micro_batch})  # `null` and the batch size alike
    return {"name": candidate["name"], "role": candidate["role"], "source": candidate["source"],
            "label": f"{label}, {recipe.precision}", "memory": memory, "search_samples_per_s": candidate.get("search_samples_per_s"),
            "runs": candidate["runs"]}


def conclude(results: dict, candidates: list[dict]) -> None:
    results["candidates"] = [as_json(c) for c in candidates]
    for candidate in results["candidates"]:
        ok = [r for r in candidate["runs"] if r.get("status") == "ok"]
        candidate["median_samples_per_s"] = statistics.median(r["samples_per_s"] for r in ok) if ok else None
        peaks = [r["card_peak_bytes"] for r in candidate["runs"] if r.get("card_peak_bytes") is not None]
        candidate["max_card_peak_bytes"] = max(peaks, default=None)
    role = lambda name: next((c for c in results["candidates"] if c["role"] == name), None)  # noqa: E731
    speed = lambda c, key="median_samples_per_s": c and c.get(key)  # noqa: E731
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    tuned, uncapped = role("tuned"), role("uncapped")
    results["ratios"] = {
        "tuned_vs_fastest_uncapped": ratio(speed(tuned), speed(uncapped)),
        "tuned_vs_fastest_uncapped_in_the_searches": ratio(speed(tuned, "search_samples_per_s"),
                                                           speed(uncapped, "search_samples_per_s")),
        "tuned_vs_hf_full_checkpointing": ratio(speed(tuned), speed(role("hf_full_checkpointing"))),
        "tuned_vs_full_checkpointing": ratio(speed(tuned), speed(role("full_checkpointing"))),
        "fastest_goal": FASTEST_GOAL, "hf_goal": HF_GOAL}
    peak = tuned and tuned["max_card_peak_bytes"]
    cap = results["cap_bytes"]
    results["tuned_peak"] = {"card_peak_bytes": peak, "cap_bytes": cap,
                             "within_cap": None if peak is None else peak <= cap,
                             "cap_used": None if peak is None else peak / cap, "cap_use_goal": CAP_USE_GOAL}
    results["figures"] = figures(results)


def figures(results: dict) -> dict:
    ratios, run = results["ratios"], results.get("tune") or {}
    finished = run.get("exit_code") == 0 and not run.get("timed_out")
    return {"P1": {"value": ratios["tuned_vs_fastest_uncapped"], "goal": FASTEST_GOAL},
            "P2": {"value": ratios["tuned_vs_hf_full_checkpointing"], "goal": HF_GOAL},
            "P5": {"seconds": run.get("seconds"), "finished": finished if run else None, "goal_s": TUNE_GOAL_S},
            "cap": results["tuned_peak"]}
