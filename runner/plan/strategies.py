"""How ranks share the work, as types: each `distributed.strategy` is one class, like a memory policy.

A class is the whole strategy: its recipe fields (pydantic, discriminated by `strategy`), the rank
layout it asks for as named mesh dimensions (`mesh_dims`, the device mesh runner/parallel builds),
how many of the ranks see different samples (`data_parallel`), which world sizes it fits, which
memory plans and precisions it combines with, its tuner choices (`hsdp:2`) and its log line. The
trainer, the estimate and the tuner ask these methods, never a strategy's name. Adding a strategy
is one class here and its place in the union, how runner/parallel/wrap.py applies it, and its tests.

Pure data: importing this module imports neither torch nor torch.distributed.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from .choices import Choice, choice_class, choice_fields, members

TensorStyle = Literal["colwise", "rowwise"]


class Strategy(Choice):
    """What every strategy answers; `strategy` is each subclass's one literal (runner/plan/choices.py reads
    a tuner label back into it)."""

    discriminator: ClassVar[str] = "strategy"
    shards: ClassVar[bool] = False
    """Parameters, gradients and optimizer state split over ranks by FSDP2 (memory.sharding applies)."""
    layout_key: ClassVar[str] = "distributed.strategy"
    """The recipe key a `world_problem` is about (where the one line points)."""

    def mesh_dims(self, world_size: int) -> dict[str, int]:
        """The rank layout: mesh dimension names to sizes, outermost first (their product is the world)."""
        return {"dp": world_size}

    def data_parallel(self, world_size: int) -> int:
        """How many groups of ranks see different samples of the global batch."""
        return world_size

    def world_problem(self, world_size: int) -> str | None:
        """Why this strategy cannot lay out `world_size` ranks (a message about `layout_key`); None when it can."""
        return None

    def shard_group(self, world_size: int) -> int:
        """How many ranks FSDP2 splits each parameter, gradient and optimizer state over (1: none, and
        memory.sharding's knobs change nothing)."""
        return world_size if self.shards else 1

    def combination_problems(self, plan, precision: str) -> list[tuple[tuple[str, ...], str]]:
        """(recipe key path, message) for each setting this strategy cannot run with (a MemoryPlan, a precision)."""
        return []

    @classmethod
    def tuner_labels(cls, world_size: int) -> list[str]:
        """The choices of this strategy the tuner may try with `world_size` ranks."""
        return [cls.tag()] if world_size > 1 else []

    def describe(self, world_size: int) -> str:
        """One line for the log: what each rank holds."""
        return f"{self.strategy} over {world_size} ranks"


class SingleProcess(Strategy):
    strategy: Literal["none"] = "none"
    """One process trains on one device."""

    def mesh_dims(self, world_size: int) -> dict[str, int]:
        return {}

    def data_parallel(self, world_size: int) -> int:
        return 1

    def world_problem(self, world_size: int) -> str | None:
        if world_size > 1:
            return (f"none trains one process, but {world_size} ranks would each train alone; set ddp, fsdp, hsdp "
                    "or tp")
        return None

    @classmethod
    def tuner_labels(cls, world_size: int) -> list[str]:
        return []

    def describe(self, world_size: int) -> str:
        return "one process"


class DataParallel(Strategy):
    strategy: Literal["ddp"]
    """DDP: every rank holds the whole model and optimizer; gradients are averaged after backward."""

    def combination_problems(self, plan, precision: str) -> list[tuple[tuple[str, ...], str]]:
        problems = []
        if plan.optimizer_step.updates_in_backward:
            # DDP's reducer averages a gradient after autograd has accumulated it, where the update's hook runs
            problems.append((("memory", "optimizer_step"), "in_backward would update each parameter"
                             " with this rank's own gradient: DDP averages it over the ranks afterwards, in "
                             "buckets that hold every gradient for the whole run (so nothing would be freed either); "
                             "use distributed.strategy fsdp (its update runs on the averaged shard) or policy after"))
        if plan.optimizer_offload.moves_state:
            problems.append((("memory", "optimizer_offload"), "ckrun's host optimizer keeps its state"
                             " in a form the ranks' sharded checkpoint cannot save; use distributed.strategy "
                             "fsdp with memory.sharding.offload: cpu (FSDP2's own host offload), or policy none"))
        return problems

    def describe(self, world_size: int) -> str:
        return f"ddp: every rank holds the whole model; gradients are averaged over {world_size} ranks"


class _Sharded(Strategy):
    """Strategies whose data-parallel ranks hold FSDP2 shards: the rules FSDP2 sets on the plan."""

    shards: ClassVar[bool] = True

    def combination_problems(self, plan, precision: str) -> list[tuple[tuple[str, ...], str]]:
        problems = []
        if plan.checkpointing.spans_blocks:
            # a region's recompute replays its blocks' forwards, past the hooks FSDP2 gathers parameters in
            problems.append((("memory", "checkpointing"), f"{plan.checkpointing.label()} segments do not work with "
                             f"distributed.strategy {self.strategy} (their recompute bypasses FSDP's parameter "
                             "gathering); use every, layers or full, or strategy ddp"))
        if precision == "fp16":
            # the loss scaler would find inf/nan in each rank's shard alone: ranks could disagree on skipping
            problems.append((("precision",), f"fp16 with distributed.strategy {self.strategy} is not supported (its "
                             "loss scaler sees one shard per rank); use precision: bf16, or strategy: ddp"))
        if plan.optimizer_offload.moves_state:
            problems.append((("memory", "optimizer_offload"), f"under distributed.strategy {self.strategy} the host"
                             " offload is FSDP2's own: set memory.sharding.offload: cpu "
                             "instead (this rank's shards, their gradients and the optimizer step in host memory) and "
                             "leave this key out"))
        return problems


class FullySharded(_Sharded):
    strategy: Literal["fsdp"]
    """FSDP2 (`fully_shard` per block, then the whole model): parameters, gradients and optimizer
    state are split over the ranks; memory.sharding tunes it, `precision` sets its mixed precision."""

    def describe(self, world_size: int) -> str:
        return f"fsdp: parameters, gradients and optimizer state split over {world_size} ranks"


class HybridSharded(_Sharded):
    strategy: Literal["hsdp"]
    """HSDP: FSDP2 on a 2-D mesh. Each group of `shard` ranks (typically one node's GPUs) splits one
    copy of the model; the world / `shard` groups are replicas whose gradients are averaged. Less
    traffic between nodes than fsdp over all ranks, more memory than it per rank."""
    shard: int = Field(gt=0)
    """Ranks in one shard group; must divide the world size (the rest are replicas)."""
    layout_key: ClassVar[str] = "distributed.shard"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"shard": int(argument)}

    def label(self) -> str:
        return f"hsdp:{self.shard}"

    def mesh_dims(self, world_size: int) -> dict[str, int]:
        return {"replicate": world_size // self.shard, "shard": self.shard}

    def shard_group(self, world_size: int) -> int:
        return self.shard

    def world_problem(self, world_size: int) -> str | None:
        if world_size % self.shard:
            return f"shard groups of {self.shard} ranks do not divide {world_size} ranks; use {_divisors_text(world_size)}"
        return None

    @classmethod
    def tuner_labels(cls, world_size: int) -> list[str]:
        return [f"hsdp:{s}" for s in _proper_divisors(world_size)]

    def describe(self, world_size: int) -> str:
        return (f"hsdp: {world_size // self.shard} replicas, each split over {self.shard} ranks "
                "(gradients reduce-scattered within a group, averaged across the replicas)")


class TensorParallel(_Sharded):
    strategy: Literal["tp"]
    """Tensor parallelism (torch's `parallelize_module`): groups of `tensor` ranks split each chosen
    linear layer's weight (colwise: output features, rowwise: input features) and all see the same
    samples; the world / `tensor` groups are data-parallel ranks holding FSDP2 shards (2-D, as
    torchtitan does). Attention heads and hidden sizes must divide by `tensor`."""
    tensor: int = Field(gt=1)
    """Ranks in one tensor-parallel group; must divide the world size."""
    plan: dict[str, TensorStyle] | None = None
    """Which modules split how: a module name pattern (`layers.*.mlp.up_proj`, `*` for one name) to
    `colwise` or `rowwise`; a colwise layer's output must feed the rowwise one that closes it.
    Unset: the transformers model's own plan (its config's `base_model_tp_plan`)."""
    layout_key: ClassVar[str] = "distributed.tensor"

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"tensor": int(argument)}

    def label(self) -> str:
        return f"tp:{self.tensor}"

    def mesh_dims(self, world_size: int) -> dict[str, int]:
        return {"dp": world_size // self.tensor, "tp": self.tensor}

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.tensor

    def shard_group(self, world_size: int) -> int:
        return world_size // self.tensor  # FSDP2 shards over the data-parallel dimension only

    def world_problem(self, world_size: int) -> str | None:
        if world_size % self.tensor:
            return f"tensor groups of {self.tensor} ranks do not divide {world_size} ranks; use {_divisors_text(world_size)}"
        return None

    @classmethod
    def tuner_labels(cls, world_size: int) -> list[str]:
        return [f"tp:{t}" for t in [*_proper_divisors(world_size), world_size] if t > 1]

    def describe(self, world_size: int) -> str:
        data = world_size // self.tensor
        rest = f"; {data} data-parallel groups hold FSDP2 shards" if data > 1 else ""
        return f"tp: each layer of the plan split over {self.tensor} ranks{rest}"


def _proper_divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


def _divisors_text(n: int) -> str:
    """`2 or 4`: the group sizes that lay out n ranks (1 stands for no groups at all, so is left out)."""
    sizes = [*_proper_divisors(n), n] if n > 1 else [1]
    return ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])


Distributed = Annotated[SingleProcess | DataParallel | FullySharded | HybridSharded | TensorParallel,
                        Field(discriminator="strategy")]

STRATEGIES: tuple[type[Strategy], ...] = members(Distributed)


def strategy_from_label(label: str, pinned: Strategy | None = None) -> Strategy:
    """A tuner choice (`ddp`, `hsdp:2`, `tp:4`) as its strategy; a strategy of the same kind (`pinned`,
    the recipe's own) lends the fields no label says (tp's `plan`)."""
    cls = choice_class(STRATEGIES, label)
    lent = pinned.model_dump() if isinstance(pinned, cls) else {}
    return cls.model_validate({**lent, **choice_fields(STRATEGIES, label)})
