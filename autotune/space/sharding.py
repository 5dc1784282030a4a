"""`ckrun tune --nproc N`: how the ranks share the work, as one more knob of the space.

With N ranks the memory of a rank depends on the strategy as much as on checkpointing: DDP keeps
the whole model, its gradients and optimizer state on every rank; FSDP2 splits them over the ranks
(fsdp), over groups of S ranks with N/S replicas (hsdp:S), or over the data-parallel ranks left
after tensor parallelism splits each planned layer over T ranks (tp:T). FSDP2's own knobs
(memory.sharding) trade communication for memory the way checkpointing trades recompute: keeping
the gathered parameters from forward to backward (`reshard_after_forward: false`) saves a second
all-gather, and CPU offload (CUDA only) moves the shards, gradients and optimizer step to the host.

A choice is a `ShardingChoice`: a strategy (a ckrun.runner.plan.strategies type) and its memory.sharding. The
space stores it as one optuna categorical string, its label, read back by `ShardingChoice.from_label`:

    label   := strategy [":" words]         strategy's own label first: ddp, fsdp, hsdp:2, tp:2
    words   := [argument ","] knob ("," knob)*  in the order keep, cpu
    knob    := "keep"  (reshard_after_forward false) | "cpu"  (offload cpu)

so `fsdp`, `fsdp:keep`, `fsdp:cpu`, `fsdp:keep,cpu` (the labels of studies before hsdp and tp),
`hsdp:2`, `hsdp:2,keep`, `tp:2,keep,cpu`. Default knobs are written as none: one label per plan.
Only a label read back into itself is accepted, so a mistyped one fails loudly.

`SHARDING` is the knob's entry in the tuner's table (autotune/space/knobs.py lists it first).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckrun.runner.plan.memory_plan import Sharding
from ckrun.runner.plan.strategies import STRATEGIES, HybridSharded, SingleProcess, Strategy, TensorParallel, strategy_from_label

from .candidate import Candidate
from .facts import Device
from .space import UNSAID, Asked, Knob, Space
from .tp_facts import TensorFacts

KNOB_WORDS = {"keep": ("reshard_after_forward", False), "cpu": ("offload", "cpu")}
"""The label's word for each memory.sharding value other than FSDP2's default, in label order."""


@dataclass(frozen=True)
class ShardingChoice:
    """One value of the `sharding` knob: the strategy, and memory.sharding (None: FSDP2's defaults)."""

    strategy: Strategy
    knobs: Sharding | None = None

    def __post_init__(self):
        if self.knobs == Sharding():
            object.__setattr__(self, "knobs", None)  # the defaults spelt out are the same plan, the same label

    def words(self) -> list[str]:
        return [word for word, (key, value) in KNOB_WORDS.items()
                if self.knobs is not None and getattr(self.knobs, key) == value]

    def label(self) -> str:
        label, words = self.strategy.label(), self.words()
        if not words:
            return label
        return label + ("," if ":" in label else ":") + ",".join(words)

    @classmethod
    def from_label(cls, label: str, pinned: Strategy | None = None) -> ShardingChoice:
        """The choice `label` writes; a strategy of the recipe's own kind (`pinned`) lends the fields
        no label says (tp's `plan`). A ValueError for anything `label()` would not write."""
        tag, _, rest = label.partition(":")
        parts = rest.split(",") if rest else []
        words = [part for part in parts if part in KNOB_WORDS]
        argument = ",".join(part for part in parts if part not in KNOB_WORDS)
        knobs = Sharding(**dict(KNOB_WORDS[word] for word in words)) if words else None
        choice = cls(strategy_from_label(tag + (f":{argument}" if argument else ""), pinned), knobs)
        if choice.label() != label:
            raise ValueError(f"{label!r} is not a sharding choice; did you mean {choice.label()!r}?")
        return choice

    def describe(self) -> str:
        """How a plan's label names it: `hsdp:2 (reshard_after_forward false, offload cpu)`."""
        changed = [f"{KNOB_WORDS[word][0]} {str(KNOB_WORDS[word][1]).lower()}" for word in self.words()]
        return self.strategy.label() + (f" ({', '.join(changed)})" if changed else "")


# --- the knob's choices for a recipe and a world size ------------------------------------------------


def add_sharding(space: Space, asked: Asked) -> None:
    """The `sharding` knob for --nproc ranks: with distributed.strategy none, every strategy the world
    size and the model allow; else the recipe's own strategy and its knob variants. Each choice, and
    each strategy left out, is logged with its reason. One process: no knob."""
    recipe, tensor, device, nproc = asked.recipe, asked.facts.tensor, asked.device, asked.nproc
    if nproc == 1:
        return
    space.world_size = nproc
    pinned = recipe.distributed
    if isinstance(pinned, SingleProcess):
        strategies = _searched(nproc, tensor, space.reasons)
        why = f"distributed.strategy none with --nproc {nproc}: the tuner chooses how the ranks share the work"
    else:
        strategies = [pinned]
        why = f"the recipe's distributed.strategy {pinned.strategy}, with its own variants only (none searches all)"
    choices = [choice.label() for strategy in strategies
               for choice in _variants(strategy, recipe.memory.sharding, device, nproc, space.reasons)]
    choices = list(dict.fromkeys(choices))
    if len(choices) == 1:
        space.fixed["sharding"] = choices[0]
        space.reasons.append(f"sharding pinned to {choices[0]} over {nproc} ranks: {why}")
    else:
        space.choices["sharding"] = choices
        space.reasons.append(f"sharding in {choices}: {why} (`keep`: reshard_after_forward false, each block's "
                             "gathered parameters kept from forward to backward; `cpu`: FSDP2's CPU offload)")
    space.strategies = list({strategy.label(): strategy for strategy in strategies}.values())
    space.reasons += [strategy.describe(nproc) for strategy in strategies]
    if device.kind != "cuda" and any(strategy.shards for strategy in strategies):
        space.reasons.append("FSDP's CPU offload not searched: it needs CUDA")


def _searched(nproc: int, tensor: TensorFacts | None, reasons: list[str]) -> list[Strategy]:
    """The strategies each type offers for `nproc` ranks (`tuner_labels`), less those the world size
    or the model rules out; one line per rule, or per label where they differ."""
    kept = []
    for cls in STRATEGIES:
        labels = cls.tuner_labels(nproc)
        if not labels and cls is not SingleProcess:  # one process is never a choice of several ranks
            reasons.append(f"{cls.tag()} not searched: {_no_layout(cls, nproc)}")
        problems = {}
        for label in labels:
            strategy = strategy_from_label(label)
            problem = strategy.world_problem(nproc) or _model_problem(strategy, tensor)
            if problem:
                problems[label] = problem
            else:
                kept.append(strategy)
        if problems and len(problems) == len(labels) and len(set(problems.values())) == 1:
            reasons.append(f"{cls.tag()} not searched: {next(iter(problems.values()))}")
        else:
            reasons += [f"{label} not searched: {problem}" for label, problem in problems.items()]
    return kept


def _no_layout(cls: type[Strategy], nproc: int) -> str:
    if issubclass(cls, HybridSharded):
        return (f"{nproc} ranks have no shard group size between 1 and {nproc} that divides them (hsdp:S needs "
                "S ranks per group and at least 2 groups: 4 ranks or more)")
    return f"it offers no layout of {nproc} ranks"


def _model_problem(strategy: Strategy, tensor: TensorFacts | None) -> str | None:
    """Why the model cannot take `strategy`: tp with the model's own plan needs one that splits evenly."""
    if not isinstance(strategy, TensorParallel) or strategy.plan is not None:
        return None
    if tensor is None:
        return "the model's facts do not say whether it ships a tensor-parallel plan"
    return tensor.problem(strategy.tensor)


def _variants(strategy: Strategy, own: Sharding | None, device: Device, nproc: int,
              reasons: list[str]) -> list[ShardingChoice]:
    """`strategy` with each memory.sharding the space tries: the recipe's own first (the starting
    points take the first), FSDP2's defaults, keep, and on CUDA cpu."""
    if not strategy.shards:
        return [ShardingChoice(strategy)]
    if strategy.shard_group(nproc) < 2:
        reasons.append(f"memory.sharding not searched with {strategy.label()}: FSDP2 splits nothing over a group "
                       f"of {strategy.shard_group(nproc)} rank, so its knobs change nothing")
        return [ShardingChoice(strategy, own)]
    knobs = [own, None, Sharding(reshard_after_forward=False)] + ([Sharding(offload="cpu")] if device.kind == "cuda"
                                                                 else [])
    return [ShardingChoice(strategy, k) for k in knobs]


def _to_plan(values: dict, space: Space) -> dict:
    if "sharding" not in values:
        return {}
    choice = ShardingChoice.from_label(values["sharding"], space.base.distributed if space.base else None)
    return {"strategy": choice.strategy, **({"memory": {"sharding": choice.knobs.model_dump()}} if choice.knobs else {})}


def _from_plan(candidate: Candidate, space: Space):
    """A plan without a strategy (the recipe's own, a solver's) runs under the pinned one; among
    several it cannot say which."""
    if candidate.strategy is not None:
        return ShardingChoice(candidate.strategy, candidate.plan.sharding).label()
    return UNSAID if space.searched("sharding") else space.fixed.get("sharding")


def _words(candidate: Candidate) -> str | None:
    return ShardingChoice(candidate.strategy, candidate.plan.sharding).describe() if candidate.strategy else None


def _starts(space: Space, recipe, predicted: bool) -> list[str]:
    """With predictions (`tune --predict`, or screening on a GPU; with the device's facts they order the
    starting points, the predicted fastest first), each strategy's first choice (the recipe's own knobs,
    else FSDP2's defaults): every way to share the work is in the first trials, whatever the budget, so a
    larger --trials changes the winner only where the sampler finds a faster plan later (a smaller one
    sees the same trials first: they are a prefix). Without predictions the first choice only: nothing
    says which strategy fits, and each starting point would cost a group of real ranks."""
    choices = space.choices["sharding"]
    if not predicted:
        return choices[:1]
    pinned = space.base.distributed if space.base else None
    first: dict[str, str] = {}
    for label in choices:
        first.setdefault(ShardingChoice.from_label(label, pinned).strategy.label(), label)
    return list(first.values())


SHARDING = Knob("sharding", add_sharding, _to_plan, _from_plan, _starts, _words)
"""How --nproc ranks share the work; each strategy a starting point of its own when plans are predicted."""
