"""The optimizer a memory plan asks for, built once per run (and per plan in the estimator).

- `optimizer_state` 8bit / 4bit / fp8 and `weights` bf16: torchao.optim's AdamW (AdamW8bit, AdamW4bit,
  AdamWFp8, or `_AdamW` for bf16 weights with full-precision moments), with the recipe's adamw
  settings and its decay groups; `bf16_stochastic_round` when the weights are bf16. torchao compiles
  each parameter's update (torch.compile) into one fused kernel: on CUDA that is what it runs; on a
  CPU device the update runs eagerly (`torch.compiler.set_stance("force_eager")`), because compiling
  costs a C++ build per parameter shape (a minute on these machines) and the CPU's memory tracker
  cannot see inside compiled code; the arithmetic is the same, up to the fused kernel's rounding.
- `optimizer_offload` cpu: runner/memory/host_optimizer.py; `master` (float32 masters on the host, bfloat16
  weights on the device): runner/memory/host_master.py. Either runs the plan's optimizer on the host's
  tensors: torch's AdamW, or torchao's low-bit AdamW with `optimizer_state` 8bit/4bit/fp8.
- `optimizer_step` in_backward: `InBackwardUpdate` steps that optimizer for each parameter in the
  backward.
- `weights` bf16 over several micro-batches: `Float32Accumulation` (runner/memory/accumulation.py) sums
  the gradients in float32 and hands them over, rounded to bf16 once, before clipping and the update.

`PlannedOptimizer.optimizer` is what the schedule, checkpoints and the memory tracker see; its
`stepper` is what the training step steps (the optimizer itself, the in-backward update, whose
`step()` has nothing left to do, or the float32 accumulation, whose `gradients_complete()` the step
calls once every micro-batch's backward is done).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from ..builders.optim import build_optimizer, decay_groups, optimizer_over
from ..plan.memory_plan import MemoryPlan, accumulates
from ..recipe.recipe import TrainSpec
from .accumulation import Float32Accumulation

log = logging.getLogger(__name__)


@dataclass
class PlannedOptimizer:
    optimizer: torch.optim.Optimizer
    """What the learning-rate schedule, the checkpoints and the memory tracker see."""
    stepper: object
    """What the training step calls `step()` and `zero_grad()` on."""
    hooked: list = field(default_factory=list, repr=False)
    """What put hooks on the parameters (`install()`, `remove()`): the in-backward update, the offload."""

    def remove(self) -> None:
        """Take the optimizer's hooks off the parameters (the estimator tries another plan next)."""
        for part in self.hooked:
            part.remove()

    def install(self) -> None:
        """Put the hooks back on (each part once)."""
        for part in self.hooked:
            part.install()

    def hold(self) -> None:
        """The parameters as the plan's optimizer holds them on the device (memory.optimizer_offload master:
        bfloat16 copies of its host masters); nothing for any other. Before a memory tracker counts them."""
        for part in self.hooked:
            part.hold()

    def release(self) -> None:
        """The parameters back as the model had them (the estimator tries another plan next)."""
        for part in self.hooked:
            part.release()


def build_planned_optimizer(model: nn.Module, train: TrainSpec, plan: MemoryPlan, device: torch.device,
                            gradients_final: bool, host: torch.device | None = None) -> PlannedOptimizer:
    """The plan's optimizer over `model`'s trainable parameters. `gradients_final`: each gradient is
    complete when the backward accumulates it, and nothing but the update reads it (one micro-batch,
    no clipping, no loss scaling): the host offload then copies it right away. `host`: where an
    offloaded optimizer keeps its state (default the CPU, copies on a side stream; the estimator passes the
    meta device, and its copies run in order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    hooked = []
    if plan.optimizer_offload.moves_state:
        optimizer = _host_offload(model, params, train, plan, device, gradients_final, host)
        hooked.append(optimizer)
    elif plan.optimizer_state.optimizer_class() is not None or plan.weights.holds_bf16:
        optimizer = torchao_adamw(params, train, plan, device)
        if getattr(plan.optimizer_state, "full_precision_embeddings", False):
            keep_full_precision(optimizer, _embeddings(model))
    else:
        optimizer = build_optimizer(model, train, device)
    stepper = optimizer
    if accumulates_in_float32(plan, train):
        stepper = Float32Accumulation(optimizer, params)
        hooked.append(stepper)
        log.info("memory.weights bf16 over micro-batches of %d: gradients summed in float32, rounded to bf16 once "
                 "before the update", plan.micro_batch)
    if plan.optimizer_step.updates_in_backward:
        stepper = InBackwardUpdate(optimizer, params)
        hooked.append(stepper)
        log.info(plan.optimizer_step.describe())
    planned = PlannedOptimizer(optimizer, stepper, hooked)
    planned.hold()
    planned.install()
    return planned


def accumulates_in_float32(plan: MemoryPlan, train: TrainSpec) -> bool:
    """bf16 weights over several micro-batches: their gradients are summed in float32 (accumulation.py)."""
    return plan.weights.holds_bf16 and accumulates(plan, train.batch_size)


def _host_offload(model: nn.Module, params: list[nn.Parameter], train: TrainSpec, plan: MemoryPlan,
                  device: torch.device, gradients_final: bool, host: torch.device | None) -> torch.optim.Optimizer:
    """memory.optimizer_offload's optimizer: the host's share of the parameters (all of them, with the float32
    masters, under `master`), the plan's optimizer on each side."""
    make = functools.partial(_make, train, plan, device)
    where = host or torch.device("cpu")
    if plan.optimizer_offload.masters_on_host:
        from .chunked_loss import output_projection
        from .host_master import HostMasterOptimizer

        keep = set(output_projection(model).parameters()) if plan.loss.splits_head else set()
        optimizer = HostMasterOptimizer(model, params, make, device, where, keep,
                                        card=device if host is None else None, side_stream=host is None)
        log.info("%s (%d parameters)", plan.optimizer_offload.describe(), len(optimizer.copies))
    else:
        from .host_optimizer import HostOffloadOptimizer

        optimizer = HostOffloadOptimizer(params, make, device, plan.optimizer_offload.host_fraction(), where,
                                         gradients_final, side_stream=host is None)
        log.info("%s (%d of %d parameters, %s)", plan.optimizer_offload.describe(), len(optimizer.copies), len(params),
                 "each gradient copied as the backward accumulates it" if gradients_final
                 else "gradients copied after the backward")
    if getattr(plan.optimizer_state, "full_precision_embeddings", False):
        embeddings = _embeddings(model)
        keep_full_precision(optimizer.host_optimizer, [optimizer.copies[p] for p in embeddings if p in optimizer.copies])
        if optimizer.device_optimizer is not None:
            keep_full_precision(optimizer.device_optimizer, [p for p in embeddings if p not in optimizer.copies])
    return optimizer


def _embeddings(model: nn.Module) -> list[nn.Parameter]:
    return [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]


def _make(train: TrainSpec, plan: MemoryPlan, device: torch.device, params: list,
          where: torch.device) -> torch.optim.Optimizer:
    """The plan's optimizer over `params` on `where` (the device, or the host of an offload): torchao's low-bit
    AdamW where the plan's optimizer state asks for it (on the host's tensors: its update runs eagerly there),
    else the recipe's (torch's fused CPU AdamW on a CUDA run's host)."""
    if plan.optimizer_state.optimizer_class() is not None:
        return torchao_adamw(params, train, plan, where)
    return optimizer_over(params, train, where, fused_on_cpu=where.type == "cpu" and device.type == "cuda")


# --- torchao's AdamW --------------------------------------------------------------------------------


def torchao_adamw(params: list[nn.Parameter], train: TrainSpec, plan: MemoryPlan,
                  device: torch.device) -> torch.optim.Optimizer:
    """torchao.optim's AdamW for the plan's state precision, stochastically rounding bf16 weights."""
    import torchao.optim

    prime_quantization_maps()
    spec = train.optimizer
    name = plan.optimizer_state.optimizer_class() or "_AdamW"  # _AdamW: full-precision moments, bf16 rounding
    optimizer = getattr(torchao.optim, name)(decay_groups(params, spec.weight_decay), lr=spec.lr, betas=spec.betas,
                                            eps=spec.eps, bf16_stochastic_round=plan.weights.holds_bf16)
    if plan.weights.holds_bf16 and plan.optimizer_state.optimizer_class() is not None:
        float_moments(optimizer)
    for policy in (plan.weights, plan.optimizer_state):
        if policy.lossy:
            log.info(policy.describe())
    if device.type != "cuda":
        eager_updates(optimizer)
    if plan.weights.holds_bf16:
        seeded_rounding(optimizer, train.seed, device)
    return optimizer


def keep_full_precision(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> None:
    """torchao quantizes every moment of 4096 elements or more; these parameters' stay in their dtype
    (LowBitState.full_precision_embeddings says why). torchao creates each moment through the
    optimizer's `_new_buffer(param, signed)`; this instance's answers zeros of the parameter's dtype
    for them, as torchao's own does for a small tensor."""
    kept, quantized = {id(p) for p in params}, optimizer._new_buffer

    def new_buffer(param: torch.Tensor, signed: bool) -> torch.Tensor:
        return torch.zeros_like(param) if id(param) in kept else quantized(param, signed)
    optimizer._new_buffer = new_buffer


def float_moments(optimizer: torch.optim.Optimizer) -> None:
    """Quantized moments of bf16 weights appear as float32 (torchao's subclasses carry a dtype for show
    only: the same codes and scales, the same arithmetic, which dequantizes to float32 either way). Shown
    as bf16, an FSDP2 shard's moment breaks the update: a DTensor's `.float()` of it keeps bf16 in its
    metadata, and the next op refuses the mix (`expected dtype torch.bfloat16 for end`, torch 2.14,
    torchao 0.18). Loading a state dict casts the moments to the parameters' dtype again: put back after."""
    zeros = type(optimizer)._subclass_zeros
    optimizer._subclass_zeros = lambda param, signed, block_size: zeros(param, signed, block_size).to(torch.float32)
    optimizer.register_load_state_dict_post_hook(_moments_as_float)


def _moments_as_float(optimizer: torch.optim.Optimizer) -> None:
    from torch.distributed.tensor import DTensor

    for state in optimizer.state.values():
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if key == "step" or type(local) is torch.Tensor or value.dtype == local.dtype == torch.float32:
                continue  # plain moments (small or kept full) stay in the parameter's dtype, as torchao keeps them
            local = local.to(torch.float32)
            state[key] = local if not isinstance(value, DTensor) else DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())


def eager_updates(optimizer: torch.optim.Optimizer) -> None:
    """Run torchao's compiled update eagerly (module docstring: why on the CPU)."""
    step = optimizer.step
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6

    def eager_step(self, *args, **kwargs):
        with stance("force_eager") if stance is not None else contextlib.nullcontext():
            return step(*args, **kwargs)
    optimizer.step = types.MethodType(eager_step, optimizer)  # bound, as schedules wrap it


def seeded_rounding(optimizer: torch.optim.Optimizer, seed: int, device: torch.device) -> None:
    """bf16 weights: torchao rounds each update up or down at random, drawing from torch's default
    generator, which each data-parallel rank seeds apart for its dropout (runner/train/trainer.py). DDP's
    replicas must stay identical, so each step draws instead from a generator seeded by (train.seed, the
    step of the first parameter it updates, that parameter's place), the same on every rank: identical
    replicas round identically, FSDP2's shards each round their own elements, and a resumed run rounds as
    an uninterrupted one. The default generator's stream (dropout's) is put back as it was."""
    step, place = optimizer.step, {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    devices = [device] if device.type == "cuda" and torch.cuda.is_available() else []  # not the estimate's emulated CUDA

    def seeded_step(self, *args, **kwargs):
        drawn = _rounding_seed(self, place, seed)
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(drawn)
            if devices:
                with torch.cuda.device(device):
                    torch.cuda.manual_seed(drawn)
            return step(*args, **kwargs)
    optimizer.step = types.MethodType(seeded_step, optimizer)


def _rounding_seed(optimizer: torch.optim.Optimizer, place: dict, seed: int) -> int:
    """(train.seed, step, place) as one seed: of the first parameter with a gradient (in the backward, the
    one parameter being updated)."""
    param = next((p for g in optimizer.param_groups for p in g["params"] if p.grad is not None), None)
    if param is None:
        return seed
    state = optimizer.state.get(param) or {}
    step = int(state["step"]) if "step" in state else 0
    return ((seed * 1_000_003 + step) * 1_000_033 + place.get(param, 0)) % (1 << 63)


def prime_quantization_maps() -> None:
    """torchao builds its 8- and 4-bit code tables once, from tensors read with .tolist(); done here
    on real tensors, since the estimator builds the optimizer on fake ones, which have no values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchao.optim import subclass_4bit, subclass_8bit

    with unset_fake_temporarily():
        for module in (subclass_8bit, subclass_4bit):
            for build in (getattr(module, "get_qmap_signed", None), getattr(module, "get_qmap_unsigned", None)):
                if build is not None:  # older torchao builds its tables when imported
                    build()


# --- the update inside the backward ----------------------------------------------------------------


class InBackwardUpdate:
    """Updates each parameter, and frees its gradient, as soon as the backward has accumulated it.

    A post-accumulate-grad hook per parameter (torchtune's optimizer_in_bwd, torch's tutorial "How to
    save memory by fusing the optimizer step into the backward pass") runs the one optimizer of the
    recipe on that parameter alone: its groups are narrowed to it for the call, so the update is the
    arithmetic of the ordinary step, element for element, and the optimizer's state, schedule and
    checkpoints are the ordinary ones (a run can resume with or without this knob). Autograd
    accumulates a parameter only once every use of it has sent its gradient, so nothing reads the
    parameter after its update within the backward: a checkpointed block recomputes before its own
    parameters are accumulated."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        self.optimizer = optimizer
        # by index: loading a state dict replaces the group dicts, in the same order
        self._group_of = {p: index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.params = [p for p in params if p in self._group_of]
        self._handles = []

    def install(self) -> None:
        if not self._handles:
            self._handles = [p.register_post_accumulate_grad_hook(self._update) for p in self.params]

    def _update(self, param: nn.Parameter) -> None:
        groups = self.optimizer.param_groups
        kept = [group["params"] for group in groups]
        for index, group in enumerate(groups):
            group["params"] = [param] if index == self._group_of[param] else []
        try:
            self.optimizer.step()
        finally:
            for group, params in zip(groups, kept, strict=True):
                group["params"] = params
        param.grad = None

    def step(self, closure=None) -> None:
        """Nothing left to do: every parameter was updated in the backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def hold(self) -> None:
        """The parameters stay as they are."""

    def release(self) -> None:
        """Nothing was held."""
