"""One tune, its input already checked: the device, the model's facts, the space, the search, then
report.json, tuned.yaml and the training with the winner. `ckrun tune` (autotune/cli_tune.py) and the
Python API (`ckrun.tune`, autotune/api.py) fill in the same `TuneOptions`, have them checked into a
`TuneRequest` (autotune/request.py) and call `tune`, which prints nothing and returns a `TuneResult`:
the CLI prints it. Everything here happens under the study directory's lock.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from ckrun.runner.recipe.located import located_errors
from ckrun.runner.disk.lock import locked
from ckrun.runner.problems import EXIT_NOTHING_FITS, CkrunError, InputError, Place, Problem
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.train.loop import RunResult
from ckrun.runner.units import format_bytes

from .cap import MARGIN, Cap
from .outputs.rank_tune import check_devices, rank_training, ranks_comment
from .outputs.report import publish
from .outputs.train import Trained, nothing_fits, train_with_fallback
from .outputs.tuned import write_tuned
from .probes.priced import PricedPredictor, in_process
from .probes.probe import ProbeRunner, ProbeSettings
from .probes.screen import IsolatedPredictor, ModelChild, read_facts
from .probes.warm import WarmServer, preload_for, warm_enough
from .records import TrialRecord, ranked_feasible
from .search.predicted import (CachedPredictor, local_facts, predict_settings, predicted_device, predicted_note,
                               predicted_probe, ranked_lines)
from .search.run import SearchSettings, search
from .search.study import Budget, open_study
from .space.facts import Device, ModelFacts
from .space.knobs import KNOBS, build_space, differences, notes
from .space.pool_knobs import bound_space
from .space.space import Space

log = logging.getLogger(__name__)


class NothingFits(CkrunError):
    """No plan fits under --max-mem, or every one that did went over it in training (said already)."""

    exit_status = EXIT_NOTHING_FITS

    def lines(self) -> list[str]:
        return [f"ckrun tune: {self}"] if str(self) else []


TRIALS = 20  # plans measured when trials is not given
PREDICT_TRIALS = 150  # plans predicted when trials is not given: a prediction composed from parts is a fraction of a second


@dataclass(frozen=True)
class TuneOptions:
    """What a tune is asked for, unchecked: `ckrun tune`'s flags, each a field of the same name (and
    default), for the command line and `ckrun.tune(...)` alike (autotune/request.py checks them;
    autotune/search/predicted.py reads `gpu`, `predict`, `no_screen`, `finalists`, `seed`, `nproc` and
    `no_solver` from them)."""

    max_mem: str | int  # the cap as the user gave it: tuned.yaml's command and the messages repeat it
    recipe: str | None = None  # a file or library name; None: ./ckrun.yaml, else the library's default
    overrides: tuple[str, ...] = ()
    margin: float = MARGIN
    trials: int | None = None  # None: TRIALS, or PREDICT_TRIALS with predict
    time_budget: str | float | None = None  # 90s, 10m, 1h, or seconds
    output: str | None = None  # the study directory; None: the recipe's output.dir + /tune
    nproc: int = 1
    seed: int = 0
    finalists: int = 2
    predict: bool = False
    gpu: str | None = None
    resume: bool = False
    no_train: bool = False
    no_solver: bool = False
    no_screen: bool = False
    probe_timeout: float = 600.0
    warmup_steps: int = 2
    timed_steps: int = 3
    opened: dict[str, bool] = field(default_factory=dict)  # a knob flag's dest -> given: the knobs it opens

    @classmethod
    def from_args(cls, args) -> TuneOptions:
        named = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in ("opened", "overrides")}
        return cls(**named, overrides=tuple(args.overrides),
                   opened={knob.flag.dest: getattr(args, knob.flag.dest) for knob in KNOBS if knob.flag})

    @classmethod
    def from_keywords(cls, max_mem: str | int, **given) -> TuneOptions:
        """`ckrun.tune`'s keywords: the fields, and each knob flag's dest (`search_precision=True`)."""
        flags = {knob.flag.dest for knob in KNOBS if knob.flag}
        opened = {dest: bool(given.pop(dest)) for dest in flags if dest in given}
        unknown = sorted(set(given) - {f.name for f in fields(cls)} - {"opened"})
        if unknown:
            raise TypeError(f"tune() got unexpected keyword(s) {', '.join(unknown)}; it takes `ckrun tune`'s flags "
                            f"by their Python names: {', '.join(sorted([*(f.name for f in fields(cls)), *flags]))}")
        return cls(max_mem, **{**given, "overrides": tuple(given.get("overrides", ()))}, opened=opened)


@dataclass(frozen=True)
class TuneRequest:
    """A checked tune: the recipe (and where its lines are), the cap and budget, the study's directory
    and the GPU predictions are priced on, when named (--gpu). autotune/request.py makes it."""

    source: Path
    overrides: list[str]
    recipe: Recipe
    doc: object  # the recipe's located YAML document: errors name its lines
    cap: Cap
    budget: Budget
    directory: Path
    options: TuneOptions
    gpu: object = None  # ckrun.runner.predict.hardware.DeviceFacts, or None


@dataclass(frozen=True)
class Found:
    """What the search found, before tuned.yaml is written and the winner trains: what `ckrun tune`
    prints as soon as it is known."""

    directory: Path
    """The study's directory: study.journal, report.json, pareto.png, the probes' logs, tuned.yaml."""
    records: list[TrialRecord]
    """Every trial, as report.json lists them."""
    table: str
    """The Pareto table, the winner and why, and the warnings on it (what `ckrun report DIR` prints)."""
    ranked: list[TrialRecord]
    """The plans that fit, fastest first (predicted ones under --predict)."""
    change: str | None
    """What the winner changes from the recipe's own plan, in one line; None when nothing fits."""


@dataclass(frozen=True)
class TuneResult:
    """A finished tune: the plan chosen, the recipe that holds it, and its training."""

    found: Found
    winner: TrialRecord
    """The plan tuned.yaml holds: the fastest that fits, or the next one down where a faster one went
    over the cap in training."""
    tuned_path: Path
    """DIR/tuned.yaml: the recipe with the winner's plan, its cap and its provenance."""
    recipe: Recipe
    """tuned.yaml's recipe, as trained."""
    trained: RunResult | None
    """The training with the winner; None with no_train or predict."""

    @property
    def directory(self) -> Path:
        return self.found.directory


def tune(request: TuneRequest, on_found: Callable[[Found], None] | None = None) -> TuneResult:
    """Search under the study directory's lock, publish the report, then write tuned.yaml and train.
    Prints nothing: `on_found` is given what the search found before the training starts (`ckrun tune`
    prints it then); a plan that fits nowhere raises NothingFits after it."""
    directory, options = request.directory, request.options
    with locked(directory / "tune.lock", "`ckrun tune`", "is running this study",
                "wait for it to finish, or give this one --output ANOTHER_DIR", Place(str(directory))):
        if not options.no_train and not options.predict:
            _check_training_output(request)  # before the search, not an hour later
        # importing in the background from now on; a search predicted in this process starts no child from it
        warm = None if options.predict and in_process(request.recipe, True, "cuda") else \
            _warm_server(request.recipe, options.nproc, directory)
        try:
            records, space, device, config, screening = _tuned_search(request, warm)
        finally:
            if warm is not None:
                warm.stop()  # before training: its imports hold half a gigabyte
        table = publish(directory, records, config, screening)
        ranked = ranked_feasible(records)
        if options.predict and ranked:
            table += "\n" + ranked_lines(ranked)
        found = Found(directory, records, table, ranked, differences(space, space.base, ranked[0]) if ranked else None)
        if on_found is not None:
            on_found(found)
        return _conclude(request, found, space, device)


def _tuned_search(request: TuneRequest, warm: WarmServer | None) -> tuple[list[TrialRecord], Space, Device, dict, dict]:
    """The device, the model's facts, the space, then the search: (records, space, device, config, screening)."""
    options, recipe, cap = request.options, request.recipe, request.cap
    settings = ProbeSettings(options.probe_timeout, options.warmup_steps, options.timed_steps, options.nproc)
    probe_runner = ProbeRunner(request.directory, settings, warm)
    gpu = request.gpu
    if options.predict and gpu is None:  # predict for this machine's GPU, named by its device child
        gpu = local_facts(options, _device(probe_runner, recipe))
    device = predicted_device(gpu, options.nproc) if options.predict else _device(probe_runner, recipe)
    gpu = gpu or local_facts(options, device)
    check_cap_fits(cap, device, options.max_mem)
    if cap.meaning(device.kind):
        log.info(cap.meaning(device.kind))
    check_devices(device, options.nproc)
    # the user's model runs only in this child: the tuner never builds it or runs its forward
    screen = not options.no_screen and not in_process(recipe, options.predict, device.kind)  # else this process does
    model = ModelChild(recipe, probe_runner.directory, device.kind, options.probe_timeout, screen=screen,
                       nproc=options.nproc, time_facts=gpu, warm=warm)
    try:
        with located_errors(request.doc):
            facts = ModelFacts.from_json(read_facts(model, str(request.source)))
        space = build_space(recipe, facts, device, options.nproc, **options.opened)
        beside = _second_pricer(request, facts, device, model)  # importing on the other core from now on
        try:
            hopeless = bound_space(space, recipe, facts, device, cap, options.nproc)
            if hopeless:
                raise NothingFits(hopeless)
            records, config, screening = _search(request, probe_runner, space, device, model, beside)
        finally:
            if beside is not None:
                beside.close()
    finally:
        model.stop()
    return records, space, device, config, screening


def _warm_server(recipe: Recipe, nproc: int, directory: Path) -> WarmServer | None:
    """A server that forks the probes and the model child with torch imported (autotune/probes/warm.py):
    on a CPU, where imports are most of a small model's probe; None where children must start cold."""
    import torch

    on_cpu = recipe.train.device == "cpu" or not torch.cuda.is_available()  # counts devices, starts no CUDA
    if not warm_enough("cpu" if on_cpu else "cuda", nproc):
        return None
    server = WarmServer(directory / "probes", preload_for(recipe.model))
    server.start()
    return server


def _second_pricer(request: TuneRequest, facts: ModelFacts, device: Device, model: ModelChild):
    """A second pricer beside a search predicted in this process (autotune/probes/beside.py), where it pays."""
    options, recipe = request.options, request.recipe
    if not options.predict or not in_process(recipe, options.predict, device.kind):
        return None
    from .probes.beside import Beside, wanted  # torch's and the predictor's imports: only a predicted search needs them

    why = wanted(facts.parameters.count if facts.parameters else 0, options.nproc)
    if why is None:
        return None
    try:
        beside = Beside(recipe, device.kind, model.time_facts, request.directory / "probes")
    except OSError as err:  # no process to be had (a limit on processes, no memory to fork): it prices alone
        log.warning("pricing: no second process (%s): this one makes every trace", err)
        return None
    log.info("pricing: a second process makes traces beside this one (%s)", why)
    return beside


def _search(request: TuneRequest, probe_runner: ProbeRunner, space: Space, device: Device,
            model: ModelChild, beside=None) -> tuple[list[TrialRecord], dict, dict]:
    options, recipe, cap = request.options, request.recipe, request.cap
    config = _config(request, space, device)
    study, fresh = open_study(request.directory, config, options.resume)
    if options.no_screen:
        predictor = None
        log.info("screening: off (--no-screen): every new plan is probed")
    elif in_process(recipe, options.predict, device.kind):
        predictor = CachedPredictor(PricedPredictor(recipe, device.kind, model.time_facts, device.context_bytes,
                                                    options.nproc, cap.screen_above if options.predict else None,
                                                    beside))
        log.info("screening: every plan is predicted in this process (a library model: no code of the user's runs)")
    else:
        predictor = CachedPredictor(IsolatedPredictor(model, device.context_bytes))
        log.info("screening: a plan predicted over the cap plus the margin is told infeasible without a probe; "
                 "predictions run in a child process (%s)", model.directory)
    if options.predict:
        evaluate, settings = predicted_probe(predictor), predict_settings(options)
    else:
        evaluate = lambda candidate, number: probe_runner.probe(candidate.recipe(recipe, cap.bytes), number)  # noqa: E731
        off = "--no-solver" if options.no_solver else None
        if options.nproc > 1:
            off = f"--nproc {options.nproc}: the solver plans the blocks of one process"
        settings = SearchSettings(options.seed, options.finalists, off)
    try:
        records = search(study, fresh, recipe, space, cap, device, request.budget, evaluate, predictor, settings)
    finally:
        if predictor is not None:
            predictor.close()
    screening = predictor.summary() if predictor else {"state": "off", "reason": "--no-screen"}
    study.set_user_attr("screening", screening)  # `ckrun report` rewrites report.json with it
    return records, config, screening


def _conclude(request: TuneRequest, found: Found, space: Space, device: Device) -> TuneResult:
    """tuned.yaml for the winner, then training (falling back down the ranking), or why nothing fits."""
    options, cap, directory, records = request.options, request.cap, request.directory, found.records
    if not found.ranked:
        raise NothingFits(nothing_fits(records, cap, space, device, directory, options.predict))
    nproc = f" --nproc {options.nproc}" if options.nproc > 1 else ""

    def tuned_for(record: TrialRecord):
        lines = notes(space, record) + [note for note in [ranks_comment(options.nproc),
                                                          predicted_note(record) if options.predict else None] if note]
        return write_tuned(directory, request.doc, record, cap, str(options.max_mem), str(request.source),
                           request.overrides, records, lines, nproc)

    if options.no_train or options.predict:
        tuned_path, recipe = tuned_for(found.ranked[0])
        why = (f"--predict: measure it on the GPU with `ckrun tune {tuned_path} --max-mem {options.max_mem}{nproc}`"
               if options.predict else f"--no-train: train it with `ckrun {tuned_path}{nproc}`")
        log.info("tune: wrote %s; %s", tuned_path, why)
        return TuneResult(found, found.ranked[0], tuned_path, recipe, None)
    trained: Trained | None = train_with_fallback(found.ranked, tuned_for, options.resume,
                                                  **rank_training(options.nproc))
    if trained is None:  # RanksEnded above carries the ranks' own status
        raise NothingFits()  # train_with_fallback said why
    return TuneResult(found, trained.record, trained.path, trained.recipe, trained.result)


def _check_training_output(request: TuneRequest) -> None:
    """The winner trains into the recipe's output.dir, which --output (the study's directory) does not move:
    refused there now, the line says which flag moves what, not only that the directory holds a run."""
    from ckrun.runner.problems import InputError, Problem
    from ckrun.runner.train.loop import prepare_output

    out_dir = Path(request.recipe.output.dir)
    try:
        prepare_output(out_dir, request.options.resume, str(request.source), request.recipe)
    except InputError as err:
        moved = " (`ckrun tune` trains its winner in output.dir; --output moves only the study), or pass --no-train"
        raise InputError([Problem(p.place, p.key, p.message + moved) for p in err.problems]) from None
    log.info("tune: the winner trains into %s (the recipe's output.dir; output.dir=... moves it, --output the study)",
             out_dir)


def _device(probe_runner: ProbeRunner, recipe: Recipe) -> Device:
    import torch

    from .probes.child import device_info

    # is_available() only counts devices, it creates no CUDA context; a CPU run needs no child to ask
    if recipe.train.device == "cpu" or not torch.cuda.is_available():
        result = device_info(recipe)  # an InputError (cuda asked for, none here) goes straight to the user
    else:
        result = probe_runner.device(recipe)  # properties need CUDA initialised: that happens in a child, not here
    if result.get("status") != "ok":
        raise InputError([Problem(Place("<device>"), "train.device", f"cannot probe the device: {result.get('reason')}")])
    device = Device.from_json(result)
    log.info("tune: device %s%s", device.name, f", {format_bytes(device.total_bytes)}" if device.total_bytes else "")
    return device


def check_cap_fits(cap: Cap, device: Device, typed: str) -> None:
    """A cap above what the device holds is a typo (40GB for 4GB, a GPU's size for another's): one line."""
    if device.total_bytes and cap.bytes > device.total_bytes:
        raise InputError([Problem(Place(f"--max-mem {typed}"), "",
                                  f"more than the {device.name} has ({format_bytes(device.total_bytes)}); "
                                  f"give at most --max-mem {device.total_bytes // 10**9}GB")])


def _config(request: TuneRequest, space: Space, device: Device) -> dict:
    """What a resumed study must share with the one it continues."""
    options, cap = request.options, request.cap
    measured = request.recipe.model_dump_json(include={"model", "data", "train"}, exclude={"train": {"steps", "epochs"}})
    return {"recipe": hashlib.sha256(measured.encode()).hexdigest()[:16], "cap": cap.bytes, "margin": cap.margin,
            "seed": options.seed, "space": {"choices": space.choices, "fixed": space.fixed}, "device": device.name,
            "probe_steps": [options.warmup_steps, options.timed_steps],
            **({"nproc": options.nproc} if options.nproc > 1 else {}), **({"predicted": True} if options.predict else {})}
