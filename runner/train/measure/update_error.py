"""How far a lossy optimizer (memory.optimizer_state 8bit/4bit/fp8, memory.weights bf16) moves the
weights from where exact AdamW would take them: measured over a run's first steps, never assumed.

The run trains as planned. Beside it, on the host, exact AdamW (torch's, float32, the recipe's
settings and the schedule's learning rate of the moment) follows a sample of every parameter (its
first `SAMPLE` elements, whole quantization blocks of torchao's) from the same starting values,
fed the same gradients each step: the gradients the lossy run computed, so what is measured is the
optimizer's own error, not the drift of later gradients. After `STEPS` steps the error is the
relative L2 distance of the two weight changes over all samples together,
||Δw_lossy - Δw_exact|| / ||Δw_exact|| (on FSDP2's ranks each samples its own shards, and the two sums
are taken over every rank's). For bf16 weights it includes the stochastic rounding's
noise, which is unbiased and averages out over many steps: a single step's error is large by design.

The exact copy's work runs outside any memory tracker (its bytes are the host's, not the step's)
and costs a few hundred kilobytes a parameter on the host, for the first steps only.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

STEPS = 3  # the steps measured: the probe's warm-up and timed steps cover them
SAMPLE = 1 << 14  # elements followed per parameter: a multiple of torchao's blocks (256, 128)
try:  # private, so detected: without it a CPU run's tracker counts the exact copy's temporaries too
    from torch.utils._python_dispatch import _disable_current_modes as _UNTRACKED
except ImportError:
    _UNTRACKED = contextlib.nullcontext


class UpdateErrorMeter:
    """Exact AdamW on a sample of every parameter, beside a lossy optimizer's first steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], steps: int = STEPS):
        self.optimizer, self.steps, self.done = optimizer, steps, 0
        self.error: float | None = None
        with _UNTRACKED(), torch.no_grad():
            self.samples = [(p, min(_local(p).numel(), SAMPLE)) for p in params]
            self.start = [_host_sample(p, n) for p, n in self.samples]
            self.exact = [nn.Parameter(start.clone()) for start in self.start]
            self.exact_optimizer = torch.optim.AdamW([{"params": [e]} for e in self.exact], foreach=False)
        self._group_of = {p: index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self._handle = optimizer.register_step_pre_hook(self._follow)

    def _follow(self, _optimizer, _args, _kwargs) -> None:
        """Before the lossy step: the exact one on the gradients it is about to use (the parameters that
        have one: all of them, or the one an in-backward update steps)."""
        with _UNTRACKED(), torch.no_grad():
            for (param, count), exact, group in zip(self.samples, self.exact, self.exact_optimizer.param_groups,
                                                    strict=True):
                exact.grad = None if param.grad is None else _host_sample(param.grad, count)
                lossy = self.optimizer.param_groups[self._group_of[param]]
                group.update(lr=float(lossy["lr"]), betas=tuple(lossy["betas"]), eps=lossy["eps"],
                             weight_decay=lossy["weight_decay"])
            self.exact_optimizer.step()

    def stepped(self) -> float | None:
        """Count a finished training step; after the last measured one, the error (else None)."""
        self.done += 1
        if self.done == self.steps:
            self.error = self._measure()
            self.close()
            return self.error
        return None

    def _measure(self) -> float:
        with _UNTRACKED(), torch.no_grad():
            difference = norm = 0.0
            for (param, count), start, exact in zip(self.samples, self.start, self.exact, strict=True):
                lossy_change, exact_change = _host_sample(param, count) - start, exact - start
                difference += float((lossy_change.double() - exact_change.double()).square().sum())
                norm += float(exact_change.double().square().sum())
            difference, norm = self._over_shards(difference, norm)
        return (difference / norm) ** 0.5 if norm > 0 else float(difference > 0)

    def _over_shards(self, difference: float, norm: float) -> tuple[float, float]:
        """FSDP2's ranks each sample their own shards: the sums over every rank's (collective; DDP's replicas
        sample the same elements, each its own error already)."""
        shard = next((p for p, _ in self.samples if hasattr(p, "device_mesh")), None)
        if shard is None:
            return difference, norm
        sums = torch.tensor([difference, norm], dtype=torch.float64, device=_local(shard).device)
        torch.distributed.all_reduce(sums)
        return tuple(sums.tolist())

    def close(self) -> None:
        """Stop following (the hook goes, the host copies with it)."""
        self._handle.remove()
        self.samples, self.start, self.exact, self.exact_optimizer = [], [], [], None


def _host_sample(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` elements of this rank's piece of `tensor` (an FSDP2 shard is a DTensor) as a
    float32 host copy."""
    return torch.empty(count, dtype=torch.float32).copy_(_local(tensor.detach()).reshape(-1)[:count])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def lossy_labels(recipe) -> list[str]:
    """A recipe's lossy knobs of the weights and the optimizer, as `memory.KEY LABEL` (none: nothing to measure)."""
    return [f"memory.{policy.section} {policy.label()}" for policy in recipe.memory.pool_policies() if policy.lossy]


def report_update_error(error: float, labels: list[str], steps: int = STEPS) -> str:
    return (f"{', '.join(labels)} lossy: relative error {error:.2e} of the weights' change over the first {steps} "
            "steps against exact AdamW on the same gradients (L2 over a sample of every parameter)")
