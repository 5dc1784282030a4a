"""The study on disk and what the search may spend: an optuna study in DIR/study.journal (one
journal file, so a killed tune loses no told trial and `--resume` continues it, refused when the
recipe or options differ), the `Budget` of trials and seconds, and the types of what answers a
plan (`Evaluate`: a probe; `Predict`: a prediction). The tuner that runs the study is
autotune/search/tuner.py.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from ckrun.runner.problems import InputError, Place, Problem

from ..records import ProbeResult, TrialRecord, read_record
from ..space.candidate import Candidate

STUDY_NAME = "ckrun-tune"
# Under --time-budget, what runs before the first probe (imports, the model's facts, predictions of
# the starting points, the solver) may use this share of it; predictions past it are left to the
# search, which makes them one plan at a time. A quarter leaves a 40 s budget room for 2-4 CPU probes.
PRE_PROBE_SHARE = 0.25

Evaluate = Callable[[Candidate, int], ProbeResult]  # (candidate, trial number) -> what the probe reported


@dataclass(frozen=True)
class Prediction:
    """A predicted peak, or none and why (the plan is then probed unscreened, the reason recorded);
    with the device's facts, the step's predicted time too (`StepTime.record()`)."""

    peak: int | None
    reason: str = ""
    time: dict | None = None

    @property
    def seconds(self) -> float | None:
        return self.time["seconds"] if self.time else None


Predict = Callable[[Candidate], "int | Prediction | None"]  # predicted peak bytes; None: no prediction possible


def process_started() -> float:
    """When this process started, on the `time.monotonic()` clock: `ckrun tune`'s own imports count
    against its budget too. Linux's /proc gives it; elsewhere, now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])  # both count from boot
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    return time.monotonic() - min(max(age, 0.0), 60.0)  # a bound, should a clock disagree


@dataclass(frozen=True)
class Budget:
    """What the search may spend: new plans measured, and wall-clock seconds from `started` (for
    `ckrun tune`, its process's start: its imports, the model's facts, predictions and the solver
    count, the winner's training does not). No probe starts that is expected to end past the time
    budget, the first excepted; before it, predictions and the solver may use `PRE_PROBE_SHARE` of it."""

    trials: int = 20  # probes, i.e. measurements; screened and repeated proposals cost none
    time_s: float | None = None
    started: float = field(default_factory=lambda: time.monotonic())

    def time_left(self) -> float | None:
        return None if self.time_s is None else self.time_s - (time.monotonic() - self.started)

    def before_probes_left(self) -> float | None:
        """Seconds left of the share of the budget that the work before the first probe may use."""
        return None if self.time_s is None else PRE_PROBE_SHARE * self.time_s - (time.monotonic() - self.started)


def open_study(directory: Path, config: dict, resume: bool) -> tuple[optuna.Study, bool]:
    """The study in DIR/study.journal and whether it is new; a finished or running one needs --resume."""
    path = directory / "study.journal"
    if path.exists() and path.stat().st_size and not resume:
        raise InputError([Problem(Place(str(directory)), "", "already holds a study; pass --resume to continue it, "
                                  "or --output ANOTHER_DIR to start a new one")])
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ckrun logs each trial itself, with the plan
    directory.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(_Journal(str(path)))
    study = optuna.create_study(study_name=STUDY_NAME, storage=storage, direction="maximize", load_if_exists=True)
    config = json.loads(json.dumps(config))  # as the storage gives it back: tuples become lists
    stored = study.user_attrs.get("config")
    if stored is None:
        study.set_user_attr("config", config)
        return study, True
    changed = sorted(k for k in config.keys() | stored.keys() if config.get(k) != stored.get(k))
    if changed:
        raise InputError([Problem(Place(str(directory)), "", f"--resume: this study was started with other "
                                  f"{', '.join(changed)}; use the same recipe and options, or --output ANOTHER_DIR")])
    return study, False


class _Journal(JournalFileBackend):
    """optuna's journal file, each write flushed but not fsync'ed: a killed tune loses nothing (what is written
    is the kernel's), only a machine's crash may lose its last lines; optuna's fsync per write (about 11 a
    plan) took 6 ms each on this machine's disk, 13 s of a predicted 8B tune that prices 150 plans."""

    def append_logs(self, logs: list[dict]) -> None:
        try:
            from optuna.storages.journal._file import get_lock_file  # private: another optuna keeps its own write
            lock = self._lock
        except (ImportError, AttributeError):
            return super().append_logs(logs)
        with get_lock_file(lock):
            with open(self._file_path, "ab") as journal:
                journal.write(("\n".join(json.dumps(log, separators=(",", ":")) for log in logs) + "\n").encode())
                journal.flush()


def trial_records(study: optuna.Study) -> list[TrialRecord]:
    """Every trial the search reached, as the report reads it: number, state, plan, peaks, throughput, reason."""
    return [read_record(trial) for trial in study.get_trials(deepcopy=False) if trial.state != TrialState.WAITING]
