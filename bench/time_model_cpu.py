"""The step-time model checked where it can be measured here: predicted against measured CPU time.

Three small models (BERT, GPT-2, ResNet-18) x four plans (no plan, full and selective
checkpointing, four micro-batches), each trained for a few steps in this process on one thread,
the plans interleaved round by round so that they share the machine's moods; a plan's time is the
median over rounds of its median timed step. The prediction prices the same recipes' fake steps on
this CPU's own figures (`ckrun estimate --device cpu`: a matrix product, a copy and a small op,
measured once at start). Reported: Spearman's rank correlation of predicted and measured step
times (all twelve, and per model) and the error of each prediction.

    python bench/time_model_cpu.py                  # about 10 minutes on 2 idle cores
    python bench/time_model_cpu.py --rounds 2 --no-docs

Writes the section `time_model_cpu` of docs/benchmarks.md (unless --no-docs) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.doc_sections import write_section
from bench.stats import spearman
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import this_cpu
from ckrun.runner.train.measure.probe import probe

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "bert": ("recipes/bert_tiny.yaml", ["model.config.num_hidden_layers=4", "model.config.hidden_size=128",
                                        "model.config.intermediate_size=512", "model.config.vocab_size=4096",
                                        "data.seq_len=128", "train.batch_size=16"]),
    "gpt2": ("recipes/gpt2.yaml", ["model.config.n_layer=4", "model.config.n_embd=128", "model.config.n_head=4",
                                   "model.config.vocab_size=4096", "model.config.n_positions=128", "data.seq_len=128",
                                   "train.batch_size=16", "memory.micro_batch=null"]),
    "resnet": ("recipes/resnet50.yaml", ["model.name=resnet18", "model.config.num_classes=10", "data.image_size=64",
                                         "train.batch_size=16", "memory.micro_batch=null"]),
}
COMMON = ["train.device=cpu", "precision=fp32"]
PLANS = {"none": {}, "full": {"checkpointing": {"policy": "full"}},
         "selective": {"checkpointing": {"policy": "selective"}}, "micro-batch 4": {"micro_batch": 4}}


def recipes() -> dict[tuple[str, str], object]:
    out = {}
    for name, (path, overrides) in CASES.items():
        base = load_recipe(ROOT / path, [*overrides, *COMMON])
        for plan_name, plan in PLANS.items():
            memory = MemoryPlan.model_validate({**base.memory.model_dump(mode="json"), **plan})
            out[(name, plan_name)] = base.model_copy(update={"memory": memory})
    return out


def predicted(cases: dict) -> dict:
    facts = this_cpu()
    estimators = {name: Estimator(cases[(name, "none")], "cpu", facts) for name in CASES}
    return {key: estimators[key[0]].estimate(recipe.memory, recipe.precision).time.seconds
            for key, recipe in cases.items()}, facts


def measured(cases: dict, rounds: int, steps: int) -> dict:
    runs = {key: [] for key in cases}
    for _ in range(rounds):
        for key, recipe in cases.items():
            runs[key].append(probe(recipe, warmup_steps=2, timed_steps=steps).step_time_s)
    return {key: statistics.median(values) for key, values in runs.items()}, runs


def markdown(pred: dict, meas: dict, runs: dict, facts, run: dict) -> str:
    keys = list(pred)
    errors = {k: pred[k] / meas[k] - 1 for k in keys}
    per_model = {name: spearman([pred[k] for k in keys if k[0] == name], [meas[k] for k in keys if k[0] == name])
                 for name in CASES}
    lines = ["## The step-time model against this CPU", "",
             f"`python bench/time_model_cpu.py` on {run['started']} ({run['minutes']:.0f} min; load average "
             f"{run['load']:.1f} at the end), {platform.machine()}, {os.cpu_count()} cores, one thread, Python "
             f"{platform.python_version()}, torch {torch.__version__}. Predicted: the fake step priced on this CPU's "
             f"figures measured at start ({facts.matmul_tflops['fp32'] * 1000:.0f} GFLOP/s fp32 products, "
             f"{facts.memory_gbs:.1f} GB/s copies, {facts.launch_us:.1f} us an op). Measured: the median over "
             f"{run['rounds']} interleaved rounds of each plan's median of {run['steps']} timed steps.", "",
             f"Spearman rank correlation, all {len(keys)}: **{spearman([pred[k] for k in keys], [meas[k] for k in keys]):.2f}**"
             f"; per model: " + ", ".join(f"{n} {v:.2f}" for n, v in per_model.items()) +
             f". Error (predicted / measured - 1): median |error| {statistics.median(abs(e) for e in errors.values()):.0%}, "
             f"worst {max(errors.values(), key=abs):+.0%}.", "",
             "| model | plan | predicted | measured | error | runs |", "|---|---|---|---|---|---|"]
    for key in keys:
        lines.append(f"| {key[0]} | {key[1]} | {1000 * pred[key]:.1f} ms | {1000 * meas[key]:.1f} ms | {errors[key]:+.0%} "
                     f"| {', '.join(f'{1000 * v:.1f}' for v in runs[key])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the figures and the runs on the same single thread
    started, clock = time.strftime("%Y-%m-%d %H:%M %Z"), time.monotonic()
    cases = recipes()
    pred, facts = predicted(cases)
    meas, runs = measured(cases, args.rounds, args.steps)
    run = {"started": started, "minutes": (time.monotonic() - clock) / 60, "load": os.getloadavg()[0],
           "rounds": args.rounds, "steps": args.steps}
    text = markdown(pred, meas, runs, facts, run)
    if not args.no_docs:
        write_section(ROOT / "docs/benchmarks.md", "time_model_cpu", text)
    print(text)
    print(json.dumps({"facts": facts.model_dump(), "run": run}))


if __name__ == "__main__":
    main()
