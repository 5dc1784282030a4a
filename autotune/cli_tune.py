"""`ckrun tune [RECIPE] [k=v ...] --max-mem SIZE`: find the fastest memory plan under a cap,
write DIR/tuned.yaml, then train with it.

Exit status: 0 a plan was found (and trained), 2 bad input, 3 nothing fits under the cap or no plan
could be measured (every probe failed: the line names the fault).
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import Path

from pydantic import ByteSize, TypeAdapter, ValidationError

from runner.builders.checks import load_checked
from runner.cli import Command, gpu_names
from runner.library import DEFAULT_RECIPE, resolve_recipe
from runner.located import located_errors
from runner.lock import locked
from runner.parallel.slurm import check_environment
from runner.problems import EXIT_BAD_INPUT, EXIT_NOTHING_FITS, CkrunError, InputError, Place, Problem
from runner.recipe import Recipe
from runner.units import format_bytes
from runner.yamlio import dump_yaml

from .probe import ProbeRunner, ProbeSettings
from .records import TrialRecord
from .report import publish, ranked_feasible
from .screen import IsolatedPredictor, ModelChild, read_facts
from .facts import Device, ModelFacts
from .knobs import KNOBS, build_space, differences, notes
from .pool_knobs import bound_space
from .space import Space
from .cap import Cap
from .rank_tune import check_devices, check_ranks, rank_training, ranks_comment
from .predicted import (CachedPredictor, local_facts, named_facts, predict_settings, predicted_device,
                        predicted_note, predicted_probe, ranked_lines)
from .search import SearchSettings, search
from .study import Budget, open_study, process_started
from .train import nothing_fits, train_with_fallback
from .tuned import write_tuned
from .warm import WarmServer, preload_for, warm_enough

log = logging.getLogger(__name__)

PREDICT_BUDGET_S = 540.0  # tune --predict's --time-budget when none is given: ends within 10 minutes here


class NothingFits(CkrunError):
    """No plan fits under --max-mem, or every one that did went over it in training (said already)."""

    exit_status = EXIT_NOTHING_FITS

    def lines(self) -> list[str]:
        return [f"ckrun tune: {self}"] if str(self) else []


def add_arguments(parser) -> None:
    parser.add_argument("recipe", nargs="?",
                        help=f"recipe file or library name; default ./ckrun.yaml, else {DEFAULT_RECIPE}")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.batch_size=32")
    parser.add_argument("--max-mem", required=True, metavar="SIZE", help="the cap on peak memory: 40GB, 40GiB, 512MB")
    parser.add_argument("--trials", type=int, default=20,
                        help="most new plans to measure; the finalists' re-runs come on top (default 20)")
    parser.add_argument("--time-budget", metavar="DURATION",
                        help="wall-clock budget of the search from the process's start (its imports, the model's "
                             "facts, the solver, probes and the finalists' re-runs; the winner's training aside): no "
                             "probe starts that would end past it, the first excepted; the solver and whole-space "
                             "predictions get a quarter of it: 90s, 10m, 1h")
    parser.add_argument("--output", metavar="DIR", help="study directory (default: the recipe's output.dir + /tune)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="tune for N ranks on this machine (torchrun): the cap holds per rank, each probe is a "
                             "group of N ranks, and how they share the work joins the search: ddp, fsdp and FSDP's "
                             "knobs, hsdp:S (N >= 4) and tp:T (a model with a tensor-parallel plan) (default 1)")
    parser.add_argument("--no-train", action="store_true", help="stop after writing DIR/tuned.yaml")
    parser.add_argument("--predict", action="store_true",
                        help="predict every plan instead of measuring it (peak and step time on --gpu, a roofline): "
                             "no GPU needed, nothing trained; tuned.yaml is marked predicted")
    parser.add_argument("--gpu", metavar="NAME",
                        help=f"the GPU to predict for: {gpu_names()}, the name torch reports, or a facts .json "
                             "measured on it (default: this machine's GPU)")
    parser.add_argument("--resume", action="store_true", help="continue the study in DIR; finished trials are kept")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed: the same seed proposes the same plans")
    parser.add_argument("--margin", type=float, default=0.05, help="fraction of the cap kept free (default 0.05)")
    for knob in KNOBS:  # the options that open a knob the space otherwise pins
        if knob.flag:
            parser.add_argument(knob.flag.option, action="store_true", help=knob.flag.help)
    parser.add_argument("--finalists", type=int, default=2, metavar="K",
                        help="measure the K fastest plans until each has 3 runs, and rank them by the median "
                             "(default 2; 0 trusts one probe per plan)")
    parser.add_argument("--no-solver", action="store_true",
                        help="no per-block plans from the solver (which times each block in a short real run); "
                             "start from the usual rules only")
    parser.add_argument("--no-screen", action="store_true",
                        help="no predictions: probe every plan, also those the estimator puts over the cap, "
                             "and start at the whole batch")
    parser.add_argument("--probe-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="wall-clock limit of one probe, and of each step of the model child (building the "
                             "model, the estimator's warm-up, one prediction); a probe over it counts as "
                             "infeasible, a prediction over it leaves its plan unscreened (default 600)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="untimed steps per probe (default 2: the peak is measured there, step 2 being the first with optimizer state)")
    parser.add_argument("--timed-steps", type=int, default=3, help="timed steps per probe; the median counts (default 3)")


def run(args) -> int:
    check_environment()  # a bad variable is one line before anything is read or started
    path, overrides = _recipe_source(args.recipe, args.overrides)
    recipe, doc = load_checked(path, overrides, user_code=False)  # the user's code is checked in the model child
    cap, budget = _cap(args), _budget(args)
    gpu = named_facts(args, recipe)  # the device predictions are priced on (--gpu), when named
    check_ranks(recipe, str(path), args.nproc)
    directory = _directory(args.output, recipe)
    log.info("tune: %s, batch %d, on %s; cap %s, limit %s", recipe.model.name, recipe.train.batch_size,
             recipe.train.device, format_bytes(cap.bytes), cap.describe())
    log.debug("tune: resolved recipe:\n%s", dump_yaml(recipe.model_dump(mode="json")))
    with locked(directory / "tune.lock", "`ckrun tune`", "is running this study",
                "wait for it to finish, or give this one --output ANOTHER_DIR", Place(str(directory))):
        if not args.no_train and not args.predict:
            _check_training_output(recipe, args.resume, str(path))  # before the search, not an hour later
        warm = _warm_server(recipe, args.nproc, directory)  # importing in the background from now on
        try:
            records, space, device, config, screening = _tuned_search(args, path, recipe, doc, cap, budget, gpu,
                                                                      directory, warm)
        finally:
            if warm is not None:
                warm.stop()  # before training: its imports hold half a gigabyte
        print(publish(directory, records, config, screening))
        if args.predict and ranked_feasible(records):
            print(ranked_lines(ranked_feasible(records)))
        return _conclude(args, records, doc, cap, space, device, directory, str(path), overrides)


def _tuned_search(args, path: Path, recipe: Recipe, doc, cap: Cap, budget: Budget, gpu, directory: Path,
                  warm: WarmServer | None) -> tuple[list[TrialRecord], Space, Device, dict, dict]:
    """The device, the model's facts, the space, then the search: (records, space, device, config, screening)."""
    settings = ProbeSettings(args.probe_timeout, args.warmup_steps, args.timed_steps, args.nproc)
    runner = ProbeRunner(directory, settings, warm)
    if args.predict and gpu is None:  # predict for this machine's GPU, named by its device child
        gpu = local_facts(args, _device(runner, recipe))
    device = predicted_device(gpu, args.nproc) if args.predict else _device(runner, recipe)
    gpu = gpu or local_facts(args, device)
    _check_cap_fits(cap, device, args.max_mem)
    if cap.meaning(device.kind):
        log.info(cap.meaning(device.kind))
    check_devices(device, args.nproc)
    # the user's model runs only in this child: the tuner never builds it or runs its forward
    model = ModelChild(recipe, runner.directory, device.kind, args.probe_timeout, screen=not args.no_screen,
                       nproc=args.nproc, time_facts=gpu, warm=warm)
    try:
        with located_errors(doc):
            facts = ModelFacts.from_json(read_facts(model, str(path)))
        space = build_space(recipe, facts, device, args.nproc,
                            **{knob.flag.dest: getattr(args, knob.flag.dest) for knob in KNOBS if knob.flag})
        hopeless = bound_space(space, recipe, facts, device, cap, args.nproc)
        if hopeless:
            raise NothingFits(hopeless)
        records, config, screening = _search(args, recipe, directory, cap, budget, runner, space, device, model)
    finally:
        model.stop()
    return records, space, device, config, screening


def _warm_server(recipe: Recipe, nproc: int, directory: Path) -> WarmServer | None:
    """A server that forks the probes and the model child with torch imported (autotune/warm.py): on a
    CPU, where imports are most of a small model's probe; None where children must start cold."""
    import torch

    on_cpu = recipe.train.device == "cpu" or not torch.cuda.is_available()  # counts devices, starts no CUDA
    if not warm_enough("cpu" if on_cpu else "cuda", nproc):
        return None
    server = WarmServer(directory / "probes", preload_for(recipe.model))
    server.start()
    return server


def _conclude(args, records: list[TrialRecord], doc, cap: Cap, space: Space, device: Device, directory: Path,
              source: str, overrides: list[str]) -> int:
    """tuned.yaml for the winner, then training (falling back down the ranking), or why nothing fits."""
    ranked = ranked_feasible(records)
    if not ranked:
        raise NothingFits(nothing_fits(records, cap, space, device, directory))

    def tuned_for(record: TrialRecord):
        lines = notes(space, record) + [note for note in [ranks_comment(args.nproc),
                                                          predicted_note(record) if args.predict else None] if note]
        return write_tuned(directory, doc, record, cap, args.max_mem, source, overrides, records, lines,
                           f" --nproc {args.nproc}" if args.nproc > 1 else "")

    print(f"ckrun tune: {differences(space, space.base, ranked[0])}")
    if args.no_train or args.predict:
        tuned_path, _ = tuned_for(ranked[0])
        nproc = f" --nproc {args.nproc}" if args.nproc > 1 else ""
        why = (f"--predict: measure it on the GPU with `ckrun tune {tuned_path} --max-mem {args.max_mem}{nproc}`"
               if args.predict else f"--no-train: train it with `ckrun {tuned_path}{nproc}`")
        log.info("tune: wrote %s; %s", tuned_path, why)
        return 0
    result = train_with_fallback(ranked, tuned_for, args.resume, **rank_training(args.nproc))  # RanksEnded: their status
    if result is None:
        raise NothingFits()  # train_with_fallback said why
    return 128 + result.stopped_by if result.stopped_by else 0  # 130/143, as `ckrun run` stops


def _search(args, recipe: Recipe, directory: Path, cap: Cap, budget: Budget, runner: ProbeRunner, space: Space,
            device: Device, model: ModelChild) -> tuple[list[TrialRecord], dict, dict]:
    config = _config(recipe, space, cap, args, device)
    study, fresh = open_study(directory, config, args.resume)
    predictor = None if args.no_screen else CachedPredictor(IsolatedPredictor(model, device.context_bytes))
    if args.no_screen:
        log.info("screening: off (--no-screen): every new plan is probed")
    else:
        log.info("screening: a plan predicted over the cap plus the margin is told infeasible without a probe; "
                 "predictions run in a child process (%s)", model.directory)
    if args.predict:
        evaluate, settings = predicted_probe(predictor), predict_settings(args)
    else:
        evaluate = lambda candidate, number: runner.probe(candidate.recipe(recipe, cap.bytes), number)  # noqa: E731
        off = "--no-solver" if args.no_solver else None
        if args.nproc > 1:
            off = f"--nproc {args.nproc}: the solver plans the blocks of one process"
        settings = SearchSettings(args.seed, args.finalists, off)
    records = search(study, fresh, recipe, space, cap, device, budget, evaluate, predictor, settings)
    screening = predictor.summary() if predictor else {"state": "off", "reason": "--no-screen"}
    study.set_user_attr("screening", screening)  # `ckrun report` rewrites report.json with it
    return records, config, screening


def _recipe_source(given: str | None, overrides: list[str]) -> tuple[Path, list[str]]:
    """RECIPE may be left out: `ckrun tune train.steps=5 --max-mem 1GB` has overrides only."""
    overrides = list(overrides)
    if given is not None and "=" in given and not Path(given).exists():
        overrides.insert(0, given)
        given = None
    if given is not None:
        return resolve_recipe(given), overrides
    if Path("ckrun.yaml").is_file():
        log.info("tune: no recipe given: using ./ckrun.yaml")
        return Path("ckrun.yaml"), overrides
    log.info("tune: no recipe given and no ./ckrun.yaml here: using the library's %s", DEFAULT_RECIPE)
    return resolve_recipe(DEFAULT_RECIPE), overrides


def _cap(args) -> Cap:
    try:
        cap = int(TypeAdapter(ByteSize).validate_python(args.max_mem))
    except ValidationError:
        raise _bad("--max-mem", f"{args.max_mem!r} is not a size; write it like 40GB, 40GiB or 512MB") from None
    if cap <= 0:
        raise _bad("--max-mem", f"the cap must be positive but got {args.max_mem!r}")
    if not 0 <= args.margin < 0.5:
        raise _bad("--margin", f"a fraction of the cap in [0, 0.5) but got {args.margin}")
    return Cap(cap, args.margin)


def _budget(args) -> Budget:
    if args.trials < 1:
        raise _bad("--trials", f"at least 1 plan must be measured but got {args.trials}")
    if args.finalists < 0:
        raise _bad("--finalists", f"cannot be negative but got {args.finalists}")
    if args.probe_timeout <= 0 or args.warmup_steps < 0 or args.timed_steps < 1:
        raise _bad("--probe-timeout/--warmup-steps/--timed-steps", "need a positive timeout, warm-up >= 0, timed >= 1")
    seconds = parse_duration(args.time_budget) if args.time_budget else None
    if seconds is None and args.predict:
        seconds = PREDICT_BUDGET_S
        log.info("tune: --predict: a time budget of %g min (--time-budget changes it): a large model's predictions "
                 "take seconds each, and a predicted search should answer in minutes", seconds / 60)
    return Budget(args.trials, seconds, process_started())


def parse_duration(text: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not match or float(match[1]) <= 0:
        raise _bad("--time-budget", f"{text!r} is not a duration; write it like 90s, 10m or 1h")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def _bad(flag: str, message: str) -> InputError:
    return InputError([Problem(Place(flag), "", message)])


def _directory(output: str | None, recipe: Recipe) -> Path:
    if output:
        directory = Path(output)
    else:
        directory = Path(recipe.output.dir) / "tune"
        log.info("tune: study directory %s (the recipe's output.dir + /tune; --output to change)", directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _check_training_output(recipe: Recipe, resume: bool, source: str) -> None:
    from runner.train.loop import prepare_output

    prepare_output(Path(recipe.output.dir), resume, source)


def _device(runner: ProbeRunner, recipe: Recipe) -> Device:
    import torch

    from .child import device_info

    # is_available() only counts devices, it creates no CUDA context; a CPU run needs no child to ask
    if recipe.train.device == "cpu" or not torch.cuda.is_available():
        result = device_info(recipe)  # an InputError (cuda asked for, none here) goes straight to the user
    else:
        result = runner.device(recipe)  # properties need CUDA initialised: that happens in a child, not here
    if result.get("status") != "ok":
        raise InputError([Problem(Place("<device>"), "train.device", f"cannot probe the device: {result.get('reason')}")])
    device = Device.from_json(result)
    log.info("tune: device %s%s", device.name, f", {format_bytes(device.total_bytes)}" if device.total_bytes else "")
    return device


def _check_cap_fits(cap: Cap, device: Device, typed: str) -> None:
    if device.total_bytes and cap.bytes > device.total_bytes:
        raise _bad(f"--max-mem {typed}", f"more than the {device.name} has ({format_bytes(device.total_bytes)}); "
                                         f"give at most --max-mem {device.total_bytes // 10**9}GB")


def _config(recipe: Recipe, space: Space, cap: Cap, args, device: Device) -> dict:
    """What a resumed study must share with the one it continues."""
    measured = recipe.model_dump_json(include={"model", "data", "train"}, exclude={"train": {"steps", "epochs"}})
    return {"recipe": hashlib.sha256(measured.encode()).hexdigest()[:16], "cap": cap.bytes, "margin": cap.margin,
            "seed": args.seed, "space": {"choices": space.choices, "fixed": space.fixed}, "device": device.name,
            "probe_steps": [args.warmup_steps, args.timed_steps], **({"nproc": args.nproc} if args.nproc > 1 else {}),
            **({"predicted": True} if args.predict else {})}


COMMAND = Command(
    "tune", "search memory plans under a cap, write tuned.yaml, then train with the fastest", add_arguments, run,
    epilog="examples:\n  ckrun tune recipes/bert_large.yaml --max-mem 40GB\n"
    "  ckrun tune --max-mem 24GB --trials 30 --time-budget 20m      # ./ckrun.yaml, else the default recipe\n"
    "  ckrun tune bert_tiny --max-mem 150MB --no-train --output runs/t  # then: ckrun runs/t/tuned.yaml\n"
    "  ckrun tune bert_tiny --max-mem 150MB --output runs/t --resume    # continue a stopped study\n"
    "  ckrun tune recipes/bert_large.yaml --max-mem 40GB --predict --gpu h100   # no GPU needed: predicted\n"
    f"exit status: 0 tuned (and trained), {EXIT_BAD_INPUT} bad input, {EXIT_NOTHING_FITS} nothing fits under the cap "
    "or no plan could be measured (the line says why)",
)
