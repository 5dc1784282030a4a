"""Step time and saved-activation bytes of every checkpointing policy, relative to no plan.

    python bench/plans.py [--layers 4] [--hidden 256] [--seq 128] [--batch 16] [--steps 5]

A small BERT masked LM on this machine (CPU unless a GPU is visible). Time is the median of
timed optimizer steps after one warm-up step: on CPU it is this process's CPU time on one
thread, which other processes on a shared machine cannot inflate; on CUDA, wall time between
synchronisations. Bytes are what autograd saves for backward in one forward (parameters
excluded). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from ckrun.runner.builders.sources import build_data
from ckrun.runner.builders.model import build_model
from ckrun.runner.builders.optim import build_optimizer
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.measure import SavedBytes
from ckrun.runner.train.step import call_model, loss_sum, make_precision, run_step

POLICIES = {
    "none": "{policy: none}", "full": "{policy: full}", "every 2": "{policy: every, every: 2}",
    "layers [0,1]": "{policy: layers, layers: [0, 1]}", "sqrt": "{policy: sqrt}", "selective": "{policy: selective}",
}


def measure(args, policy: str) -> tuple[float, int]:
    recipe = load_recipe("recipes/bert_tiny.yaml", [
        f"model.config.num_hidden_layers={args.layers}", f"model.config.hidden_size={args.hidden}",
        f"model.config.intermediate_size={4 * args.hidden}", f"model.config.num_attention_heads={max(1, args.hidden // 64)}",
        f"model.config.max_position_embeddings={args.seq}", "train.device=auto",
        f"data.seq_len={args.seq}", f"train.batch_size={args.batch}", f"memory.checkpointing={policy}",
    ])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(recipe.model, device).train()
    apply_plan(model, recipe.memory, device)
    data, optimizer = build_data(recipe, model), build_optimizer(model, recipe.train, device)
    precision = make_precision(recipe.precision, device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for step in range(args.steps + 1):
        batch = data.global_batch(step).to(device)
        started = clock()
        run_step(model, optimizer, batch, recipe.micro_batch, precision, None, 1.0).loss.item()
        times.append(clock() - started)
    batch = data.global_batch(0).to(device)
    with SavedBytes(model) as saved:
        loss_sum(call_model(model, batch), batch.labels, batch.positions)
    return statistics.median(times[1:]), saved.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 4), ("hidden", 256), ("seq", 128), ("batch", 16), ("steps", 5)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {name: measure(args, policy) for name, policy in POLICIES.items()}
    base_time, base_bytes = results["none"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.machine()}), CPU time on 1 thread"
    print(f"BERT MLM {args.layers} layers x {args.hidden}, seq {args.seq}, batch {args.batch}, fp32; {device}; "
          f"torch {torch.__version__}; {datetime.date.today()}\n")
    print("| policy | step time (s) | time vs none | saved activations (MB) | bytes vs none |")
    print("|---|---|---|---|---|")
    for name, (seconds, saved) in results.items():
        print(f"| {name} | {seconds:.3f} | {seconds / base_time:.2f}x | {saved / 1e6:.1f} | {saved / base_bytes:.2f}x |")


if __name__ == "__main__":
    main()
