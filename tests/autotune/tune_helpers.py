"""Helpers of the tuner tests: the deterministic probe child, and finding processes a study left."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def use_fake_child(monkeypatch, seconds: float = 0.0) -> dict:
    """Probes run tests/autotune/fake_child.py: the real child with a formula for a measurement."""
    env = {"CKRUN_PROBE_CHILD": "fake_child", "FAKE_PROBE_SECONDS": str(seconds),
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def launches(directory: Path) -> list[dict]:
    """What the tuner started, from DIR/probes/probes.log."""
    path = Path(directory) / "probes" / "probes.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def survivors(pids: list[int]) -> list[int]:
    """Live processes in the process group of any of `pids` (each probe child leads its own group)."""
    groups, alive = set(pids), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone while we looked
        if fields[0] != "Z" and int(fields[2]) in groups:
            alive.append(int(stat.parent.name))
    return alive


def wait_for(condition, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {condition}")


def report(directory: Path) -> dict:
    return json.loads((Path(directory) / "report.json").read_text())


def trials_by_number(directory: Path) -> dict[int, dict]:
    return {t["number"]: t for t in report(directory)["trials"]}


def valid_points(space, recipe):
    """(params, the validated recipe's memory plan) of every point the recipe schema accepts; a point it
    refuses must be one of the combinations ckrun.runner.plan.memory_plan.plan_problems names (offload or a bucket beside
    sqrt segments, ...), which the tuner tells infeasible without a probe."""
    from dataclasses import replace

    from pydantic import ValidationError

    from ckrun.runner.plan.memory_plan import plan_problems
    from ckrun.runner.recipe.recipe import Recipe

    for params in space.all_params():
        candidate = space.candidate(params)
        try:
            yield params, Recipe.model_validate_json(candidate.recipe(recipe, 10**9).model_dump_json()).memory
        except ValidationError as err:
            facts = replace(recipe.step_facts(), precision=candidate.precision)  # fp16 with the host's optimizer
            assert plan_problems(candidate.plan, facts), f"{params} refused for another reason: {err}"
