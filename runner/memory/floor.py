"""A lower bound on a plan's peak from what only the pools' policies change, without a fake step.

At the optimizer's step (or, where gradients leave early, throughout the backward) every parameter,
every gradient that is still on the device and the device's share of the optimizer state are alive
at once, whatever the activation knobs do: checkpointing, offload, micro-batching, compile and the
loss shrink only what comes on top. So from the model's parameter counts (counted on the meta device:
`ParameterFacts.of`) and a plan's weights, optimizer state, optimizer step and optimizer offload,
`pool_floor` says how many bytes the plan holds at least; the CUDA context comes on top of that on a
card. Each bound takes the pool's best case:

- parameters: as built, or 2 B an element where memory.weights holds them in bf16 or the optimizer
  offload holds bf16 copies of host masters (memory.optimizer_offload master: its best case, every
  parameter an nn.Linear's);
- gradients: the trainable parameters' bytes in the same dtype; bf16 weights over several
  micro-batches sum theirs in float32 (4 B: runner/memory/accumulation.py); none where the step runs
  in the backward, or where every gradient goes to the host as it is made (master); with the optimizer offloaded and every gradient final once accumulated (one
  micro-batch, no clipping), only the device's share (less the largest parameter: the offload splits
  between them);
- optimizer state: AdamW's two moments (ckrun's adamw only: another optimizer is taken to keep none),
  in the parameters' dtype or the low-bit policy's bytes without its scales, for the device's share.

Two callers: the tuner rules out a plan whose bound is over its limit before predicting it
(autotune/space/pool_floor.py), and a run is refused before its model is built when the bound is over
what the machine has (runner/train/run/room.py). Pure arithmetic: importing this imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.memory_plan import MemoryPlan, StepFacts, accumulates, gradients_final
from ..units import format_bytes

MOMENTS = 2  # AdamW's first and second moment
BF16_BYTES = 2
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ParameterFacts:
    """The model's parameters as built (counted on the meta device): what no memory knob but the pools'
    policies changes, so a lower bound on every plan's peak."""

    count: int  # elements of every parameter (each shared one once)
    bytes: int  # their bytes in the dtype they are built in
    trainable: int  # elements of those with requires_grad: they have gradients and optimizer state
    trainable_bytes: int
    largest: int  # bytes of the largest trainable parameter: a fractional offload splits between parameters

    @classmethod
    def of(cls, model) -> ParameterFacts:
        """Counted from a built model (on the meta device: nothing allocated), each shared (tied) parameter once."""
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        return cls(count=sum(p.numel() for p in params), bytes=sum(p.numel() * p.element_size() for p in params),
                   trainable=sum(p.numel() for p in trainable),
                   trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
                   largest=max((p.numel() * p.element_size() for p in trainable), default=0))


@dataclass(frozen=True)
class Floor:
    """Bytes a plan holds at least, per pool, and the context on top (a card's)."""

    parameters: int
    gradients: int
    optimizer_state: int
    context: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.context

    def words(self) -> str:
        return (f"{format_bytes(self.total)} (parameters {format_bytes(self.parameters)}, gradients "
                f"{format_bytes(self.gradients)}, optimizer state {format_bytes(self.optimizer_state)}"
                + (f", CUDA context {format_bytes(self.context)}" if self.context else "") + ")")


def pool_floor(plan: MemoryPlan, facts: ParameterFacts, step: StepFacts, context: int = 0) -> Floor:
    """The fewest bytes `plan` can hold on the device (module docstring), the CUDA context added."""
    bf16 = plan.weights.holds_bf16 or plan.optimizer_offload.masters_on_host
    parameters = min(facts.bytes, BF16_BYTES * facts.count) if bf16 else facts.bytes
    gradients = min(facts.trainable_bytes, BF16_BYTES * facts.trainable) if bf16 else facts.trainable_bytes
    moment = plan.optimizer_state.moment_bytes()
    state = 0 if not step.adamw else int(MOMENTS * (gradients if moment is None else moment * facts.trainable))
    if bf16 and accumulates(plan, step.batch_size):
        gradients = FLOAT32_BYTES * facts.trainable  # summed in float32 over the micro-batches
    host = plan.optimizer_offload.host_fraction()
    largest = facts.largest / max(facts.trainable_bytes, 1)  # the largest parameter's share of them
    device_share = lambda total: max(0, int((1 - host - largest) * total)) if host else total  # noqa: E731
    if plan.optimizer_step.updates_in_backward or plan.optimizer_offload.masters_on_host:
        gradients = 0
    elif host and gradients_final(plan, step):
        gradients = device_share(gradients)
    return Floor(parameters, gradients, device_share(state), context)
