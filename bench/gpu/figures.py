"""The figures the GPU campaign sets goals for (P1, P2, P4, P5, P6, the step-time prediction, the tuned
plan's use of the cap), each as text with its goal, "not measured" where its step has not run; and the
formats of the numbers every table of the campaign writes (tables.py, sections.py, plans.py)."""

from __future__ import annotations

from bench.stats import spearman

# --- numbers --------------------------------------------------------------------------------------


def gb(count) -> str:
    return "" if count is None else f"{count / 1e9:.2f}"


def size(count) -> str:
    """Small amounts (workspaces, contexts) in MB, large ones in GB."""
    if count is None:
        return "n/a"
    return f"{count / 1e9:.2f} GB" if abs(count) >= 1e9 else f"{count / 1e6:.1f} MB"


def percent(fraction, signed: bool = False) -> str:
    if fraction is None:
        return ""
    return f"{100 * fraction:+.1f}%" if signed else f"{100 * fraction:.1f}%"


NOT_MEASURED = "not measured"


def against_goal(value, goal: float, text: str | None = None, at_most: bool = False, goal_text: str | None = None) -> str:
    """`0.95 (goal >= 0.97: MISSED)`; "not measured" for None."""
    if value is None:
        return NOT_MEASURED
    met = value <= goal if at_most else value >= goal
    return (f"{text or f'{value:.2f}'} (goal {'<=' if at_most else '>='} {goal_text or f'{goal:g}'}: "
            f"{'met' if met else 'MISSED'})")


# --- the figures ----------------------------------------------------------------------------------


def figure_texts(found: dict) -> dict[str, str]:
    """Each figure's result as text, "not measured" where its step has not run."""
    plans_found = found.get("plans") or {}
    plans = plans_found.get("figures") or {}
    tune = (found.get("tune") or {}).get("figures") or {}
    return {"P1": _p1(tune), "P2": _p2(tune), "P4": _p4(plans), "P5": _p5(tune), "P6": _p6(plans),
            "cap": cap_text(tune.get("cap")), "step time": step_time_text(plans_found.get("plans") or [])}


def figures_table(found: dict) -> str:
    texts = figure_texts(found)
    rows = [("P1", "tuned under 40 GB / fastest uncapped plan", texts["P1"]),
            ("P2", "tuned / HF `gradient_checkpointing_enable()`, same batch and precision", texts["P2"]),
            ("P4", "predicted vs measured peak (reserved), absolute error: median; worst", texts["P4"]),
            ("P5", "`ckrun tune` under 40 GB, wall time", texts["P5"]),
            ("P6", "MFU, best eager plan; best compiled plan", texts["P6"]),
            ("step time", "predicted vs measured step time over the plans: rank correlation; error", texts["step time"]),
            ("cap", "tuned plan's measured peak (reserve + CUDA context) under the cap, using >= 90% of it",
             texts["cap"])]
    dry = any((found.get(name) or {}).get("dry_run") for name in found)
    lines = ["## Figures", "", "| figure | what | result |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    if not found:
        lines += ["", "No GPU results yet: every figure waits for a lent GPU (`bash bench/gpu/call.sh`)."]
    elif dry:
        lines += ["", "Dry run: toy sizes on a CPU; the goals are for BERT-large on a GPU."]
    return "\n".join(lines)


def _p1(tune: dict) -> str:
    return against_goal((tune.get("P1") or {}).get("value"), 0.97)


def _p2(tune: dict) -> str:
    return against_goal((tune.get("P2") or {}).get("value"), 1.25)


def _p4(plans: dict) -> str:
    p4 = plans.get("P4") or {}
    if p4.get("median_abs_error") is None:
        return NOT_MEASURED
    median, worst = (against_goal(p4[k], goal, percent(p4[k]), at_most=True, goal_text=percent(goal))
                     for k, goal in (("median_abs_error", 0.03), ("worst_abs_error", 0.08)))
    return f"{median}; {worst}; {p4['plans']} plans, predicted by {p4.get('predictions_from')}"


def _p5(tune: dict) -> str:
    p5 = tune.get("P5") or {}
    if p5.get("seconds") is None:
        return NOT_MEASURED
    text = f"{p5['seconds'] / 60:.1f} min" + ("" if p5.get("finished") else ", killed at its share of the call")
    return against_goal(p5["seconds"] / 60, 10, text, at_most=True, goal_text="10 min")


def _p6(plans: dict) -> str:
    p6 = plans.get("P6") or {}
    shown = lambda kind, goal: against_goal(p6.get(f"{kind}_mfu"), goal, p6.get(f"{kind}_mfu") is not None and  # noqa: E731
                                     f"{percent(p6[f'{kind}_mfu'])} ({p6.get(f'{kind}_plan')})", goal_text=percent(goal))
    return f"eager {shown('eager', 0.35)}; compiled {shown('compiled', 0.45)}"


def cap_text(cap: dict | None) -> str:
    if not cap or cap.get("card_peak_bytes") is None:
        return NOT_MEASURED
    within = "under the cap" if cap["within_cap"] else "OVER THE CAP"
    return f"{gb(cap['card_peak_bytes'])} GB of {gb(cap['cap_bytes'])} GB: {within}, " + \
        against_goal(cap["cap_used"], 0.9, f"{percent(cap['cap_used'])} used", goal_text="90%")


def step_time_text(plans: list[dict]) -> str:
    """The time model against the measured steps: rank correlation and error, the calibration a GPU gives."""
    timed = [p for p in plans if p["status"] == "ok" and p.get("predicted_step_s") and p.get("step_time_s")]
    if len(timed) < 2:
        return NOT_MEASURED + " (fewer than two measured plans carry a prediction)"
    measured, predicted = [p["step_time_s"] for p in timed], [p["predicted_step_s"] for p in timed]
    errors = sorted(abs(b / a - 1) for a, b in zip(measured, predicted, strict=True))
    return (f"Spearman {spearman(measured, predicted):.2f}, median error {percent(errors[len(errors) // 2])}, "
            f"worst {percent(errors[-1])} over {len(timed)} plans")
