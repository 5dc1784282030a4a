"""torchao's optimizer update, in an estimate, as it runs on the device estimated for.

torchao.optim's AdamW compiles each parameter's update (`single_param_adam`) with torch.compile. On
a CPU the trainer runs it eagerly (runner/memory/optimizers.py says why), and so does an estimate
for the CPU: the same ops on fake tensors, the same bytes. On CUDA the compiled update is fused
kernels that read the parameter, its gradient and its (quantized) moments and write them back in
place: an estimate for CUDA counts it as making no temporaries, which eager code (one full-size
float32 temporary per operation, many times the largest parameter in the quantizer's search) would
overstate by gigabytes at the optimizer step. The fused kernels' own scratch (a block-wise scale's
reduction: a 256th of the parameter) is left out.

A plan without torchao's optimizers imports nothing here.
"""

from __future__ import annotations

import contextlib
import importlib

import torch


def _fused_in_place(*args, **kwargs) -> None:
    """What the compiled update allocates: nothing beyond what it rewrites (fake tensors have no values)."""


@contextlib.contextmanager
def compiled_updates(fused: bool, needed: bool):
    """torch.compile'd functions run eagerly; with `fused`, torchao's update makes no temporaries.
    `needed`: the plan uses torchao's optimizers (else nothing is imported or changed)."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    if not needed or stance is None:
        yield
        return
    adam = importlib.import_module("torchao.optim.adam")
    original = adam.single_param_adam
    if fused:
        adam.single_param_adam = _fused_in_place
    try:
        with stance("force_eager"):
            yield
    finally:
        adam.single_param_adam = original
