"""What a study found: report.json with every trial, the Pareto front of peak memory against
throughput as a terminal table, and the same as a PNG plot.

The front holds the measured plans that no other plan beats on both counts (less memory and more
samples/s); the winner is the fastest plan whose measured peak stays within the limit (the cap
minus the margin). A plan measured more than once counts by the median of its throughputs and
the largest of its peaks. Works on a finished study and on one still running.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.units import format_bytes

from ..cap import Cap
from ..records import TrialRecord, plans, ranked_feasible

log = logging.getLogger(__name__)


def pareto_front(records: list[TrialRecord]) -> list[TrialRecord]:
    """Measured plans not beaten on both peak and throughput by another, smallest peak first."""
    front, best_speed = [], 0.0
    for plan in sorted(plans(records), key=lambda p: (p.measured_peak, -p.samples_per_s, p.number)):
        if plan.samples_per_s > best_speed:
            front.append(plan)
            best_speed = plan.samples_per_s
    return front


def winner_reason(records: list[TrialRecord], limit: int) -> str:
    ranked = ranked_feasible(records)
    if not ranked:
        return "no measured plan stays within the limit"
    best = ranked[0]
    faster = sorted((r for r in plans(records) if r.state != "feasible"
                     and r.samples_per_s > best.samples_per_s), key=lambda r: -r.samples_per_s)
    how = "predicted" if best.predicted else "measured"
    why = (f"trial {best.number} is the fastest of {len(ranked)} plan(s) whose {how} peak stays within "
           f"{format_bytes(limit)}")
    if faster:
        over = ", ".join(f"trial {r.number} ({format_bytes(r.measured_peak)})" for r in faster[:3])
        why += f"; {len(faster)} faster plan(s) went over it: {over}"
    return why


def run_speeds(records: list[TrialRecord], plan: TrialRecord) -> list[float]:
    """The throughput of every run of `plan`'s plan (its first probe and the finalists' re-runs)."""
    return [r.samples_per_s for r in records
            if r.key == plan.key and r.state != "duplicate" and r.samples_per_s and r.measured_peak]


def caveats(records: list[TrialRecord]) -> list[str]:
    """What the winner's reader must know before trusting it: that one plan only was measured (nothing
    was compared), or that the runner-up is within the measurement noise of the winner (the ranking
    between them is a coin toss on this evidence). Predictions do not vary: they get neither."""
    ranked, measured = ranked_feasible(records), plans(records)
    if not ranked or ranked[0].predicted:
        return []
    if len(measured) < 2:
        return [f"ONLY ONE PLAN WAS MEASURED (trial {ranked[0].number}): nothing was compared, so it is a plan that "
                f"fits, not the fastest; {_untried(records)}"]
    if len(ranked) < 2:
        return []
    best, second = ranked[0], ranked[1]
    fast, slow = run_speeds(records, best), run_speeds(records, second)
    gap = best.samples_per_s / second.samples_per_s - 1
    described = (f"trial {best.number} {_spread(fast)} against trial {second.number} {_spread(slow)} samples/s")
    if len(fast) > 1 and len(slow) > 1:
        if max(slow) < min(fast):
            return []
        return [f"WITHIN THE NOISE: {described}: their runs overlap, so the {gap:.0%} between the medians does not "
                f"rank them; either plan is as good on this evidence"]
    return [f"NOT CONFIRMED: {described}: {gap:.0%} apart on {'one run' if len(fast) == 1 else 'runs'} of the winner "
            f"and {'one' if len(slow) == 1 else len(slow)} of the runner-up, which no re-run checked (one CPU probe "
            f"can vary 2-3x on a busy machine); more --time-budget re-runs the finalists"]


def _spread(speeds: list[float]) -> str:
    if len(speeds) == 1:
        return f"{speeds[0]:.2f} (1 run)"
    return f"{statistics.median(speeds):.2f} (median of {len(speeds)} runs, {min(speeds):.2f}-{max(speeds):.2f})"


def _untried(records: list[TrialRecord]) -> str:
    skipped = sum(r.state == "skipped" for r in records)
    why = f"{skipped} queued plan(s) were skipped when the time budget ran out; " if skipped else ""
    return f"{why}a longer --time-budget (or none) measures and compares more"


def summary(records: list[TrialRecord]) -> str:
    counts: dict[str, int] = {}
    for record in records:
        counts[record.state] = counts.get(record.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def format_table(records: list[TrialRecord], cap: int, limit: int) -> str:
    """The Pareto front as a table, the winner marked `*`, and why it won."""
    front, ranked = pareto_front(records), ranked_feasible(records)
    winner = ranked[0].number if ranked else None
    lines = [f"{len(records)} trials: {summary(records)}",
             f"Pareto front (peak memory vs throughput; cap {format_bytes(cap)}, limit {format_bytes(limit)}):",
             f"  {'':1} {'trial':>5}  {'peak':>9}  {'samples/s':>9}  {'runs':>4}  {'fits':<4}  plan"]
    for plan in front:
        mark = "*" if plan.number == winner else ""
        fits = "yes" if plan.state == "feasible" else "no"
        lines.append(f"  {mark:1} {plan.number:>5}  {format_bytes(plan.measured_peak):>9}  "
                     f"{plan.samples_per_s:>9.2f}  {plan.runs:>4}  {fits:<4}  {plan.label}")
    lines.append(f"winner: {winner_reason(records, limit)}" if ranked else f"no winner: {winner_reason(records, limit)}")
    lines += [f"warning: {caveat}" for caveat in caveats(records)]
    return "\n".join(lines)


def write_report(directory: Path, records: list[TrialRecord], config: dict, screening: dict | None = None) -> Path:
    """DIR/report.json; `screening` says whether predictions screened plans, why not, which of them
    failed in the user's code, and what the estimate warned of."""
    ranked = ranked_feasible(records)
    report = {"cap_bytes": config["cap"], "margin": config["margin"], "limit_bytes": _limit(config),
              "winner": ranked[0].number if ranked else None, "ranked_feasible": [r.number for r in ranked],
              "pareto_front": [r.number for r in pareto_front(records)], "screening": screening,
              "caveats": caveats(records),
              "trials": [r.as_data() for r in records]}
    path = directory / "report.json"
    write_atomic(path, json.dumps(report, indent=1, default=str))
    return path


def _limit(config: dict) -> int:
    return Cap(config["cap"], config["margin"]).limit


def plot(directory: Path, records: list[TrialRecord], config: dict) -> Path:
    """DIR/pareto.png: every measured plan, the front, the cap and limit, the winner starred."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display, also under a test runner
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    measured = plans(records)
    groups = {("fits", "o", "tab:green"): [p for p in measured if p.state == "feasible"],
              ("over the limit", "x", "tab:red"): [p for p in measured if p.state != "feasible"]}
    for (label, marker, color), group in ((style, group) for style, group in groups.items() if group):
        ax.scatter([r.measured_peak / 1e6 for r in group], [r.samples_per_s for r in group], label=label,
                   marker=marker, color=color)
    front = pareto_front(records)
    if len(front) > 1:  # a front of one plan is no line: its legend entry would name nothing drawn
        ax.step([r.measured_peak / 1e6 for r in front], [r.samples_per_s for r in front], where="post",
                color="grey", linewidth=1, label="Pareto front")
    ax.axvline(config["cap"] / 1e6, color="black", linestyle="--", linewidth=1, label="cap")
    ax.axvline(_limit(config) / 1e6, color="black", linestyle=":", linewidth=1, label="limit (cap - margin)")
    peaks = [p.measured_peak / 1e6 for p in measured] + [config["cap"] / 1e6, _limit(config) / 1e6]
    ax.set_xlim(0.95 * min(peaks), 1.05 * max(peaks))  # the cap and the limit in view with every plan
    ranked = ranked_feasible(records)
    if ranked:
        best = ranked[0]
        ax.scatter([best.measured_peak / 1e6], [best.samples_per_s], marker="*", s=250, color="gold",
                   edgecolors="black", zorder=3, label=f"winner (trial {best.number})")
    ax.set_xlabel("measured peak memory (MB)")
    ax.set_ylabel("samples/s")
    ax.set_title(f"ckrun tune: {len(measured)} plan(s) {'predicted' if measured[0].predicted else 'measured'}"
                 + (" - ONE PLAN: nothing compared" if len(measured) == 1 and not measured[0].predicted else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = directory / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def publish(directory: Path, records: list[TrialRecord], config: dict, screening: dict | None = None) -> str:
    """Write report.json and pareto.png, return the table: what `tune` and `report` both print."""
    report_path = write_report(directory, records, config, screening)
    plot_path = plot(directory, records, config) if plans(records) else None
    table = format_table(records, config["cap"], _limit(config))
    if screening and screening.get("state") == "off" and screening.get("reason") != "--no-screen":
        table += f"\nscreening was off: {screening['reason']}"
    for warning in (screening or {}).get("warnings", []):
        table += f"\nestimate warning: {warning}"
    log.info("report: %s%s", report_path, f", plot: {plot_path}" if plot_path else " (no measured plan to plot)")
    return table
