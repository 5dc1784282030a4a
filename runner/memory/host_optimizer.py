"""Optimizer offload to host memory (memory.optimizer_offload: cpu), whole or for a fraction.

The design is torchao's CPUOffloadOptimizer: each offloaded parameter has a float32 copy and a
gradient buffer in pinned host memory; the plan's optimizer (torch's fused CPU AdamW, or torchao's
low-bit AdamW over the host's tensors) keeps their state there and updates them on the CPU; each step copies their gradients to the host and the
updated parameters back. The rest of the parameters keep an ordinary optimizer on the device.

Why ckrun has its own rather than torchao's: torchao's asserts a CUDA (or XPU) device when it is
built and pins host memory, so neither the memory estimate (fake tensors on the CPU) nor any test on
a CPU machine can run it, and the estimate must run the code the training runs; it has no fraction
(only a size under which tensors stay); and its gradients are copied after every micro-batch. Here
the host is a parameter (the CPU in training, the meta device in the estimate, so what lands there
is counted apart from the device), a `fraction` of the parameters' bytes is offloaded (Megatron's
fractional offload), and where each gradient is final once accumulated (one micro-batch, no
clipping, no loss scaling) it is copied on a side stream as soon as the backward accumulates it,
overlapping the rest of the backward, and freed on the device; otherwise the gradients accumulate
on the device as usual and are copied in `step()`.

Exact: the update is the same arithmetic on the same values (on CUDA the CPU's fused AdamW kernel
rounds as the CPU does, which can differ from the GPU's kernel in the last bit).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn

MakeOptimizer = Callable[[list[torch.Tensor], torch.device], torch.optim.Optimizer]
LOW_BIT_HOST_COST = {"AdamW8bit": 136.0, "AdamW4bit": 95.0, "AdamWFp8": 18.5}
"""torchao's low-bit AdamW on the host's tensors (memory.optimizer_state 8bit/4bit/fp8 beside an offload), in
elements of torch's fused CPU AdamW: its update runs eagerly there, one small op at a time, at 2.3, 3.3 and
16.9 M parameters a second of one thread's CPU time (bench/host_low_bit.py, 2026-11-29, torch 2.14.1, torchao
0.18, on this 2-core machine at a load of 10: to re-measure on an idle one), against the 313 M a second the
time model takes for the fused step (runner/predict/roofline.py HOST_ADAMW_PER_CORE). It saves host memory
only, at that cost."""


class HostOffloadOptimizer(torch.optim.Optimizer):
    """A torch Optimizer (so schedules accept it) over two inner ones, the host's and the device's.
    Optimizer.__init__ is not called, as in torchao's: `param_groups` and `state` are the inner ones'."""

    def __init__(self, params: list[nn.Parameter], make: MakeOptimizer, device: torch.device, fraction: float,
                 host: torch.device, gradients_final: bool, side_stream: bool = True):
        """`side_stream` false: copies run on the current stream (the estimate, whose CUDA is emulated)."""
        self.device, self.host = torch.device(device), torch.device(host)
        self.defaults = {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        moved = offloaded_share(params, fraction)
        pinned = self.host.type == "cpu" and self.device.type == "cuda"
        self.copies: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host copy
        self.buffers: dict[nn.Parameter, torch.Tensor] = {}  # device parameter -> its host gradient buffer
        with torch.no_grad():
            for param in moved:
                self.copies[param] = torch.empty_like(param, device=self.host, pin_memory=pinned).copy_(param)
                self.buffers[param] = torch.empty_like(param, device=self.host, pin_memory=pinned)
        self.host_optimizer = make(list(self.copies.values()), self.host)
        kept = [p for p in params if p not in self.copies]
        self.device_optimizer = make(kept, self.device) if kept else None
        self.stream = torch.cuda.Stream(self.device) if side_stream and self.device.type == "cuda" else None
        self.copied: dict[nn.Parameter, torch.cuda.Event | None] = {}  # gradients on the host this step
        self.gradients_final, self._handles = gradients_final, []

    def install(self) -> None:
        """With final gradients, copy each to the host as soon as the backward accumulates it."""
        if self.gradients_final and not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._copy_gradient) for p in self.copies]

    # --- the gradients' way to the host ----------------------------------------------------------

    def _copy_gradient(self, param: nn.Parameter) -> None:
        """Copy `param`'s gradient into its host buffer and free it on the device."""
        grad, buffer = param.grad, self.buffers[param]
        if self.stream is None:
            buffer.copy_(grad)
            self.copied[param] = None
        else:  # after the backward's work on it, on the side stream; the device memory goes once the copy is done
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                buffer.copy_(grad, non_blocking=True)
                grad.record_stream(self.stream)
                self.copied[param] = self.stream.record_event()
        param.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        for param, copy in self.copies.items():
            if param not in self.copied and param.grad is not None:  # not copied in the backward
                self._copy_gradient(param)
            copy.grad = self.buffers[param] if param in self.copied else None  # no gradient: no update, as on the device
        for event in self.copied.values():
            if event is not None:
                event.synchronize()
        self.host_optimizer.step()
        self._copy_back()
        self.copied.clear()

    def _copy_back(self) -> None:
        """The updated parameters back to the device, before the next forward reads them."""
        if self.stream is None:
            for param in self.copied:
                param.copy_(self.copies[param])
            return
        with torch.cuda.stream(self.stream):
            for param in self.copied:
                param.copy_(self.copies[param], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=set_to_none)
        for param in self.copies:
            param.grad = None
        for copy in self.copies.values():
            copy.grad = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hold(self) -> None:
        """The device's parameters stay as they are (runner/memory/host_master.py holds bfloat16 copies)."""

    def release(self) -> None:
        """Nothing was held."""

    # --- what schedules, checkpoints and the tracker read ----------------------------------------

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [self.host_optimizer] + ([self.device_optimizer] if self.device_optimizer is not None else [])

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self._inner() for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {key: value for optimizer in self._inner() for key, value in optimizer.state.items()}

    def register_step_post_hook(self, hook):
        handles = [optimizer.register_step_post_hook(hook) for optimizer in self._inner()]
        return _Handles(handles)

    def register_step_pre_hook(self, hook):
        """On the inner optimizers, whose steps run the hooks (this one's step is not torch's wrapped one)."""
        return _Handles([optimizer.register_step_pre_hook(hook) for optimizer in self._inner()])

    def stepped(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """What the inner optimizers step for each of `params`: its host copy, or itself on the device (a
        follower of the update, runner/train/measure/update_error.py, reads those and their gradients)."""
        return [self.copies.get(param, param) for param in params]

    def state_dict(self) -> dict:
        return {"host": self.host_optimizer.state_dict(),
                "device": self.device_optimizer.state_dict() if self.device_optimizer is not None else None}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inner optimizers' states, and the host copies from the device parameters (loaded just before)."""
        if set(state_dict) != {"host", "device"} or (state_dict["device"] is None) != (self.device_optimizer is None):
            raise ValueError("the checkpoint's optimizer state is not of this memory.optimizer_offload")
        self.host_optimizer.load_state_dict(state_dict["host"])
        if self.device_optimizer is not None:
            self.device_optimizer.load_state_dict(state_dict["device"])
        with torch.no_grad():
            for param, copy in self.copies.items():
                copy.copy_(param)

    def host_work(self, micro_batches: int) -> int:
        """The host's work in one step, in elements of its fused AdamW rate (what the estimate prices): the
        update of the elements it holds, a low-bit one at its cost (`LOW_BIT_HOST_COST`)."""
        cost = LOW_BIT_HOST_COST.get(type(self.host_optimizer).__name__, 1.0)
        return int(cost * sum(t.numel() for t in self.copies.values()))

    def host_tensors(self) -> list[torch.Tensor]:
        """What it keeps in host memory beside the host optimizer's state: the parameters' copies and gradient
        buffers (a memory tracker counts them before the step: they exist before it, as the state does)."""
        return [*self.copies.values(), *self.buffers.values()]

    def host_bytes(self) -> int:
        """What it holds in host memory: `host_tensors` and the host's state."""
        tensors = [*self.host_tensors(),
                   *(v for state in self.host_optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return f"HostOffloadOptimizer({len(self.copies)} parameters on {self.host}, host {self.host_optimizer!r})"


class _Handles:
    def __init__(self, handles: list):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def offloaded_share(params: list[nn.Parameter], fraction: float) -> list[nn.Parameter]:
    """The parameters, in the model's order, whose bytes make up `fraction` of all (a tensor that
    crosses the line goes too, so any fraction above 0 moves at least one)."""
    total = sum(p.numel() * p.element_size() for p in params)
    chosen, taken = [], 0
    for param in params:
        if taken >= fraction * total:
            break
        chosen.append(param)
        taken += param.numel() * param.element_size()
    return chosen
