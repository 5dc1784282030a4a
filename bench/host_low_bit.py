"""The host's low-bit AdamW against its fused float32 AdamW: how many times longer torchao's AdamW8bit,
AdamW4bit and AdamWFp8 take on the same elements when they update host tensors (memory.optimizer_offload
with memory.optimizer_state 8bit/4bit/fp8), the factors runner/memory/host_optimizer.py LOW_BIT_HOST_COST
prices them at. torchao's update runs eagerly there (runner/memory/optimizers.py: compiling it is a C++
build per parameter shape), one small op at a time, so it is far slower than the fused kernel.

    PYTHONPATH=. python bench/host_low_bit.py [--params 4e6] [--steps 3]

One thread, CPU seconds (process time) of `steps` updates of one parameter after a warm-up step.
"""

from __future__ import annotations

import argparse
import time

import torch


def seconds(make, params: int, steps: int) -> float:
    from ckrun.runner.memory.optimizers import eager_updates

    weight = torch.nn.Parameter(torch.randn(1024, params // 1024))
    weight.grad = torch.randn_like(weight)
    optimizer = make([weight])
    if not isinstance(optimizer, torch.optim.AdamW):
        eager_updates(optimizer)
    optimizer.step()  # creates the state
    started = time.process_time()
    for _ in range(steps):
        optimizer.step()
    return (time.process_time() - started) / steps


def main() -> None:
    import torchao
    import torchao.optim

    from ckrun.runner.memory.optimizers import prime_quantization_maps

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=4e6)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    prime_quantization_maps()
    params = int(args.params)
    fused = seconds(lambda ps: torch.optim.AdamW(ps, fused=True), params, args.steps)
    print(f"torch {torch.__version__}, torchao {torchao.__version__}, {params:,} float32 parameters, 1 thread")
    print(f"  fused AdamW: {params / fused / 1e6:8.1f} M parameters/s")
    for name in ("AdamW8bit", "AdamW4bit", "AdamWFp8"):
        low = seconds(lambda ps, name=name: getattr(torchao.optim, name)(ps), params, args.steps)
        print(f"  {name:10s} {params / low / 1e6:8.1f} M parameters/s: {low / fused:6.1f} x the fused step")


if __name__ == "__main__":
    main()
