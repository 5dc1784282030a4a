"""memory.optimizer_offload master: ZeRO-Offload's split of a step between the device and the host.

DeepSpeed's ZeRO-Offload keeps the float32 master weights, Adam's moments and the update on the host
and only 16-bit weights on the GPU, the gradients streamed to the host as the backward makes them.
torchao's CPUOffloadOptimizer streams them the same way (a post-accumulate-grad hook per parameter
copying into a pinned host buffer on a side stream, the device's gradient freed once the copy is
done), but its host copy has the device parameter's dtype: it has no master split, and it asserts a
CUDA device, so neither the estimate (fake tensors) nor a CPU test could run it. This is ckrun's
host offload (runner/memory/host_optimizer.py) with the split:

- host, pinned: each trainable parameter's float32 master (what the optimizer steps: torch's fused
  CPU AdamW, or torchao's low-bit AdamW on these tensors), its float32 gradient, where the
  micro-batches add up, a staging buffer in the device copy's dtype (what the link carries both
  ways: the gradient down, the recast weight up), and the optimizer's state;
- device: bfloat16 copies of the parameters bf16 autocast casts wherever the model reads them (the
  weights and biases of nn.Linear layers, `autocast_cast`), float32 ones of the rest.

Exact, bit for bit against float32 weights under bf16 autocast (tests/runner/memory/test_host_master.py):
autocast rounds a Linear's float32 weight to bfloat16 for the product, the same rounding as the
recast here; the gradient it sends to the float32 weight is the bfloat16 gradient widened, which is
what the host adds up in float32. That holds where each weight's gradient comes from one read per
forward (or from reads of one cached cast): a layer run twice, whose recomputed reads autocast casts
apart, would have its gradients added in bfloat16, and a layer run outside autocast would meet a
bfloat16 weight; `ReadsGuard` refuses both at the first forward, in one line. The chunked loss reads
its head's weight once per piece, so that weight stays float32 (`keep`).

The checkpoint and the export take the masters, not the bfloat16 copies: a state-dict hook on the
model puts each master under its parameter's names, and a load pre-hook copies a loaded state into
the masters (the device copies are then cast from it, as each step recasts them).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch import nn

from ..builders.resolve import BuildError
from .host_optimizer import HostOffloadOptimizer, MakeOptimizer

log = logging.getLogger(__name__)

CARD_DTYPE = torch.bfloat16
KEY = "memory.optimizer_offload"
FOLD_SHARE = 10 / 28
"""The host's work adding one micro-batch's gradient into its float32 sum, against its AdamW step on the
same element: 10 bytes moved (the 2-byte gradient and the 4-byte sum read, the sum written) to AdamW's 28
(runner/predict/roofline.py HOST_ADAMW_PER_CORE): both are memory-bound on the host."""


def autocast_cast(model: nn.Module, params: list[nn.Parameter], keep: set[nn.Parameter] = frozenset()) -> set:
    """The floating `params` that only nn.Linear layers hold (bf16 autocast casts every operand of a
    linear), less `keep`: a weight tied to an embedding is read by it as it is."""
    owners = defaultdict(list)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[param].append(module)
    return {p for p in params if p.is_floating_point() and p not in keep and owners[p]
            and all(isinstance(module, nn.Linear) for module in owners[p])}


class HostMasterOptimizer(HostOffloadOptimizer):
    """The host offload of every trainable parameter, with the float32 masters on the host (module docstring)."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], make: MakeOptimizer, device: torch.device,
                 host: torch.device, keep: set[nn.Parameter] = frozenset(), card: torch.device | None = None,
                 side_stream: bool = True):
        """`card`: where the device copies go (training: the device; None: where each parameter is, as the
        estimate's fake parameters stand for the device's)."""
        super().__init__(params, make, device, 1.0, host, gradients_final=True, side_stream=side_stream)
        self.model, self.card = model, card
        cast = autocast_cast(model, params, keep)
        self.cast = [p for p in self.copies if p in cast]  # held in bfloat16 on the device
        self.card_dtype = {p: CARD_DTYPE if p in cast else p.dtype for p in self.copies}
        pinned = self.host.type == "cpu" and self.device.type == "cuda"
        self.staging = {p: torch.empty(p.shape, dtype=self.card_dtype[p], device=self.host, pin_memory=pinned)
                        for p in self.copies}
        self.in_flight: dict[nn.Parameter, torch.cuda.Event | None] = {}  # copied, not yet added up
        self.summed: set[nn.Parameter] = set()  # whose host gradient holds this step's sum so far
        self.guard = ReadsGuard(model, cast)
        self._model_hooks: list = []
        self._told = False

    # --- the device's copies -----------------------------------------------------------------------

    def hold(self) -> None:
        """The device copies, cast from the masters (the device's float32 parameters are freed), the
        buffers on the device too, and the model's hooks: the reads guarded, the state dicts of masters."""
        if self._model_hooks:
            return
        with torch.no_grad():
            for param in self.copies:
                param.data = self._from_master(param, self.card_dtype[param])
            if self.card is not None:
                _buffers_to(self.model, self.card)
        names = _names(self.model, self.copies)
        self._model_hooks = [self.model.register_state_dict_post_hook(lambda *args: self._masters_into(names, *args)),
                             self.model.register_load_state_dict_pre_hook(
                                 lambda *args: self._masters_from(names, *args)), *self.guard.install()]
        if not self._told:  # once: the estimate holds and releases them for every plan it tries
            self._told = True
            log.info("memory.optimizer_offload master: %d of %d parameters held in bfloat16 on the device (%s), the "
                     "rest (embeddings, norms, tied or split heads) in float32", len(self.cast), len(self.copies),
                     _bytes(sum(p.numel() for p in self.cast) * 2))

    def release(self) -> None:
        """The device's parameters back to float32 from the masters (the estimate tries another plan next)."""
        for handle in self._model_hooks:
            handle.remove()
        self._model_hooks = []
        with torch.no_grad():
            for param, master in self.copies.items():
                param.data = self._from_master(param, master.dtype)

    def _from_master(self, param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """A new device tensor of `param`'s master in `dtype`, cast on the host (what crosses the link is 2 B)."""
        source = self.copies[param]
        if dtype != source.dtype:
            source = self.staging[param].copy_(source)
        return torch.empty(param.shape, dtype=dtype, device=self.card or param.device).copy_(source)

    # --- the gradients' way to the host ------------------------------------------------------------

    def _copy_gradient(self, param: nn.Parameter) -> None:
        """This micro-batch's gradient of `param` into its staging buffer, freed on the device; the previous
        micro-batch's is added up first, since the buffer is about to be reused."""
        self._add_up(param)
        self.guard.answered(param)
        grad, staging = param.grad, self.staging[param]
        if self.stream is None:
            staging.copy_(grad)
            self.in_flight[param] = None
        else:  # after the backward's work on it, on the side stream; the device memory goes once the copy is done
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                staging.copy_(grad, non_blocking=True)
                grad.record_stream(self.stream)
                self.in_flight[param] = self.stream.record_event()
        param.grad = None

    def _add_up(self, param: nn.Parameter) -> None:
        """The landed copy of `param`'s gradient into its float32 sum (the first of a step replaces it)."""
        if param not in self.in_flight:
            return
        event = self.in_flight.pop(param)
        if event is not None:
            event.synchronize()
        total, staging = self.buffers[param], self.staging[param]
        if param in self.summed:
            total.add_(staging)  # float32 + the widened gradient: as autograd adds a micro-batch's to a float32 .grad
        else:
            total.copy_(staging)
            self.summed.add(param)

    def _gather(self) -> None:
        """Every gradient of the step summed on the host; each master's .grad its sum, or None where none came."""
        for param in self.copies:
            if param.grad is not None:  # accumulated without the hook (none is expected): sent now
                self._copy_gradient(param)
        for param in list(self.in_flight):
            self._add_up(param)
        for param, master in self.copies.items():
            master.grad = self.buffers[param] if param in self.summed else None

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global clipping on the host's float32 sums (torch's, over the same gradients in the same order as
        the device's float32 parameters would be); returns the norm before clipping."""
        self._gather()  # foreach where the host's tensors take it (the CPU's, as the device's float32 do; not meta)
        return torch.nn.utils.clip_grad_norm_(list(self.copies.values()), max_norm, foreach=None)

    @torch.no_grad()
    def step(self, closure=None):
        self._gather()
        self.host_optimizer.step()
        self._recast()
        self.summed.clear()

    def _recast(self) -> None:
        """The updated masters back to the device in its dtype, before the next forward reads them."""
        stepped = [p for p in self.copies if p in self.summed]
        for param in stepped:
            source = self.copies[param]
            if self.card_dtype[param] != source.dtype:
                source = self.staging[param].copy_(source)  # rounded to nearest, as autocast casts
            if self.stream is None:
                param.copy_(source)
            else:
                with torch.cuda.stream(self.stream):
                    param.copy_(source, non_blocking=True)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the step's sums too (a step that ran out of memory half way leaves some behind)."""
        for event in self.in_flight.values():
            if event is not None:
                event.synchronize()
        self.in_flight.clear()
        self.summed.clear()
        self.guard.clear()
        super().zero_grad(set_to_none)

    # --- checkpoints -------------------------------------------------------------------------------

    def _masters_into(self, names: dict[str, nn.Parameter], _module, state_dict: dict, prefix: str, _meta) -> None:
        for name, param in names.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.copies[param]

    def _masters_from(self, names: dict[str, nn.Parameter], _module, state_dict: dict, prefix: str, *_rest) -> None:
        with torch.no_grad():
            for name, param in names.items():
                if prefix + name in state_dict:
                    self.copies[param].copy_(state_dict[prefix + name])

    def load_state_dict(self, state_dict: dict) -> None:
        """The host optimizer's state; the masters came with the model's state (its load pre-hook)."""
        if set(state_dict) != {"host", "device"} or state_dict["device"] is not None:
            raise ValueError("the checkpoint's optimizer state is not of this memory.optimizer_offload")
        self.host_optimizer.load_state_dict(state_dict["host"])

    def host_work(self, micro_batches: int) -> int:
        """The update, and adding up each micro-batch's gradients on the host (`FOLD_SHARE`)."""
        elements = sum(t.numel() for t in self.copies.values())
        return super().host_work(micro_batches) + int(elements * FOLD_SHARE * micro_batches)

    def host_tensors(self) -> list[torch.Tensor]:
        return [*super().host_tensors(), *self.staging.values()]

    def __repr__(self) -> str:
        return f"HostMasterOptimizer({len(self.copies)} float32 masters on {self.host}, host {self.host_optimizer!r})"


class ReadsGuard:
    """Hooks on the layers whose weights the device holds in bfloat16: each read that sends a gradient back
    must be the only one of its backward (a recompute's aside), and every read runs under autocast, or the
    split is not exact (module docstring); otherwise one line names the layer, before any update. A read
    whose output gets no gradient (a forward that learns, an unused output) counts for nothing."""

    def __init__(self, model: nn.Module, cast: set[nn.Parameter]):
        self.layers = {name: module for name, module in model.named_modules()
                       if any(p in cast for p in module.parameters(recurse=False))}
        self.layers_of = defaultdict(list)  # a parameter -> the layers that read it
        for name, module in self.layers.items():
            for param in module.parameters(recurse=False):
                self.layers_of[param].append(name)
        self.sent: set[str] = set()  # layers whose read sent its gradient back in the running backward
        self._queued = False  # the end of the running backward clears `sent`

    def install(self) -> list:
        return [handle for name, module in self.layers.items() for handle in (
            module.register_forward_pre_hook(lambda _m, _a, name=name: self._read(name)),
            module.register_forward_hook(lambda _m, _a, out, name=name: self._follow(name, out)))]

    def _read(self, name: str) -> None:
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:  # no gradient, or a recompute
            return
        device = next(self.layers[name].parameters()).device.type
        if not torch.is_autocast_enabled(device):
            raise BuildError(KEY, f"master holds {name}'s weight in bfloat16 for bf16 autocast to read, but the model "
                                  "runs that layer outside autocast; use policy cpu")

    def _follow(self, name: str, output) -> None:
        if isinstance(output, torch.Tensor) and output.requires_grad and torch._C._current_graph_task_id() == -1:
            output.register_hook(lambda _grad: self._sends(name))

    def _sends(self, name: str) -> None:
        """A read of `name` sends its output's gradient back: the second of one backward is refused."""
        if name in self.sent:
            raise BuildError(KEY, f"master holds {name}'s weight in bfloat16, and the model runs that layer twice in "
                                  "one forward: its gradients would add up in bfloat16, not float32; use policy cpu")
        self.sent.add(name)
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.clear)
            self._queued = True

    def answered(self, param: nn.Parameter) -> None:
        """`param`'s gradient is summed: its layers' reads of this backward are over."""
        self.sent.difference_update(self.layers_of.get(param, ()))

    def clear(self) -> None:
        self.sent.clear()
        self._queued = False


def _names(model: nn.Module, copies: dict) -> dict[str, nn.Parameter]:
    """Every name of each offloaded parameter (a tied one has several)."""
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if p in copies}


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """The buffers on the device (a model built on the host for this plan: its parameters came one by one)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _bytes(nbytes: int) -> str:
    from ..units import format_bytes

    return format_bytes(nbytes)
