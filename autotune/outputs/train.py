"""After the search: train with the winner, falling back down the ranking when a real run breaches
the cap, and the one line that explains an impossible cap.

A probe runs a few steps; a training run can still go over (other batches, allocator
fragmentation over time). The trainer holds every step to memory.max_mem, so a breach surfaces in
the first steps as MemoryCapExceeded; the next-best feasible plan then takes over, resuming from
the newest checkpoint if one was written (checkpointing and offload never change what is computed;
another micro_batch does only where BatchNorm or dropout see the micro-batch, see autotune/space/space.py).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ckrun.runner.plan.memory_plan import FullCheckpointing, MemoryPlan
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.train.loop import MemoryCapExceeded, RunResult, train
from ckrun.runner.units import format_bytes

from .report import summary
from ..space.facts import Device
from ..space.space import Space
from ..cap import Cap
from ..records import TrialRecord

log = logging.getLogger(__name__)

BROKEN = ("crash", "died", "timeout", "bad_input")  # probe states that say nothing about memory
TunedFor = Callable[[TrialRecord], "tuple[Path, Recipe]"]  # a ranked trial -> (tuned.yaml written for it, its recipe)


@dataclass(frozen=True)
class Trained:
    """The plan that trained, its tuned.yaml and recipe, and how the training went."""

    record: TrialRecord
    path: Path
    recipe: Recipe
    result: RunResult


def train_with_fallback(ranked: list[TrialRecord], tuned_for: TunedFor, resume: bool,
                        train_fn: Callable[..., RunResult] = train) -> Trained | None:
    """Train the best plan that stays under the cap in real training; None when none does. A run
    stopped by SIGINT/SIGTERM comes back as it is (`stopped_by` set): stopping is no reason to fall back."""
    for position, record in enumerate(ranked):
        path, recipe = tuned_for(record)
        log.info("train: %s (trial %d: %s), every step held to the cap %s", path, record.number, record.label,
                 format_bytes(int(recipe.memory.max_mem)))
        try:
            result = train_fn(recipe, str(path), resume=resume or position > 0)
        except MemoryCapExceeded as err:
            _explain_breach(err, record, ranked[position + 1] if position + 1 < len(ranked) else None)
            result = None
        if result is None:
            _release_memory()  # only now: the exception's traceback held the failed trainer until its block ended
            continue
        if not result.stopped_by:  # a stopped run's line is the caller's to say (`ckrun tune` prints it)
            log.info("train: done, %d steps, peak %s under the cap", result.steps_done,
                     format_bytes(result.peak_mem_bytes))
        return Trained(record, path, recipe, result)
    log.error("train: every feasible plan went over the cap in training; raise --max-mem or --margin")
    return None


def _explain_breach(err: MemoryCapExceeded, record: TrialRecord, following: TrialRecord | None) -> None:
    probed = format_bytes(record.measured_peak)
    if following is None:
        log.warning("train: %s, although the probe measured %s; no feasible plan is left to fall back to", err, probed)
        return
    log.warning("train: %s, although the probe measured %s (real batches and a longer-lived allocator can use more); "
                "falling back to the next-best feasible plan, trial %d (%s, probed at %s)", err, probed,
                following.number, following.label, format_bytes(following.measured_peak))


def _release_memory() -> None:
    """The failed trainer is gone; give its cached blocks back before the next plan builds."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def nothing_fits(records: list[TrialRecord], cap: Cap, space: Space, device: Device, directory: Path,
                 predicted: bool = False) -> str:
    """One line: the cap, the smallest peak seen, and the knob that would help."""
    if predicted:
        return nothing_predicted(records, cap, space)
    head = f"nothing fits within {cap.describe()}"
    # prefer what a probe measured; then probes that broke (their reason, not a prediction, is the news);
    # when every plan was screened out, what the estimate predicted
    measured = [r for r in records if r.measured_peak and r.state != "duplicate"]
    broken = [r for r in records if r.state in BROKEN and not r.measured_peak]
    if not measured and broken:
        reason = broken[0].reason or broken[0].state
        log_path = f"{directory / 'probes'}/trial-{broken[0].number}.log"
        return (f"no plan could be measured within {cap.describe()}: {len(broken)} probe(s) failed before measuring "
                f"a peak, e.g. trial {broken[0].number} ({broken[0].label}): {reason}"
                + ("" if log_path in reason else f"; see {log_path}"))
    skipped = sum(r.state == "skipped" for r in records)
    if skipped:  # the budget stopped the search: "nothing fits" would be said of plans never tried
        head = (f"no plan measured fits within {cap.describe()}, but {skipped} queued plan(s) were never measured: "
                f"the time budget stopped the search (a longer --time-budget, or none, measures them)")
    for peak_of, verb in ((lambda r: r.measured_peak, "seen"), (lambda r: r.predicted_peak, "predicted")):
        seen = [r for r in records if peak_of(r) and r.state != "duplicate"]
        if seen:
            smallest = min(seen, key=peak_of)
            return (f"{head}: the smallest peak {verb} was {format_bytes(peak_of(smallest))} "
                    f"(trial {smallest.number}: {smallest.label})" + ("" if skipped else f"; {_knob(smallest, space, device)}"))
    return f"{head}: no probe measured a peak ({summary(records)}); see {directory / 'probes'}/*.log"


def nothing_predicted(records: list[TrialRecord], cap: Cap, space: Space) -> str:
    """tune --predict found no plan predicted to fit: "nothing fits" only where every plan of the space was
    priced or ruled out by its pools' lower bound; otherwise how many were priced, and the closest."""
    priced = {r.key: r for r in records if r.state not in ("duplicate", "skipped", "invalid") and r.key
              and (r.measured_peak or r.predicted_peak)}
    bounded = sum(1 for r in priced.values() if r.state == "screened" and r.probe_s is None and not r.measured_peak
                  and "lower bound" in (r.reason or ""))
    invalid = len({r.key for r in records if r.state == "invalid"})
    peak = lambda r: r.measured_peak or r.predicted_peak  # noqa: E731
    closest = min(priced.values(), key=peak, default=None)
    near = (f"; the closest: {format_bytes(peak(closest))} (trial {closest.number}: {closest.label})"
            if closest is not None else "")
    counted = (f"{len(priced) - bounded} plan(s) priced, {bounded} ruled out by their pools' lower bound"
               + (f", {invalid} invalid" if invalid else ""))
    if len(priced) + invalid >= space.size:
        return f"nothing fits within {cap.describe()}: every plan of the space was priced ({counted}){near}"
    return (f"no plan found to fit within {cap.describe()} in {counted} of the space's {space.size} before the search "
            f"stopped (more --trials or a longer --time-budget price more){near}")


def _knob(smallest: TrialRecord, space: Space, device: Device) -> str:
    plan = MemoryPlan.model_validate(smallest.plan)
    if "precision" not in space.choices and smallest.precision == "fp32" and len(device.precisions) > 1:
        halves = "/".join(p for p in device.precisions if p != "fp32")
        return f"--search-precision would try {halves}, which halves activations"
    untried = []
    if plan.micro_batch > min(space.micro_batches()):
        untried.append("a smaller memory.micro_batch")
    elif "micro_batch" not in space.choices and space.batchnorm:
        untried.append("a smaller memory.micro_batch (--search-micro-batch; it changes BatchNorm's statistics)")
    if not isinstance(plan.checkpointing, FullCheckpointing):  # the policy that keeps least
        untried.append("full checkpointing")
    if device.kind == "cuda" and not plan.offload.moves:
        untried.append("offload")
    if untried:
        return f"that plan could still use {' and '.join(untried)}: try more --trials"
    return ("even micro_batch 1 with every block checkpointed is over: parameters, gradients and optimizer state "
            "take most of it; raise --max-mem or use a smaller model")
