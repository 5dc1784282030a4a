"""How a prediction names its plan (`plan_words`: `ckrun estimate`'s line, the run's line before step 1), and
the lines applying a plan prints, kept quiet while the estimator applies plans to a stand-in model:
`ckrun estimate`, `ckrun show --blocks` and the Python API's predicted plans (autotune/api.py)."""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def plan_lines_quiet():
    """The estimator applies the plan to a stand-in model; the lines a run prints for that ("checkpointing
    2 of 2 blocks") would only repeat the recipe above the prediction (or, for autotune/api.py, the plan
    it picks). Warnings still show; -v shows all."""
    # the plan; FSDP's sharding; model.lora's line, which a note repeats
    logs = [logging.getLogger(name) for name in ("ckrun.runner.memory", "ckrun.runner.parallel", "ckrun.runner.builders.adapters")]
    levels = [plan_log.level for plan_log in logs]
    for plan_log in logs:
        if not plan_log.isEnabledFor(logging.DEBUG):
            plan_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for plan_log, level in zip(logs, levels, strict=True):
            plan_log.setLevel(level)


def plan_words(recipe) -> str:
    """The batch, precision and plan a prediction is for, as its line says them."""
    return (f"batch {recipe.train.batch_size}, micro-batch {recipe.micro_batch}, {recipe.precision}, checkpointing "
            f"{', '.join([recipe.memory.checkpointing.label(), *recipe.memory.pool_changes()])}")
