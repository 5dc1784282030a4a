"""The host's AdamW rate: parameters a second that torch's fused CPU AdamW updates (float32 parameters,
gradients and both moments), the rate the time model prices memory.optimizer_offload's host step at
(runner/predict/roofline.py HOST_ADAMW_PER_S_PER_CORE).

    PYTHONPATH=. python bench/host_adamw.py [--params 16e6] [--steps 5]

It times `steps` updates of one flat parameter after a warm-up step, with 1 thread and with every
core torch uses, and prints the rates per second and per core. AdamW on the CPU is memory-bound (each
element reads 4 float32 tensors and writes 3: 28 bytes), so the rate grows with the cores until the
memory bandwidth is spent; the time model assumes a GPU machine's host runs it at the per-core rate
measured here times HOST_CORES (see there).
"""

from __future__ import annotations

import argparse
import time

import torch


def rate(params: int, steps: int, threads: int) -> float:
    """Parameters a second over `steps` fused AdamW updates on `threads` threads."""
    torch.set_num_threads(threads)
    weight = torch.nn.Parameter(torch.randn(params))
    weight.grad = torch.randn(params)
    optimizer = torch.optim.AdamW([weight], lr=1e-3, fused=True)
    optimizer.step()  # creates the moments
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return params * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16e6)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    one = rate(int(args.params), args.steps, 1)
    every = rate(int(args.params), args.steps, cores)
    print(f"torch {torch.__version__}, {int(args.params):,} float32 parameters, fused AdamW on the CPU")
    print(f"  1 thread:   {one / 1e6:8.1f} M parameters/s  ({one * 28 / 1e9:.1f} GB/s of tensor traffic)")
    print(f"  {cores} threads:  {every / 1e6:8.1f} M parameters/s  ({every / cores / 1e6:.1f} M per core)")


if __name__ == "__main__":
    main()
