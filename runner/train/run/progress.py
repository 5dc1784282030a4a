"""What a run says while it trains, and the line it ends with.

A line for step 1 (so a slow model shows it started), then every `output.log_every` steps and
whenever `output.log_seconds` passed since the last line, and for the last step; each with the
throughput (tokens/s for token models, samples/s for images) and the time left. On a terminal a
tqdm bar carries them; elsewhere (a log file, a pipe, a batch job) they are plain lines that
start with the time, as every log line does.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from ...units import format_bytes
from ..output.directory import METRICS, read_metrics_lines

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # a segment's first steps (compiling, the allocator and caches filling) set no pace for the ETA


class Progress:
    def __init__(self, total: int, first_step: int, log_every: int, log_seconds: float, show: bool = True):
        self.total, self.first_step, self.log_every, self.log_seconds = total, first_step, log_every, log_seconds
        self.bar = _bar(total, first_step) if show and sys.stderr.isatty() else None
        self.show = show
        self.warm: tuple[int, float] | None = None  # (step, time) once this segment's warm-up steps are done
        self.last_line = time.monotonic()

    def update(self, record: dict) -> None:
        now, step = time.monotonic(), record["step"]
        if self.warm is None and step >= self.first_step + WARMUP_STEPS:
            self.warm = (step, now)  # the first steps compile, load kernels, fill caches: not the run's pace
        if not self.show:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {record['loss']:.4f}")
        due = step % self.log_every == 0 or step == self.total or step == self.first_step + 1
        if due or (self.log_seconds and now - self.last_line >= self.log_seconds):
            self.last_line = now
            text = f"{step_line(record, self.total)}  {self.eta(record, now)}"
            if self.bar is not None:
                self.bar.write(text)
            else:
                log.info(text)

    def eta(self, record: dict, now: float) -> str:
        """The time left at the mean pace since the warm-up steps (evaluations and saves included): none
        before it, so the first lines never show an estimate that the next ones halve."""
        step, left = record["step"], self.total - record["step"]
        if left <= 0:
            return "ETA 0s"
        if self.warm is None or step <= self.warm[0]:
            return f"ETA after step {self.first_step + WARMUP_STEPS + 1}"
        warm_step, warm_time = self.warm
        return f"ETA {format_duration((now - warm_time) / (step - warm_step) * left)}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _bar(total: int, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def step_line(record: dict, total: int) -> str:
    speed = f"{record['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in record else \
        f"{record['samples_per_s']:.1f} samples/s"
    return (f"step {record['step']}/{total}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  {speed}  "
            f"peak {format_bytes(record['peak_mem_bytes'])}")


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def done_line(result, out_dir: Path) -> str:
    """The run's last line: its steps and loss, saying what a resumed segment's losses cover."""
    metrics = out_dir / METRICS
    end = f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
    how = f"stopped early after step {result.steps_done} of {result.total_steps} ({result.stopped_early})" \
        if result.stopped_early else f"{result.steps_done} steps"
    if result.diverged:  # said when it happened, many lines up: the last line keeps it in view
        end += " (diverged: see the warning at its step)"
    if not result.resumed_at:
        return f"done: {how}, {end}, metrics in {metrics}"
    records = read_metrics_lines(metrics)[0] if metrics.is_file() else []
    first = next((r for r in records if isinstance(r.get("loss"), float)), None)
    before = f"; step {first['step']} had {first['loss']:.4f}" if first and first["step"] <= result.resumed_at else ""
    return (f"done: {how}, resumed from step {result.resumed_at}: this run's steps {result.resumed_at + 1}-"
            f"{result.steps_done} went {end}{before}; the whole run in {metrics}")
