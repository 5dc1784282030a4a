"""The environment variables ckrun reads, each checked as a recipe key is: a value ckrun cannot use is
one line naming the variable and what to set (exit 2), never an internal error or a silent default.

The readers here serve every layer; SLURM's variables are read in runner/parallel/slurm.py with the
same `whole_number`, and `ckrun.runner.parallel.ranks.check_environment` checks them all before a run or a
tune starts, so a bad variable ends it before anything is written.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from .problems import InputError, Place, Problem

PLACE = Place("environment")

HEARTBEAT_ENV = "CKRUN_LOCK_HEARTBEAT_S"  # how often a lock's holder touches it (runner/disk/lock.py)
IMPORT_TIMEOUT_ENV = "CKRUN_IMPORT_TIMEOUT"  # how long importing the user's module may take before it counts as hung
USER_CODE_TIMEOUT_ENV = "CKRUN_USER_CODE_TIMEOUT"  # how long one call of the user's factory or metric may take
DURATIONS = {HEARTBEAT_ENV: 5.0, IMPORT_TIMEOUT_ENV: 120.0, USER_CODE_TIMEOUT_ENV: 900.0}  # their defaults
IMPORT_ROOTS_ENV = "CKRUN_IMPORT_ROOTS"  # the user's code folders for child processes (runner/recipe/load.py, ckrun/__init__.py)
CAPABILITY_ENV = "CKRUN_CUDA_CAPABILITY"  # "9.0": the card's, when the tuner hides the GPUs from its model child

# torchrun's variables: when WORLD_SIZE is set, this process is one rank of a group
TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def problem(name: str, message: str) -> InputError:
    return InputError([Problem(PLACE, name, message)])


def seconds(name: str, default: float, environ: Mapping[str, str] = os.environ) -> float:
    """A duration in seconds above 0 (a finite number); `default` when the variable is unset or empty."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise problem(name, f"must be a number of seconds above 0, not {text!r}; set one, or unset it for the "
                      f"default {default:g}")
    return value


def whole_number(name: str, low: int, high: int | None = None, environ: Mapping[str, str] = os.environ,
                 default: int | None = None, fix: str = "") -> int | None:
    """A whole number in [low, high]; `default` when unset or empty."""
    text = environ.get(name, "").strip()
    if not text:
        return default
    value = int(text) if re.fullmatch(r"[+-]?[0-9]{1,18}", text) else None  # one sign at most: '--0' is no number
    if value is None or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of {low} or more"
        raise problem(name, f"must be a whole number {bounds}, not {text!r}{'; ' + fix if fix else ''}")
    return value


def check_torchrun(environ: Mapping[str, str] = os.environ) -> None:
    """WORLD_SIZE set: this is one rank of a group, and torchrun's other variables must say which."""
    if "WORLD_SIZE" not in environ:
        return
    fix = "start the ranks with torchrun or `ckrun --nproc N`, or unset WORLD_SIZE to train as one process"
    missing = [name for name in TORCHRUN if not environ.get(name, "").strip()]
    if missing:
        raise problem(missing[0], f"is unset, but WORLD_SIZE is set ({environ['WORLD_SIZE']!r}), which makes this "
                      f"process one rank of a group; {fix}")
    world = whole_number("WORLD_SIZE", 1, 1 << 20, environ, fix=fix)
    whole_number("RANK", 0, world - 1, environ, fix=f"RANK counts the group's {world} rank(s) from 0")
    whole_number("LOCAL_RANK", 0, world - 1, environ, fix="LOCAL_RANK counts the ranks on this machine from 0")
    whole_number("LOCAL_WORLD_SIZE", 1, world, environ, fix="the ranks on this machine")
    whole_number("MASTER_PORT", 1, 65535, environ, fix="a TCP port")


def check(environ: Mapping[str, str] = os.environ) -> None:
    """Every variable below runner/parallel that ckrun reads."""
    for name, default in DURATIONS.items():
        seconds(name, default, environ)
    capability = environ.get(CAPABILITY_ENV, "").strip()
    if capability and not re.fullmatch(r"[0-9]{1,2}\.[0-9]{1,2}", capability):
        raise problem(CAPABILITY_ENV, f"must be a compute capability MAJOR.MINOR such as 9.0, not {capability!r}; "
                      "unset it to read the GPU's own")
    check_torchrun(environ)
