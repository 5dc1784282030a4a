"""`ckrun estimate RECIPE [k=v ...] [--device cuda|cpu] [--gpu NAME] [--json]`: predicted peak and time of
one step, no GPU needed.

The time is a roofline of the step's ops on the named device (runner/predict/roofline.py): an
ordering of plans and a first number, not a promise. Without --gpu it is predicted for this
machine's GPU when there is one (its name looked up), for this CPU with --device cpu, and not at
all for --device cuda on a machine without a GPU (the line says how to ask for it).
"""

from __future__ import annotations

import json
import time

from ..builders.checks import load_checked
from ..recipe.library import resolve_recipe
from ..recipe.located import located_errors
from ..problems import InputError, Place, Problem, keyed_error
from ..predict.plan_lines import plan_lines_quiet, plan_words
from ..units import format_bytes
from . import Command, add_recipe_arguments, gpu_names


def add_arguments(parser):
    add_recipe_arguments(parser)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="the device to predict for (default cuda: works without a GPU)")
    parser.add_argument("--gpu", metavar="NAME",
                        help=f"predict the step's time on this GPU: a short name ({gpu_names()}), the name torch "
                             "reports (\"NVIDIA A100-SXM4-40GB\"), or a facts .json measured on the GPU; default: "
                             "this machine's GPU. `cpu`: this CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--nproc", type=int, metavar="N", help="predict one of N ranks (distributed.strategy ddp, "
                        "fsdp, hsdp or tp): its share of the batch, FSDP's shards and gathered blocks, the layers "
                        "tensor parallelism splits, DDP's buckets")


def run(args) -> int:
    path = resolve_recipe(args.recipe)
    recipe, doc = load_checked(path, args.overrides)  # a typo is said before torch is imported
    device, facts, why_no_time = target_facts(args.device, args.gpu)
    from ..predict.estimate import EstimateUnavailable, Estimator

    started = time.perf_counter()
    if args.nproc is not None:  # one rank of N: runner/predict/per_rank.py
        from ..parallel.launch import check_launch
        from ..predict.per_rank import per_rank

        check_launch(recipe, str(path), args.nproc)
        Estimator = per_rank(args.nproc, str(path))  # noqa: N806 - stands in for the class
    with located_errors(doc), plan_lines_quiet():
        estimate = _estimate(Estimator, EstimateUnavailable, recipe, device, facts, str(path))
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**estimate.record(), "seconds": round(seconds, 2),
                          **({"time_unavailable": why_no_time} if why_no_time else {})}))
        return 0
    per = f" per rank of {args.nproc}" if args.nproc else ""
    print(f"{path}: predicted peak {format_bytes(estimate.peak_bytes)} per step{per} on {device} ({plan_words(recipe)})")
    for line in breakdown_lines(estimate.breakdown, estimate.pool_peaks):
        print(f"  {line}")
    for line in time_lines(estimate.time) if estimate.time else [f"step time: not predicted ({why_no_time})"]:
        print(f"  {line}")
    for note in estimate.notes:
        print(f"  note: {note}")
    for warning in estimate.warnings:
        print(f"  warning: {warning}")
    return 0


def breakdown_lines(breakdown: dict[str, int], pool_peaks: dict[str, int]) -> list[str]:
    """Each pool's bytes at the moment of the peak (they sum to it) and, beside them, the most it holds at any
    moment of the step (the allocator's own columns have none: they are what the peak's moment leaves)."""
    width = max(16, *(len(category) for category in breakdown))
    lines = [f"{'':<{width}} {'at the peak':>11}  {'own most':>10}"] if pool_peaks else []
    for category, count in breakdown.items():
        most = pool_peaks.get(category)
        lines.append(f"{category:<{width}} {format_bytes(count):>11}" + (f"  {format_bytes(most):>10}" if most is not None
                                                                          else ""))
    return lines


def target_facts(device: str, gpu: str | None):
    """(the device to estimate for, its facts or None, why there are none) from --device and --gpu."""
    from ..predict.hardware import UnknownDevice, resolve_device, this_cpu, this_gpu

    if gpu is not None:
        try:
            facts = resolve_device(gpu)
        except UnknownDevice as err:
            raise InputError([Problem(Place("--gpu"), "", str(err))]) from None
        if device == "cpu" and facts.kind == "cuda":
            raise InputError([Problem(Place("--gpu"), "", f"{gpu!r} is a GPU but --device is cpu; drop one of them")])
        return facts.kind, facts, ""
    if device == "cpu":
        return "cpu", this_cpu(), ""
    facts = this_gpu()
    if facts is None:
        import torch

        return "cuda", None, ("this machine's GPU is not in the table; name one with --gpu" if torch.cuda.is_available()
                              else "no GPU here: name one with --gpu h100 (or a100, l4, ...)")
    return "cuda", facts, ""


def time_lines(step) -> list[str]:
    """The step-time part of the estimate, as `ckrun estimate` prints it."""
    rate = f"{step.samples_per_s:,.1f} samples/s" + (f", {step.tokens_per_s:,.0f} tokens/s" if step.tokens_per_s else "")
    parts = ", ".join(f"{name} {1000 * value:.1f} ms" for name, value in (
        ("forward", step.forward_s), ("backward", step.backward_s), ("recompute", step.recompute_s),
        ("update", step.update_s), ("offload", step.offload_s), ("collectives", step.comm_s)) if value)
    kernels = ", ".join(f"{name} {1000 * value:.1f} ms" for name, value in step.by_class.items() if value)
    first = (f"  the first step also runs selective checkpointing's learning forward: {1000 * step.first_step_extra_s:.1f}"
             " ms once" if step.first_step_extra_s else "")
    return [f"step time {1000 * step.seconds:.1f} ms on {step.device}: {rate}",
            f"  MFU {100 * step.mfu:.1f}%, HFU {100 * step.hfu:.1f}% ({step.model_flops / 1e12:.2f} TFLOP of the model, "
            f"{step.flops / 1e12:.2f} run, a step)",
            f"  {parts}", *([f"  by kernel: {kernels}"] if kernels else []), *([first] if first else []),
            "  (a roofline of the step's ops: an ordering of plans and a first number, not a promise; "
            "docs/predicting.md: calibrating it on a GPU)"]


def _estimate(estimator, unavailable, recipe, device: str, facts, source: str):
    from ..predict.estimate import Estimator
    from ..predict.fallback import estimate_or_probe

    try:
        if estimator is not Estimator:  # one rank of N: no real probe stands in for a fake process group
            return estimator(recipe, device, facts).estimate()
        return estimate_or_probe(lambda estimator_class: estimator_class(recipe, device, facts))
    except unavailable as err:
        raise InputError([Problem(Place(source), "model", f"prediction is unavailable: {err}; "
                                  "`ckrun tune` will measure this recipe instead")]) from None
    except ValueError as err:  # a KeyedError keeps its key (the model, the data); the plan's start with theirs
        raise keyed_error(err, source, "memory") from None


COMMAND = Command(
    "estimate", "predict a training step's peak memory and time on fake tensors (no GPU, no real memory)",
    add_arguments, run,
    epilog="examples:\n  ckrun estimate recipes/bert_large.yaml --device cuda --gpu h100\n"
    "  ckrun estimate recipes/bert_large.yaml --gpu a100-40gb --json memory.micro_batch=8\n"
    "  ckrun estimate recipes/bert_tiny.yaml --device cpu --json memory.micro_batch=4",
)
