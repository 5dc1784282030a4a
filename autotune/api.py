"""ckrun's memory plan inside your own training loop: ask for a plan under a cap, apply it to your model
in place, undo it.

    from ckrun.autotune.api import auto_checkpoint

    applied = auto_checkpoint(model, batch, memory_budget="8GB")   # plan and apply; the log says which and why
    for batch in loader:                                           # your loop, unchanged
        loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
    applied.remove()                                               # the model as it was

or in two steps, `plan = plan_memory(model, batch, max_mem="8GB")` then `apply_memory_plan(model, plan)`.
`plan_memory(recipe="my.yaml", max_mem="8GB", measure=True)` measures the plans instead, with
`ckrun tune`'s isolated probes (they rebuild the model from the recipe in fresh processes), and
`tune(recipe, max_mem="8GB")` is the whole of `ckrun tune` as a call, returning a TuneResult.

One path with the CLI, not a second implementation, and never through it: a predicted plan comes from
the estimator (runner/predict, what `ckrun estimate` runs: one step on fake tensors, here of a fake
copy of your model and your batch) and the solver (autotune/search/solver.py, whose per-block plans
`ckrun tune` starts from); a measured one from autotune/tune.py's `tune`, which `ckrun tune` calls too
(the CLI parses, calls and prints; this module never builds a command line); either is put on the model
by runner/memory/apply.py's `apply_plan`, as `ckrun RECIPE` applies a recipe's memory section.

What the estimate runs is ckrun's training step: your model's forward on the batch, a cross-entropy
over its logits against the batch's labels (zeros of the logits' shape when it has none), backward
and the optimizer's step (AdamW unless `optimizer` says otherwise), in `precision`. A loss of your
own needs about the same memory. The plan is the model's part (checkpointing, and offload on CUDA);
the batch and precision stay your loop's.

Every bad input is a `MemoryPlanError`: one line, no traceback from deep inside.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError
from torch import nn

from ckrun.runner.memory.apply import AppliedPlan, apply_plan
from ckrun.runner.plan.memory_plan import MemoryPlan, NoCheckpointing, NoOffload
from ckrun.runner.problems import CkrunError, InputError, first_line, one_line
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.units import format_bytes

from .cap import Cap

if TYPE_CHECKING:
    from .tune import TuneResult

log = logging.getLogger(__name__)

_applied: weakref.WeakKeyDictionary[nn.Module, AppliedPlan] = weakref.WeakKeyDictionary()


class MemoryPlanError(CkrunError, ValueError):
    """What the API could not do, in one line: nothing fits under the cap, the model has no repeated
    blocks, a batch or argument of the wrong kind, a recipe with problems."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


@dataclass(frozen=True)
class PlannedMemory:
    """A memory plan for one model, and why."""

    plan: MemoryPlan
    """The recipe's `memory` section: what `apply_memory_plan` puts on the model (checkpointing, offload)."""
    peak_bytes: int
    """The step's peak under the plan: predicted, or measured when `measured`."""
    cap_bytes: int
    measured: bool
    reason: str
    notes: list[str] = field(default_factory=list)
    """What the estimate assumed or left out, one line each."""

    def label(self) -> str:
        """`checkpointing layers:0,2`, with the offload and the micro-batch where the plan has them."""
        plan = self.plan
        return ", ".join([*([f"micro_batch {plan.micro_batch}"] if plan.micro_batch else []),
                          f"checkpointing {plan.checkpointing.label()}",
                          *([f"offload {plan.offload.label()}"] if plan.offload.moves else [])])

    def __str__(self) -> str:
        how = "measured" if self.measured else "predicted"
        return f"{self.label()}: {how} {format_bytes(self.peak_bytes)} (cap {format_bytes(self.cap_bytes)}); {self.reason}"


@dataclass
class AppliedMemoryPlan:
    """A plan on a model; `remove()` (or leaving a `with` block) puts the model back exactly as it was."""

    planned: PlannedMemory
    applied: AppliedPlan
    model: nn.Module

    def remove(self) -> None:
        self.applied.remove()
        if _applied.get(self.model) is self.applied:
            del _applied[self.model]

    def __enter__(self) -> AppliedMemoryPlan:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def auto_checkpoint(model: nn.Module, batch, memory_budget: str | int, **options) -> AppliedMemoryPlan:
    """`plan_memory(model, batch, max_mem=memory_budget, **options)` applied to `model` in place."""
    return apply_memory_plan(model, plan_memory(model, batch, max_mem=memory_budget, **options))


def plan_memory(model: nn.Module | None = None, batch=None, *, max_mem: str | int, recipe: str | Path | None = None,
                overrides: list[str] = (), device: str | None = None, precision: str = "fp32", optimizer=None,
                grad_clip: float | None = 1.0, blocks: str | None = None, margin: float = 0.05,
                measure: bool = False, output: str | Path | None = None, tune_options: dict | None = None) -> PlannedMemory:
    """The fastest plan whose peak stays under `max_mem` less `margin`, for `model` trained on batches
    like `batch` (or for `recipe`'s model and data, with `overrides`). `device`: where the step runs
    (default: the model's, else the recipe's). `measure`: `ckrun tune`'s probes measure the plans
    (a recipe only; `output` is the study's directory, `tune_options` more of its options: {"trials": 5})."""
    cap = _cap(max_mem, margin)
    if measure:
        if recipe is None:
            raise MemoryPlanError("measure=True needs a recipe: the probes rebuild the model from it in fresh "
                                  "processes; give recipe=..., or measure=False for a predicted plan")
        return _measured(recipe, list(overrides), max_mem, cap, output, dict(tune_options or {}))
    if recipe is not None:
        settings, estimator_of = _recipe_settings(recipe, list(overrides)), None
    else:
        if model is None or batch is None:
            raise MemoryPlanError("give a model and an example batch, or recipe=...")
        if not isinstance(model, nn.Module):
            raise MemoryPlanError(f"model is a {type(model).__name__}, not a torch.nn.Module")
        if model in _applied:
            raise MemoryPlanError("the model already carries a ckrun plan; remove() it before asking for another")
        settings = _given_settings(model, batch, precision, optimizer, grad_clip, blocks)
        estimator_of = (model, batch)
    device = device or (_device_of(model) if model is not None else settings.train.device)
    return _predicted(settings, estimator_of, _target(device), cap)


def apply_memory_plan(model: nn.Module, planned: PlannedMemory, device: str | None = None) -> AppliedMemoryPlan:
    """Put `planned.plan` on `model` in place (runner/memory/apply.py, as `ckrun` does); undo with `remove()`."""
    if not isinstance(model, nn.Module) or not isinstance(planned, PlannedMemory):
        raise MemoryPlanError(f"apply_memory_plan takes a torch.nn.Module and what plan_memory returned; got a "
                              f"{type(model).__name__} and a {type(planned).__name__}")
    if model in _applied:
        raise MemoryPlanError("the model already carries a ckrun plan; remove() it before applying another")
    try:
        applied = apply_plan(model, planned.plan, _target(device or _device_of(model)))
    except ValueError as err:
        raise MemoryPlanError(f"cannot apply {planned.label()}: {first_line(err)}") from None
    _applied[model] = applied
    micro = planned.plan.micro_batch
    log.info("memory plan applied: %s%s", planned, f"; micro_batch {micro}: feed the batch in micro-batches of "
             f"{micro} (gradient accumulation), which is your loop's part" if micro else "")
    return AppliedMemoryPlan(planned, applied, model)


# --- predicted: the estimator and the solver ----------------------------------------------------------


def _predicted(recipe: Recipe, given, device: str, cap: Cap) -> PlannedMemory:
    from ckrun.runner.predict.estimate import EstimateUnavailable
    from ckrun.runner.predict.plan_lines import plan_lines_quiet

    try:
        with plan_lines_quiet():  # the estimator applies every plan it prices: those lines are not the plan
            return _fastest_under(_estimator(recipe, given, device), cap)
    except MemoryPlanError:
        raise
    except (EstimateUnavailable, InputError) as err:
        raise MemoryPlanError(f"cannot predict this model's memory: {first_line(err)}") from None
    except ValueError as err:  # the plan's checks: no repeated blocks, a memory.blocks path that is not there
        raise MemoryPlanError(first_line(err)) from None


def _fastest_under(estimator, cap: Cap) -> PlannedMemory:
    """No plan where that is predicted to fit, else the solver's plan for the recipe's micro-batch (a
    given batch is fed whole) and precision, as `ckrun tune` proposes it (autotune/search/solver.py)."""
    from ckrun.runner.predict.block_costs import cost_table

    from .search.solver import propose

    base, precision = estimator.recipe.memory, estimator.recipe.precision
    kept = estimator.estimate(base.model_copy(update={"checkpointing": NoCheckpointing(), "offload": NoOffload()}),
                              precision)
    if kept.peak_bytes <= cap.limit:
        return PlannedMemory(base, kept.peak_bytes, cap.bytes, False, "keeping every block's activations is "
                             f"predicted to fit within {cap.describe()}", kept.notes)
    table = cost_table(estimator, base.micro_batch or estimator.recipe.train.batch_size, precision, timed_steps=0)
    predict = lambda plan: estimator.estimate(plan, precision).peak_bytes  # noqa: E731
    proposal = propose(table, cap.limit, predict, base, offload=estimator.cuda)
    if proposal is None:
        raise MemoryPlanError(f"nothing fits within {cap.describe()}: even recomputing every block is predicted at "
                              f"{format_bytes(table.full_peak)} (no plan: {format_bytes(table.none_peak)}); a smaller "
                              "batch (micro-batches with gradient accumulation) or bf16 needs less")
    return PlannedMemory(proposal.plan, proposal.predicted_peak, cap.bytes, False, proposal.reason,
                         estimator.estimate(proposal.plan, precision).notes)


def _estimator(recipe: Recipe, given, device: str):
    from ckrun.runner.predict.estimate import Estimator
    from ckrun.runner.predict.given import GivenModelEstimator
    from ckrun.runner.predict.hardware import this_cpu, this_gpu

    facts = this_cpu() if device == "cpu" else this_gpu()  # block times for the solver, predicted
    if given is None:
        return Estimator(recipe, device, facts)
    return GivenModelEstimator(*given, recipe, device, facts)


# --- measured: `ckrun tune` ---------------------------------------------------------------------------


def tune(recipe: str | Path | None = None, overrides: Sequence[str] = (), *, max_mem: str | int,
         **options) -> TuneResult:
    """`ckrun tune RECIPE OVERRIDES --max-mem SIZE ...` as a call, the same code: the fastest plan under the
    cap, measured by isolated probes (or predicted: `predict=True, gpu="h100"`), written to tuned.yaml
    and trained (`no_train=True` stops before). `options` are the command's flags by their Python names,
    with the same defaults (`trials=20`, `time_budget="10m"`, `output="runs/t"`, `search_precision=True`).
    Prints nothing; returns the winner, the tuned recipe, the study directory and the training's result.
    A refusal is a CkrunError naming the flag; nothing fitting is NothingFits (autotune/tune.py)."""
    from .request import check_request
    from .tune import TuneOptions, tune as tune_request

    asked = TuneOptions.from_keywords(max_mem, recipe=None if recipe is None else str(recipe),
                                      overrides=tuple(overrides), **options)
    return tune_request(check_request(asked))


def _measured(recipe: str | Path, overrides: list[str], max_mem, cap: Cap, output, tune_options: dict) -> PlannedMemory:
    """`tune(recipe, overrides, max_mem=..., no_train=True)`: its winner's memory section and measured peak."""
    try:
        found = tune(recipe, overrides, max_mem=max_mem, margin=cap.margin, no_train=True,
                     output=None if output is None else str(output), **tune_options)
    except TypeError as err:
        raise MemoryPlanError(f"tune_options: {err}") from None
    except CkrunError as err:
        raise MemoryPlanError(" ".join(err.lines()) or f"ckrun tune found no plan within {cap.describe()}") from None
    return PlannedMemory(found.recipe.memory, int(found.winner.measured_peak), cap.bytes, True,
                         f"the fastest of the plans `ckrun tune` measured within {cap.describe()} "
                         f"(study: {found.directory})")


# --- inputs -------------------------------------------------------------------------------------------


def _cap(max_mem, margin: float) -> Cap:
    try:
        return Cap.parse(max_mem, margin)
    except InputError as err:
        raise MemoryPlanError("; ".join(err.lines())) from None


def _recipe_settings(recipe: str | Path, overrides: list[str]) -> Recipe:
    from ckrun.runner.builders.checks import load_checked
    from ckrun.runner.recipe.library import resolve_recipe

    try:
        return load_checked(resolve_recipe(str(recipe)), overrides)[0]
    except InputError as err:
        raise MemoryPlanError("; ".join(err.lines())) from None


def _given_settings(model: nn.Module, batch, precision: str, optimizer, grad_clip, blocks) -> Recipe:
    """The training settings of a given model and batch in the recipe's schema. Its model and data
    sections only name the model's class and a task: the estimator copies the model and takes the batch."""
    from ckrun.runner.predict.given import BatchError, batch_size

    try:
        size = batch_size(batch)
    except BatchError as err:
        raise MemoryPlanError(f"batch: {err}") from None
    name = f"{type(model).__module__}:{type(model).__name__}"
    try:
        return Recipe.model_validate({
            "model": {"source": "python", "name": name}, "data": {"source": "synthetic", "task": "causal_lm"},
            "precision": precision, "memory": {"blocks": blocks},
            "train": {"batch_size": size, "steps": 1, "grad_clip": grad_clip, "optimizer": _optimizer(optimizer)}})
    except ValidationError as err:
        problem = err.errors()[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise MemoryPlanError(f"{where}: {problem['msg']}") from None


def _optimizer(optimizer) -> dict:
    """The recipe's `train.optimizer` for a name, a recipe dict or an optimizer of the loop's."""
    if optimizer is None:
        return {"name": "adamw"}
    if isinstance(optimizer, str):
        return {"name": optimizer}
    if isinstance(optimizer, torch.optim.Optimizer):
        return {"name": type(optimizer).__name__, "lr": float(optimizer.defaults.get("lr", 1e-3))}
    if isinstance(optimizer, dict):
        return optimizer
    raise MemoryPlanError(f"optimizer is a {type(optimizer).__name__}; give a torch.optim optimizer, its class "
                          "name ('AdamW') or a recipe's train.optimizer dict")


def _device_of(model: nn.Module) -> str:
    return next((p.device.type for p in model.parameters()), "cpu")


def _target(device) -> str:
    """cpu or cuda, from a device, its name, or auto (the GPU when there is one)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise MemoryPlanError(f"device {device!r}: ckrun plans for cpu or cuda")
    return kind
