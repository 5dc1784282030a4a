"""The tuner's records: what one probe reported (`ProbeResult`) and what the study keeps of each
trial (`TrialRecord`). Each has one serialisation: a probe's result file is written with
`ProbeResult.to_json` and read with `from_json`; a trial's record goes into its optuna user
attributes with `store_record` and comes back with `read_record`. A mistyped status, state or
field is a validation error, where a dict would have carried it silently. `plans` folds a plan's
runs into one entry and `ranked_feasible` orders those that fit: the search, the report and the
training after it all rank the same way.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from ckrun.runner.plan.strategies import Distributed, strategy_from_label
from ckrun.runner.train.measure.measurement import Measurement

if TYPE_CHECKING:  # the probe child imports this module: optuna would only slow its start
    from optuna.trial import BaseTrial, FrozenTrial

ProbeStatus = Literal["ok", "over_cap", "oom", "crash", "bad_input", "timeout", "died", "unavailable"]
RecordState = Literal["feasible", "over_limit", "screened", "invalid", "skipped", "interrupted", "running",
                      "duplicate", "over_cap", "oom", "crash", "bad_input", "timeout", "died", "unavailable"]
"""A trial's state: measured and within the limit or over it; judged without a probe (screened,
invalid); never measured (skipped, interrupted, running); another trial's plan (duplicate); or the
status of a probe that measured nothing usable."""

INTERRUPTED = "the tuner stopped mid-probe; the plan was measured again later"


class ProbeResult(Measurement):
    """One probe's outcome: the child's measurement, or why there is none (the child said so:
    oom, crash, bad_input; the tuner saw it: timeout, died; `tune --predict` could not predict:
    unavailable), with what the tuner adds."""

    status: ProbeStatus  # type: ignore[assignment]  # the measurement's two, and the ways a probe fails
    measured_peak_bytes: int | None = None
    """The peak held against the cap (`card_peak_bytes` for a real probe, the prediction under --predict)."""
    probe_s: float | None = None
    """The probe's wall-clock seconds, child start to result."""
    world_size: int | None = None
    """The ranks of a `--nproc` probe's group."""
    step_s: float | None = None
    """tune --predict: the predicted step time, with its MFU and HFU."""
    mfu: float | None = None
    hfu: float | None = None
    predicted: bool = False
    """True when a prediction answered in place of a probe (tune --predict)."""

    @classmethod
    def failed(cls, status: ProbeStatus, reason: str) -> ProbeResult:
        return cls(status=status, reason=reason)

    @classmethod
    def of(cls, measurement: Measurement) -> ProbeResult:
        """A measurement as the tuner counts it: on CUDA a card-level cap holds the context too."""
        return cls(**dict(measurement), measured_peak_bytes=measurement.card_peak_bytes)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1, exclude_none=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        return cls.model_validate_json(text)


class TrialRecord(BaseModel):
    """What the study keeps of one trial, in its optuna user attributes, and what the report shows."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    state: RecordState
    reason: str = ""
    """Why the state: the probe's failure, the screen's prediction, the measured peak over the limit."""
    number: int | None = None
    """The optuna trial number: set by `read_record`, never stored (a duplicate copies its first's record)."""
    key: str | None = None
    """The plan's identity (`Candidate.key`); none for a trial that never got as far as a plan."""
    plan: dict[str, Any] | None = None
    """The memory plan as `MemoryPlan.model_dump(mode="json")`: tuned.yaml's `memory:`."""
    precision: str | None = None
    label: str | None = None
    """The plan in words; `read_record` falls back to the trial's params."""
    strategy: Distributed | None = None
    """tune --nproc: how the ranks share the work, stored as the recipe's `distributed:` section
    (memory.sharding is in `plan`); none for a tune of one process."""
    predicted_peak: int | None = None
    predicted_s: float | None = None
    """The predicted step time, when the device's facts were known."""
    unscreened: str | None = None
    """Why no prediction screened this plan (the user's model code failed on fake tensors, mostly)."""
    measured_peak: int | None = None
    probe_s: float | None = None
    device: dict[str, Any] | None = None
    """The probe's device, total bytes, torch and CUDA versions: tuned.yaml's provenance comment."""
    samples_per_s: float | None = None
    step_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    predicted: bool | None = None
    gradient_error: float | None = None
    update_error: float | None = None
    """A lossy optimizer's (memory.weights bf16, memory.optimizer_state 8bit/4bit/fp8) relative error of the
    weights' change against exact AdamW over the probe's first steps (runner/train/update_error.py)."""
    runs: int | None = None
    """The runs folded into this plan's record by `report.plans` (finalists are measured again)."""
    proposed_by: str | None = None
    """`solver`: the plan came from the per-block solver, queued before the search."""
    repeat_of: int | None = None
    """A finalist's re-run: the trial whose plan this measured again."""
    duplicate_of: int | None = None
    """The trial whose measurement this one reused (the sampler proposed the same plan again)."""

    @field_validator("strategy", mode="before")
    @classmethod
    def _label_of_an_older_study(cls, value: Any) -> Any:
        """Studies before hsdp and tp stored the strategy as its label (`ddp`, `fsdp`)."""
        return strategy_from_label(value) if isinstance(value, str) else value

    def as_data(self) -> dict[str, Any]:
        """The record as JSON values, fields without a value left out: report.json's trials, and (less
        the number) the trial's user attributes."""
        return self.model_dump(mode="json", exclude_none=True)


RECORD_ATTR = "record"  # the user attribute that holds a trial's record whole


def store_record(trial: BaseTrial, record: TrialRecord) -> None:
    """Keep `record` in the trial's user attributes, as one (each attribute is a write the study's journal
    makes durable on disk: a predicted search tells hundreds of trials a minute); what the trial was
    queued with (proposed_by, repeat_of) stays unless the record says otherwise."""
    trial.set_user_attr(RECORD_ATTR, {name: value for name, value in record.as_data().items() if name != "number"})


def read_record(trial: FrozenTrial) -> TrialRecord:
    """The record `store_record` kept, with the trial's number; a trial that stored none is running,
    or was interrupted by a killed tuner."""
    from optuna.trial import TrialState

    attrs = {**trial.user_attrs, "number": trial.number}
    attrs.update(attrs.pop(RECORD_ATTR, None) or {})  # studies before it kept one attribute per field
    if trial.state == TrialState.RUNNING:
        attrs["state"] = "running"
    elif trial.state == TrialState.FAIL:
        attrs.setdefault("state", "interrupted")
        attrs.setdefault("reason", INTERRUPTED)
    attrs["label"] = attrs.get("label") or str(trial.params)
    return TrialRecord.model_validate(attrs)


def plans(records: list[TrialRecord]) -> list[TrialRecord]:
    """One entry per measured plan, in trial order: its first trial with every run of it folded in
    (finalists are measured again). Throughput is the median of the runs; the peak is the largest,
    and the plan fits only if every run did: the cap must hold whichever run training resembles."""
    groups: dict[str, list[TrialRecord]] = {}
    for record in records:
        if record.state != "duplicate" and record.key is not None:
            groups.setdefault(record.key, []).append(record)
    found = []
    for group in groups.values():
        runs = [r for r in group if r.samples_per_s and r.measured_peak]
        if not runs:
            continue
        misfit = next((r for r in group if r.state != "feasible"), None)
        folded = {"samples_per_s": statistics.median(r.samples_per_s for r in runs),
                  "measured_peak": max(r.measured_peak for r in runs), "runs": len(runs)}
        if misfit:
            folded.update(state=misfit.state, reason=misfit.reason)
        found.append(group[0].model_copy(update=folded))
    return found


def ranked_feasible(records: list[TrialRecord]) -> list[TrialRecord]:
    """Plans that fit, best first: fastest; on a tie the smaller peak, then the earlier trial."""
    feasible = [p for p in plans(records) if p.state == "feasible"]
    return sorted(feasible, key=lambda p: (-p.samples_per_s, p.measured_peak, p.number))
