"""A run's curves: metrics.jsonl drawn against step (loss, evaluation, learning rate, gradient norm,
throughput, memory) to a PNG.

`ckrun report RUN_DIR` calls `report_run`; it reads the file as `--resume` does (a partial last
line from a kill is skipped, and counted), so it works on a run that is still going.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from ...problems import InputError, Place, Problem
from ...units import format_bytes
from .directory import METRICS, read_metrics_lines

log = logging.getLogger(__name__)

CURVES = "curves.png"


def report_run(out_dir: Path) -> str:
    """Draw OUT_DIR/curves.png; returns a few lines summing the run up."""
    path = out_dir / METRICS
    records, unread = read_metrics_lines(path)
    if unread:
        log.warning("%s: %d line(s) could not be read (a partial last line from a kill or a full disk) and are left out",
                    path, unread)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if isinstance(r.get("eval"), dict)]
    if not steps:
        raise InputError([Problem(Place(str(path)), "", "holds no training steps yet; report it once a step is done")])
    picture = plot_run(out_dir / CURVES, steps, evals, out_dir.name)
    return f"{summary(steps, evals)}\ncurves: {picture}"


def summary(steps: list[dict], evals: list[dict]) -> str:
    losses = [r["loss"] for r in steps if r["loss"] is not None]
    lines = [f"steps {steps[0]['step']}..{steps[-1]['step']}: loss "
             + (f"{losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "not a number")]
    rates = [r["samples_per_s"] for r in steps if r.get("samples_per_s")]
    peaks = [r["peak_mem_bytes"] for r in steps if r.get("peak_mem_bytes")]
    if rates:
        lines.append(f"throughput: median {statistics.median(rates):.4g} samples/s")
    if peaks:
        lines.append(f"peak memory: {format_bytes(max(peaks))}")
    if evals:
        last = evals[-1]
        shown = "  ".join(f"{k} {v:.4g}" for k, v in last["eval"].items() if k in ("loss", "perplexity", "accuracy") and v is not None)
        lines.append(f"eval at step {last['step']}: {shown}")
    return "\n".join(lines)


def plot_run(path: Path, steps: list[dict], evals: list[dict], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display, also under a test runner
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(10, 9), sharex=True)
    _loss(axes[0][0], steps, evals)
    _eval_metric(axes[0][1], evals)
    _series(axes[1][0], steps, "lr", 1, "learning rate", "learning rate (the schedule)")
    _grad_norm(axes[1][1], steps)
    _series(axes[2][0], steps, "samples_per_s", 1, "samples/s", "throughput")
    _series(axes[2][1], steps, "peak_mem_bytes", 1e6, "MB", "peak memory per step")
    for ax in axes[2]:
        ax.set_xlabel("step")
    fig.suptitle(f"ckrun run: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _points(records: list[dict], read) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], read(r)) for r in records]
    pairs = [(step, value) for step, value in pairs if isinstance(value, int | float)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _loss(ax, steps: list[dict], evals: list[dict]) -> None:
    ax.plot(*_points(steps, lambda r: r.get("loss")), label="train", linewidth=1)
    if evals:
        ax.plot(*_points(evals, lambda r: r["eval"].get("loss")), "o-", label="eval", markersize=4)
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.legend(fontsize=8)


def _eval_metric(ax, evals: list[dict]) -> None:
    name = next((k for k in ("accuracy", "perplexity") if any(k in r["eval"] for r in evals)), None)
    if name is None:
        ax.text(0.5, 0.5, "no evaluation in this run\n(add an eval: section)", ha="center", va="center",
                transform=ax.transAxes, color="grey")
    else:
        ax.plot(*_points(evals, lambda r: r["eval"].get(name)), "o-", color="tab:green", markersize=4)
        if name == "perplexity":
            ax.set_yscale("log")
    ax.set_title(f"eval {name or ''}".strip())


def _grad_norm(ax, steps: list[dict]) -> None:
    """The gradient norm before clipping (train.grad_clip computes it), log scale: spikes are the news."""
    xs, ys = _points(steps, lambda r: r.get("grad_norm"))
    if not xs:
        ax.text(0.5, 0.5, "no gradient norm in this run\n(train.grad_clip measures it)", ha="center", va="center",
                transform=ax.transAxes, color="grey")
    else:
        ax.plot(xs, ys, linewidth=1, color="tab:purple")
        if min(ys) > 0:
            ax.set_yscale("log")
    ax.set_title("gradient norm (before clipping)")


def _series(ax, steps: list[dict], key: str, scale: float, unit: str, title: str) -> None:
    xs, ys = _points(steps, lambda r: r.get(key))
    ax.plot(xs, [y / scale for y in ys], linewidth=1)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.set_ylim(0, max(ys, default=1) / scale * 1.15 or 1)  # from zero, so a flat line reads as flat
