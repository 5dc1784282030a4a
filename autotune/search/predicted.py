"""`ckrun tune RECIPE --max-mem SIZE --predict --gpu NAME`: the whole search with predictions in
place of probes, for a GPU this machine need not have.

Every plan the search would probe is instead predicted by the model child (peak and step time on
the named device, runner/predict), so nothing runs on a GPU and no user code runs beyond the fake
step. The answers are deterministic, so no plan is measured twice. The winner's tuned.yaml says it
was predicted (device, torch version, date); `ckrun tune tuned.yaml --max-mem SIZE` on that GPU
then measures, starting from its plan (the recipe's own plan is a starting point).

On a real GPU without --predict, the same child prices each prediction on that GPU's facts, so
the predicted times order the starting points and the solver uses predicted block times where it
has no measured ones.
"""

from __future__ import annotations

import logging
import time

import torch

from ckrun.runner.predict.hardware import DeviceFacts, UnknownDevice, resolve_device
from ckrun.runner.problems import InputError, Place, Problem
from ckrun.runner.units import format_bytes

from ..records import ProbeResult, TrialRecord
from .frontier import start_solving
from .run import SearchSettings
from ..space.candidate import Candidate
from ..space.facts import Device
from .study import Evaluate, Prediction

log = logging.getLogger(__name__)

# The CUDA context counts against a card-level cap. Measured on an H100 with torch 2.11 once
# BERT-large's kernels had loaded (docs/benchmarks.md); taken for any GPU a prediction names.
CONTEXT_BYTES = 804_000_000
RANKED_SHOWN = 10


def named_facts(args, recipe) -> DeviceFacts | None:
    """The device --gpu names, checked against the rest of the command line; None without --gpu."""
    if args.gpu is None:
        if args.predict and args.no_screen:
            raise _bad("--no-screen", "--predict answers every probe with a prediction; drop --no-screen")
        return None
    try:
        facts = resolve_device(args.gpu)
    except UnknownDevice as err:
        raise _bad("--gpu", str(err)) from None
    _check_target(args, recipe, facts)
    return facts


def local_facts(args, device: Device) -> DeviceFacts | None:
    """This machine's GPU by the name its device child reported (the tuner itself stays off the GPU);
    --predict without --gpu needs one it knows."""
    facts = None
    if device.kind == "cuda":
        try:
            facts = resolve_device(device.name)
        except UnknownDevice:
            facts = None
    if args.predict and facts is None:
        raise _bad("--predict", "predicting needs the device: name it with --gpu h100 (or a100, l4, a facts "
                                f".json, ...){'' if device.kind != 'cuda' else f'; {device.name} is not in the table'}")
    if facts is None and device.kind == "cuda":
        log.info("tune: %s is not in the device table: predictions screen by peak only (no step times)", device.name)
    return facts


def _check_target(args, recipe, facts: DeviceFacts | None) -> None:
    if facts is None:
        return
    if not args.predict and args.gpu is not None and not torch.cuda.is_available():
        raise _bad("--gpu", f"the probes run on this machine, which has no GPU; add --predict to tune for "
                            f"{facts.name} from predictions")
    if args.predict and args.no_screen:
        raise _bad("--no-screen", "--predict answers every probe with a prediction; drop --no-screen")
    if facts.kind == "cuda" and recipe.train.device == "cpu":
        raise _bad("train.device", f"the recipe trains on cpu but {facts.name} is a GPU; set train.device=auto")


def predicted_device(facts: DeviceFacts, nproc: int) -> Device:
    """The device a predicted search tunes for: the named GPU's memory and precisions, its context assumed."""
    version = torch.__version__.split("+")[0]
    if facts.kind == "cpu":
        return Device("cpu", facts.name, 0, ("fp32", "bf16"), version)
    precisions = ("fp32", "bf16", "fp16") if (facts.capability or (8, 0)) >= (8, 0) else ("fp32", "fp16")
    log.info("tune: --predict: %s, %s; CUDA context taken as %s (measured on an H100)", facts.name,
             format_bytes(facts.memory_bytes), format_bytes(CONTEXT_BYTES))
    return Device("cuda", facts.name, facts.memory_bytes, precisions, version, None, CONTEXT_BYTES, nproc)


class CachedPredictor:
    """A predictor asked once per plan: screening and the predicted probe share its answer."""

    def __init__(self, predictor):
        self.predictor, self.answers = predictor, {}

    def __call__(self, candidate: Candidate):
        if candidate.key not in self.answers:
            self.answers[candidate.key] = self.predictor(candidate)
        return self.answers[candidate.key]

    def frontier(self, request: dict) -> dict:
        return self.predictor.frontier(request)

    def frontier_later(self, request: dict):
        """The solver started now, answered when the returned function is called (where the predictor can
        solve beside the search: autotune/probes/beside.py); else solved now."""
        return start_solving(self.predictor, request)

    def prefetch(self, candidates: list[Candidate]) -> list[Candidate]:
        """These plans are asked next: returned in the order to ask them, those answered first, the rest in the
        predictor's order (a predictor with a second pricer starts on them)."""
        answered = [c for c in candidates if c.key in self.answers]
        rest = [c for c in candidates if c.key not in self.answers]
        prefetch = getattr(self.predictor, "prefetch", None)
        return answered + (prefetch(rest) if prefetch is not None and rest else rest)

    def ready(self, candidate: Candidate) -> bool:
        """Whether the plan costs little to predict now: answered already, or composed from parts made."""
        if candidate.key in self.answers:
            return True
        ready = getattr(self.predictor, "ready", None)
        return bool(ready and ready(candidate))

    def summary(self) -> dict:
        return self.predictor.summary()

    @property
    def time_facts(self):
        """The device the predictions' step times are on."""
        return self.predictor.time_facts

    def close(self) -> None:
        getattr(self.predictor, "close", lambda: None)()


def predicted_probe(predictor: CachedPredictor) -> Evaluate:
    """A probe answered by the prediction: its peak (context included) and its predicted throughput."""

    def evaluate(candidate: Candidate, number: int) -> ProbeResult:
        started = time.monotonic()
        prediction = predictor(candidate)
        facts = predictor.time_facts
        device = {"device": facts.name, "device_total_bytes": facts.memory_bytes, "torch": torch.__version__,
                  "cuda": None}
        if not isinstance(prediction, Prediction) or prediction.peak is None or not prediction.time:
            why = prediction.reason if isinstance(prediction, Prediction) and prediction.reason else \
                "the estimator could not run this plan on fake tensors"
            return ProbeResult(status="unavailable", reason=f"no prediction: {why}", **device)
        step = prediction.time
        return ProbeResult(status="ok", measured_peak_bytes=prediction.peak, samples_per_s=step["samples_per_s"],
                           step_s=step["seconds"], mfu=step["mfu"], hfu=step["hfu"], predicted=True,
                           probe_s=time.monotonic() - started, **device)
    return evaluate


def predict_settings(args) -> SearchSettings:
    if args.finalists:
        log.info("tune: --predict: no plan is measured twice (predictions do not vary), so --finalists is unused")
    return SearchSettings(args.seed, 0, "--nproc: the solver plans the blocks of one process" if args.nproc > 1
                          else ("--no-solver" if args.no_solver else None), timed_steps=0, predicted=True)


def ranked_lines(ranked: list[TrialRecord]) -> str:
    """The predicted ranking: step time, throughput, peak and MFU of the fastest plans that fit."""
    lines = [f"predicted ranking ({min(len(ranked), RANKED_SHOWN)} of {len(ranked)} plans that fit):",
             f"  {'trial':>5}  {'step':>9}  {'samples/s':>9}  {'peak':>9}  {'MFU':>5}  plan"]
    for record in ranked[:RANKED_SHOWN]:
        lines.append(f"  {record.number:>5}  {1000 * record.step_s:>7.1f}ms  {record.samples_per_s:>9.1f}  "
                     f"{format_bytes(record.measured_peak):>9}  {100 * record.mfu:>4.1f}%  {record.label}")
    return "\n".join(lines)


def predicted_note(record: TrialRecord) -> str:
    device = (record.device or {}).get("device")
    return (f"PREDICTED, not measured: {device}, step {1000 * record.step_s:.1f} ms, MFU {100 * record.mfu:.1f}% "
            f"by ckrun's roofline time model (an ordering and a first number, not a promise); on that GPU, "
            f"`ckrun tune THIS_FILE --max-mem SIZE` measures, starting from this plan")


def _bad(flag: str, message: str) -> InputError:
    return InputError([Problem(Place(flag), "", message)])
