"""Gradients of bf16 weights summed over micro-batches in float32 (memory.weights bf16 with memory.micro_batch).

Autograd accumulates a gradient in its parameter's dtype, so bf16 weights summed over micro-batches in
bf16 would round at every addition (8 bits of mantissa: a micro-batch's small part of a large sum is
lost, silently). Instead each such parameter keeps a float32 sum: a post-accumulate-grad hook adds the
gradient each micro-batch's backward leaves, and frees it; once the last micro-batch's backward is
done (`gradients_complete`, run_step's call before clipping and the update) each sum is rounded to
bf16 once and becomes the gradient that clipping and torchao's stochastically rounded AdamW read: the
one rounding a gradient of the whole batch in one pass gets. Bytes: the float32 sums (4 B a
parameter, counted as `gradients`) from the first micro-batch's backward to the end of the last, in
place of bf16 gradients (2 B) that would have lived as long; then the bf16 gradients until the update.
"""

from __future__ import annotations

import torch
from torch import nn

from .tracker import attributed


class Float32Accumulation:
    """Steps `optimizer` on gradients summed in float32 over the micro-batches of a step (module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        self.optimizer = optimizer
        self.params = [p for p in params if p.dtype == torch.bfloat16]
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._handles = []

    def install(self) -> None:
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._add) for p in self.params]

    def _add(self, param: nn.Parameter) -> None:
        with attributed("gradients"):
            total = self._sums.get(param)
            if total is None:
                self._sums[param] = param.grad.float()
            else:
                total.add_(param.grad)
        param.grad = None

    def held_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each parameter's float32 sum so far: what holds its gradient until `gradients_complete` (the
        estimate's parts follow it as the parameter's gradient: runner/predict/parts.py)."""
        return dict(self._sums)

    def gradients_complete(self) -> None:
        """Every micro-batch's backward is done: each float32 sum becomes its parameter's bf16 gradient,
        one parameter at a time (its sum freed before the next is rounded)."""
        with attributed("gradients"):
            while self._sums:
                param, total = self._sums.popitem()
                param.grad = total.to(param.dtype)
                del total

    def step(self, closure=None) -> None:
        self.gradients_complete()  # a caller that did not hand them over first (idempotent)
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._sums.clear()  # a step that ran out of memory halfway leaves no part-sums for the next
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hold(self) -> None:
        """The parameters stay as they are (PlannedOptimizer holds each part; host_master.py's casts)."""

    def release(self) -> None:
        """Nothing was held."""
