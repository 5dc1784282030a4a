"""ckrun: train PyTorch models under a byte cap, with the fastest memory plan that fits.

The one import name of the installed package. Its parts are the repository's folders: `ckrun.runner`
(recipes, building, the memory plan, training, predicting), `ckrun.autotune` (the search; it stands on
runner) and `ckrun.recipes` (the recipe library). The public API is here, imported when first used, so
that `import ckrun` (and every `ckrun` command, which starts here) costs no torch import:

    import ckrun
    applied = ckrun.auto_checkpoint(model, batch, memory_budget="8GB")   # plan and apply in your own loop
    planned = ckrun.plan_memory(model, batch, max_mem="8GB")             # or ask first, then apply
    ckrun.apply_memory_plan(model, planned)
    tuned = ckrun.tune("my.yaml", max_mem="40GB", trials=10)            # `ckrun tune` as a call: a TuneResult
    run = ckrun.train("my.yaml", ["train.steps=10"])                    # `ckrun my.yaml ...`: a RunResult

The calls print nothing and return values; what they do is logged (`logging`), and bad input raises a
CkrunError whose `lines()` say what to change.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "runner").is_dir() and (_HERE.parent / "runner" / "__init__.py").is_file():
    # a checkout run without installing (`PYTHONPATH=. python -m ckrun`, the GPU machine): the parts are
    # the folders beside this one. Installed, they are inside it and this adds nothing.
    __path__.append(str(_HERE.parent))  # noqa: F821 - a package's own __path__



def append_import_roots(value: str) -> None:
    """The user's code folders (CKRUN_IMPORT_ROOTS: runner/recipe/load.py's add_import_root) on sys.path, after
    every installed package, never before: a user's runner.py or ckrun/ cannot shadow ckrun's modules.
    ckrun's child processes start with `python -P` and get these here, since each imports this first."""
    added = [root for root in value.split(os.pathsep) if root and root not in sys.path]
    sys.path.extend(added)
    if added:
        importlib.invalidate_caches()


append_import_roots(os.environ.get("CKRUN_IMPORT_ROOTS", ""))

_PUBLIC = {  # name -> the module that defines it
    "auto_checkpoint": "ckrun.autotune.api",
    "plan_memory": "ckrun.autotune.api",
    "apply_memory_plan": "ckrun.autotune.api",
    "PlannedMemory": "ckrun.autotune.api",
    "AppliedMemoryPlan": "ckrun.autotune.api",
    "MemoryPlanError": "ckrun.autotune.api",
    "tune": "ckrun.autotune.api",
    "TuneResult": "ckrun.autotune.tune",
    "train": "ckrun.runner.api",
    "RunResult": "ckrun.runner.train.loop",
    "CkrunError": "ckrun.runner.problems",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ckrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
