"""One optimizer step over micro-batches: the code that training, probing and estimating share.

The loss is summed over every label of the global batch and divided by their total count, so
splitting the batch into micro-batches gives the whole batch's gradient for a model that treats
samples independently. It does not for a model that looks across the batch: BatchNorm normalises
over each micro-batch (other statistics, other running averages), and dropout draws its masks per
micro-batch (losses then differ, though they are the same in distribution).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..builders.contract import check_logits, logits_from, user_forward
from ..builders.data import IGNORE, Batch
from ..builders.resolve import BuildError
from ..memory.chunked_loss import SplitHead
from ..memory.tracker import attributed
from ..parallel.grad_norm import clip_gradients
from ..problems import InputError, Place, Problem

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str
    device_type: str
    cast_cache: bool = True
    """Autocast keeps its cast copies of the weights for the whole forward (memory.weights' cast_cache)."""

    def autocast(self):
        dtype = _DTYPES[self.name]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype, cache_enabled=self.cast_cache)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
        return torch.amp.GradScaler(self.device_type) if self.name == "fp16" else None


def make_precision(name: str, device: torch.device, source: str = "<recipe>", cast_cache: bool = True) -> Precision:
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        gpu = torch.cuda.get_device_name(device)
        raise InputError([Problem(Place(source), "precision", f"bf16 needs an Ampere or newer GPU; {gpu} has none - use fp16")])
    return Precision(name, device.type, cast_cache)


def set_fp32_math(tf32: bool | None) -> str:
    """The recipe's `tf32` applied to torch's fp32 math (None: torch's defaults left alone); the log line.

    Through the settings every torch since 1.12 reads (`set_float32_matmul_precision`,
    `torch.backends.cudnn.allow_tf32`): torch 2.9's per-backend `fp32_precision` API makes the older
    readers raise once it is used, and user code or libraries may still read them."""
    if tf32 is None:
        return ("tf32: unset, torch's defaults: fp32 matrix products in full fp32, cuDNN convolutions in TF32 "
                f"(matmul precision {torch.get_float32_matmul_precision()!r}, cudnn.allow_tf32 "
                f"{torch.backends.cudnn.allow_tf32})")
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    return ("tf32: fp32 matrix products and convolutions on TF32 tensor cores (Ampere and newer)" if tf32 else
            "tf32: false, fp32 matrix products and convolutions in full fp32")


@contextlib.contextmanager
def predict_only_at(model: nn.Module, positions: torch.Tensor | None):
    """Masked LM: feed the output projection only the masked positions ("sparse prediction").

    Only ~15% of the tokens carry a label, yet a transformers MLM head projects every position
    onto the whole vocabulary: on BERT-large at seq 512 those logits and their gradient are
    about 1 GB per micro-batch of 16. A forward pre-hook on `get_output_embeddings()` gathers
    the labelled rows first, so the logits come out [batch, k, vocab]. A compiled model keeps
    full logits (a hook added per call would recompile it); `loss_sum` gathers them then. Under DDP
    the hook goes on the wrapped model's head: DDP's forward runs it, and without the hook every
    rank would hold the full logits."""
    head = None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if positions is not None and not hasattr(model, "_orig_mod") and hasattr(model, "get_output_embeddings"):
        head = model.get_output_embeddings()
    if head is None:
        yield
        return

    def gather(_module, args):
        hidden = args[0]
        return (hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])), *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def call_model(model: nn.Module, batch: Batch, check: bool = True) -> torch.Tensor:
    """The model's logits for `batch`, checked against its labels (builders/contract.py says why);
    `check` false: what the model returned is not logits (a split head's hidden states)."""
    with user_forward(model, batch.inputs):
        output = model(**batch.inputs) if batch.by_keyword else model(*batch.inputs.values())
    logits, labels = logits_from(output, model), batch.labels
    if batch.positions is not None and logits.dim() == 3 and logits.shape[1] == batch.positions.shape[1]:
        labels = labels.gather(1, batch.positions)  # the sparse masked-LM head: logits at the masked positions
    if check:
        check_logits(logits, labels, model)
    return logits


def micro_batch_loss(model: nn.Module, micro: Batch, precision: Precision, head: SplitHead | None = None) -> torch.Tensor:
    """The summed loss of one micro-batch: the model's logits and their cross-entropy, or with a split
    head (memory.loss chunked) its last hidden states and the loss over pieces of the sequence. What
    the head and the loss make in the forward counts as the `loss` pool in a memory tracker."""
    if head is not None:
        with precision.autocast(), predict_only_at(model, micro.positions), head.passing_through():
            hidden = call_model(model, micro, check=False)
            with attributed("loss"):
                return head.loss_sum(hidden, micro.labels, micro.positions, precision.autocast)
    with precision.autocast(), predict_only_at(model, micro.positions), _head_attributed(model):
        logits = call_model(model, micro)
    with attributed("loss"):
        return loss_sum(logits, micro.labels, micro.positions)  # the logits go with this frame, before backward


@contextlib.contextmanager
def _head_attributed(model: nn.Module):
    """The output projection's forward (the logits) inside `attributed("loss")`."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) and not hasattr(model, "_orig_mod") else None
    if not isinstance(head, nn.Module):
        yield
        return
    scope = contextlib.ExitStack()
    handles = [head.register_forward_pre_hook(lambda *_: scope.enter_context(attributed("loss"))),
               head.register_forward_hook(lambda *_: scope.close())]
    try:
        yield
    finally:
        scope.close()
        for handle in handles:
            handle.remove()


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Summed cross-entropy over the labelled positions (token tasks) or samples (classification).

    With `positions` (masked LM) only those rows of the logits enter the loss: the fp32 copy,
    its log-softmax and their gradients then cover ~15% of the tokens instead of all of them,
    which on BERT-large at seq 512 is most of the activation memory outside the blocks."""
    if positions is not None:
        if logits.shape[1] != positions.shape[1]:  # full logits: the head was not sparse
            logits = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        labels = labels.gather(1, positions)
    logits = logits.float()  # the softmax of a large vocabulary is unstable in half precision
    try:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                               reduction="sum")
    except IndexError as err:  # "Target 7 is out of bounds" (CPU): a label past the model's classes, on a later batch
        raise BuildError("model.name", f"the model returns {logits.shape[-1]} classes but a batch holds a label "
                                       f"past them ({err}); give the model as many outputs as the data has classes") from None


def label_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE).sum().clamp(min=1)


@dataclass
class StepResult:
    loss: torch.Tensor  # a 0-dim tensor on the device: read it only when logging, it syncs
    skipped: bool  # fp16: the scaler found inf/nan gradients and skipped the update
    grad_norm: torch.Tensor | None = None  # the gradients' total 2-norm before clipping (train.grad_clip set)


def run_step(model, optimizer, batch: Batch, micro_batch: int, precision: Precision,
             scaler: torch.amp.GradScaler | None, grad_clip: float | None,
             label_total: torch.Tensor | None = None, head: SplitHead | None = None) -> StepResult:
    """`label_total`: the loss's denominator when `batch` is one rank's share (runner/train/ranked.py);
    `optimizer`: what steps (a PlannedOptimizer's stepper: one with `gradients_complete()` is told when
    the last micro-batch's backward is done); `head`: memory.loss chunked's split head."""
    accumulated = accumulate(model, batch, micro_batch, precision, scaler, label_total, head)
    return update(model, optimizer, scaler, grad_clip, accumulated)


@dataclass
class Accumulated:
    """What the micro-batches leave for the update: the loss's denominator, the summed loss, and the
    last micro-batch's loss (alive until the step ends, as when one function ran both parts)."""

    total: torch.Tensor
    loss: torch.Tensor
    last: torch.Tensor | None


def accumulate(model, batch: Batch, micro_batch: int, precision: Precision, scaler: torch.amp.GradScaler | None,
               label_total: torch.Tensor | None = None, head: SplitHead | None = None) -> Accumulated:
    """The first part of `run_step`: every micro-batch's forward and backward, the gradients accumulated.
    The estimate's parts (runner/predict/parts.py) run the two parts apart, to see where one ends."""
    total = label_count(batch.labels) if label_total is None else label_total.to(batch.labels.device)
    loss = torch.zeros((), device=batch.labels.device)
    starts = range(0, len(batch.labels), micro_batch)
    micro_loss = None
    for start in starts:
        micro = batch.slice(start, start + micro_batch)
        with _gradient_sync(model, last=start == starts[-1]):
            micro_loss = micro_batch_loss(model, micro, precision, head) / total
            (scaler.scale(micro_loss) if scaler else micro_loss).backward()
        loss += micro_loss.detach()
    return Accumulated(total, loss, micro_loss)


def update(model, optimizer, scaler: torch.amp.GradScaler | None, grad_clip: float | None,
           accumulated: Accumulated) -> StepResult:
    """The second part of `run_step`: the gradients made final (bf16 weights' float32 sums), clipping, the
    optimizer's step and the gradients let go."""
    complete = getattr(optimizer, "gradients_complete", None)  # bf16 weights' float32 sums become the gradients
    if complete is not None:
        complete()
    skipped, grad_norm = _optimizer_step(model, optimizer, scaler, grad_clip)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(accumulated.loss, skipped, grad_norm)


def _gradient_sync(model, last: bool):
    """DDP: average gradients over the ranks once, after the last micro-batch's backward, not after
    each (`no_sync`); the others only accumulate locally. Any other model: nothing to skip."""
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) and not last else contextlib.nullcontext()


def _optimizer_step(model, optimizer, scaler, grad_clip) -> tuple[bool, torch.Tensor | None]:
    """(whether the fp16 scaler skipped the update, the gradient norm clipping measured: unscaled, before
    clipping, as HF Trainer logs its grad_norm; None without train.grad_clip, which computes none)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    # an optimizer that keeps the gradients itself (memory.optimizer_offload master: on the host) clips them there
    own = getattr(optimizer, "clip_gradients", None)
    norm = None if grad_clip is None else own(grad_clip) if own is not None else \
        clip_gradients(model.parameters(), grad_clip)
    if scaler is None:
        optimizer.step()
        return False, norm
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale() < scale, norm
