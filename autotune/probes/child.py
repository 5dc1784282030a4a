"""The probe child: measures one candidate in a fresh process.

A fresh process per candidate means a crash, an out-of-memory or a hang costs one probe and never
the tuner, and every measurement starts from an empty allocator. The tuner starts it as the leader
of a new session, so killing its process group also takes anything it started (compile workers).

    python -m ckrun.autotune.probes.child probe  RECIPE.json RESULT.json --parent PID --trial N --warmup W --timed T
    python -m ckrun.autotune.probes.child device RECIPE.json RESULT.json --parent PID

With `--nproc N` (N > 1) the probe runs as a torchrun group of N ranks: this process starts them
and combines their results, each rank being this module again (autotune/probes/rank_probe.py).

The result is written atomically; no result file means the process died before it could report.
Once it is written the process leaves at once (`finish`), without the interpreter's teardown.

Test hook (read only here): CKRUN_PROBE_FAULT=KIND:TRIAL[,KIND:TRIAL...] injects a fault into the
probe of trial TRIAL (KIND:TRIAL@RANK: only in that rank of a group). KIND is `oom` (torch.OutOfMemoryError, as a step that ran out would raise),
`crash` (the process kills itself with SIGSEGV before reporting) or `hang` (starts a grandchild,
then sleeps: the tuner's timeout must kill both).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from ckrun.runner.disk.files import write_atomic
from ckrun.runner.problems import first_line

from ..records import ProbeResult

FAULT_ENV = "CKRUN_PROBE_FAULT"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    die_with_parent(args.parent)
    recipe_json = Path(args.recipe).read_text(encoding="utf-8")
    if args.what == "device":
        result = _guarded(lambda: device_info(recipe_from_json(recipe_json)))
    elif args.nproc > 1 and "WORLD_SIZE" in os.environ:  # one rank of a probe's group
        return _rank_probe(args, recipe_json)
    elif args.nproc > 1:  # the group's agent
        from . import rank_probe

        command = rank_probe.rank_command(__spec__.name, args.recipe, args.result, args.trial, args.warmup,
                                          args.timed, args.nproc)
        result = _guarded(lambda: rank_probe.run_group(command, Path(args.result), args.nproc))
    else:
        result = _guarded(lambda: _probe(recipe_json, args.trial, args.warmup, args.timed))
    write_atomic(Path(args.result), result.to_json() if isinstance(result, ProbeResult) else json.dumps(result, indent=1))
    return 0


def _rank_probe(args, recipe_json: str) -> int:
    from .warm import note_launch
    from .rank_probe import write_rank_result

    rank = int(os.environ["RANK"])
    note_launch(Path(args.result).parent, "rank", args.trial, os.getpid())  # the tuner kills what a timeout leaves
    result = _guarded(lambda: _probe(recipe_json, args.trial, args.warmup, args.timed))
    return write_rank_result(Path(args.result), rank, result)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ckrun.autotune.probes.child")
    parser.add_argument("what", choices=["probe", "device"])
    parser.add_argument("recipe", help="the candidate recipe as JSON")
    parser.add_argument("result", help="where the result JSON goes")
    parser.add_argument("--parent", type=int, required=True, help="the tuner's pid; its death ends this process")
    parser.add_argument("--trial", type=int, default=-1)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1, help="ranks of the probe's torchrun group")
    return parser


def die_with_parent(parent: int) -> None:
    """A tuner killed by SIGKILL cannot clean up: each child watches for it and takes its group down."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if os.getpgrp() == os.getpid():  # only as the group leader the tuner made us: never kill a shell's group
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def recipe_from_json(text: str):
    from ckrun.runner.recipe.recipe import Recipe

    return Recipe.model_validate_json(text)  # JSON mode: strict fields accept lists for tuples


def _guarded(work):
    """Turn every failure into a result the tuner can record: the reason is one line, the rest is logged.
    `work` returns a ProbeResult, or the device's facts (a plain dict, as `Device.from_json` reads them)."""
    from ckrun.runner.problems import InputError

    try:
        return work()
    except InputError as err:
        return ProbeResult.failed("bad_input", "; ".join(str(p) for p in err.problems))
    except Exception as err:  # a candidate that breaks must not stop the search: record it and move on
        if _is_out_of_memory(err):
            return ProbeResult.failed("oom", f"out of memory: {first_line(err)}")
        traceback.print_exc()
        return ProbeResult.failed("crash", f"{type(err).__name__}: {first_line(err)}")


def _is_out_of_memory(err: Exception) -> bool:
    """CUDA's and the CPU allocator's errors alike: a probe on the CPU that runs out is over the cap, not broken."""
    if "torch" not in sys.modules:  # not imported means not even started: only Python itself can have run out
        return isinstance(err, MemoryError)
    from ckrun.runner.builders.oom import is_out_of_memory

    return is_out_of_memory(err)


def _probe(recipe_json: str, trial: int, warmup: int, timed: int) -> ProbeResult:
    fault = _fault_for(trial)
    if fault:
        _inject(fault)
    return measure(recipe_from_json(recipe_json), warmup, timed)


def measure(recipe, warmup: int, timed: int) -> ProbeResult:
    """Warm-up and timed steps of `recipe`, with `measured_peak_bytes`, the number held against the cap."""
    from ckrun.runner.train.measure.probe import probe

    return ProbeResult.of(probe(recipe, warmup, timed, source="<candidate>"))


def device_info(recipe) -> dict:
    """The device the recipe trains on and what it can do, asked once in a child so the tuner never inits CUDA."""
    import torch
    from ckrun.runner.memory.measure import context_after_kernels, note_card_before_cuda
    from ckrun.runner.train.trainer import pick_device

    note_card_before_cuda()
    device = pick_device(recipe)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        precisions = ["fp32", "fp16"] + (["bf16"] if torch.cuda.is_bf16_supported() else [])
        return {"status": "ok", "kind": "cuda", "name": props.name, "total_bytes": props.total_memory,
                "precisions": precisions, "torch": torch.__version__, "cuda": torch.version.cuda,
                "capability": f"{props.major}.{props.minor}",
                "context_bytes": context_after_kernels(device), "count": torch.cuda.device_count()}
    # fp16 autocast on a CPU is emulated and slower than fp32: only bf16 is worth a probe there
    return {"status": "ok", "kind": "cpu", "name": f"cpu ({platform.processor() or platform.machine()})",
            "total_bytes": 0, "precisions": ["fp32", "bf16"], "torch": torch.__version__, "cuda": None}


def _fault_for(trial: int) -> str | None:
    rank = os.environ.get("RANK", "0")
    for item in os.environ.get(FAULT_ENV, "").split(","):
        kind, _, where = item.strip().partition(":")
        number, _, in_rank = where.partition("@")
        if number.strip().isdigit() and int(number) == trial and in_rank.strip() in ("", rank):
            return kind
    return None


def _inject(kind: str) -> None:
    import torch

    print(f"{FAULT_ENV}: injecting {kind}", file=sys.stderr, flush=True)
    if kind == "oom":
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by {FAULT_ENV})")
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "ckrun-probe-grandchild"])
        time.sleep(3600)
    raise ValueError(f"{FAULT_ENV}: unknown fault {kind!r}; use oom, crash or hang")


def finish(code: int) -> None:
    """Exit now: the result is on disk, and a teardown (torch's, or the user's atexit hooks and
    non-daemon threads) could hold the process long enough for the tuner to call it a timeout."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    finish(main())
