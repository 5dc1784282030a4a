"""What every memory-plan policy class stands on (runner/plan/policies.py for the activations,
runner/plan/pool_policies.py for the pools beside them): `Policy`, with its place in the per-block solver
(`block_action`, `covers`, `on_blocks`) and the tuner's starting points; `BlockList`, a policy that
names its blocks, with what it needs to know of a model's blocks (`BlockLayout`); and `PoolPolicy`,
the base of the pools' policies, with the optional library one needs refused in one line when absent.

Pure data: importing this module imports neither torch nor torchao.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import ClassVar, Protocol

from pydantic import field_validator

from .choices import Choice

class BlockLayout(Protocol):
    """What a policy needs to know of a model's repeated blocks: how many, and the container of each
    (ckrun.runner.memory.blocks.BlockList; the tuner's model facts)."""

    containers: list[str]

    def __len__(self) -> int: ...


def check_indices(key: str, indices: list[int], count: int) -> None:
    """A ValueError naming the recipe key when an index is past the last block."""
    for index in indices:
        if index >= count:
            raise ValueError(f"{key}: block {index} is out of range; the model has {count} blocks (0-{count - 1})")


def short_list(indices: list[int], most: int = 6) -> str:
    """'0,2,4,6,8,10,...,22': enough indices for a log line."""
    shown = ",".join(str(i) for i in indices[:most])
    return shown + (f",...,{indices[-1]}" if len(indices) > most else "")


class Policy(Choice):
    """What every policy class answers; `policy` is each subclass's literal (runner/plan/choices.py reads
    a tuner label back into it)."""

    discriminator: ClassVar[str] = "policy"
    block_action: ClassVar[str | None] = None
    """What it does to each block it covers, in the words of the per-block solver and of the cost
    table's columns (runner/predict/block_costs.py): `keep`, `recompute`, `selective`, `offload`;
    None: nothing a single block can be given (sqrt recomputes a segment of blocks as one)."""
    covers: ClassVar[str | None] = None
    """The sets of blocks it can be written for, as the per-block solver writes a plan: `none`,
    `every`, `listed` (any non-empty set, its `layers`); None: no set the solver picks (every k-th)."""
    tuner_starts: ClassVar[tuple[str, ...]] = ()
    """Its labels among the tuner's known-good starting points, tried before the sampler's plans."""

    @classmethod
    def on_blocks(cls, chosen: list[int], count: int) -> dict | None:
        """Its recipe fields acting on exactly the blocks `chosen` of a model of `count` (by `covers`);
        None: it cannot say that set of blocks."""
        every = bool(count) and chosen == list(range(count))
        if cls.covers == "none" and not chosen or cls.covers == "every" and every:
            return {cls.discriminator: cls.tag()}
        return {cls.discriminator: cls.tag(), "layers": list(chosen)} if cls.covers == "listed" and chosen else None


class BlockList(Policy):
    """A policy that names its blocks (`layers: [0, 2, 5]`, the tuner's `layers:0,2,5`); its kind says its
    `section` of the plan."""

    layers: list[int]
    covers: ClassVar[str] = "listed"

    @field_validator("layers")
    @classmethod
    def _unique(cls, layers: list[int]) -> list[int]:
        if len(set(layers)) != len(layers):
            raise ValueError("a block index is listed twice")
        return sorted(layers)

    def chosen(self, layout: BlockLayout) -> list[int]:
        check_indices(f"memory.{self.section}.layers", self.layers, len(layout))
        return list(self.layers)

    def label(self) -> str:
        return "layers:" + ",".join(map(str, self.layers))

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        return {"layers": [int(i) for i in argument.split(",")]}


# --- the pools' policies ---------------------------------------------------------------------------


TORCHAO = "torchao"


def library_missing(library: str | None, key: str, policy: str) -> str | None:
    """One line saying that `key: policy` needs a package this Python does not have, or None."""
    if library is None or importlib.util.find_spec(library) is not None:
        return None
    return (f"{key}: policy {policy} needs the {library} package, which is not installed: pip install "
            f"'ckrun[lowbit]' (or pip install {library}), or leave {key} at its default")


class PoolPolicy(Policy):
    """What every policy of a pool answers."""

    section: ClassVar[str]
    """The memory plan's key (`weights`, `optimizer_state`, ...)."""
    pool: ClassVar[str]
    """The memory pool it acts on, as the estimate's breakdown names it."""
    lossy: ClassVar[bool] = False
    """It changes the training beyond float rounding: needs memory.allow_lossy, and its error is measured."""
    library: ClassVar[str | None] = None
    """The optional package it needs."""
    active: ClassVar[bool] = True
    """It changes anything at all (each pool's default does not)."""

    @field_validator("policy", check_fields=False)
    @classmethod
    def _library_installed(cls, policy: str) -> str:
        why = library_missing(cls.library, f"memory.{cls.section}", policy)
        if why is not None:
            raise ValueError(why.split(": ", 1)[1])  # the loader puts the key in front itself
        return policy

    @classmethod
    def tuner_labels(cls) -> list[str]:
        """The choices it offers the tuner (none when its library is missing)."""
        return [] if library_missing(cls.library, cls.section, cls.tag()) else [cls.tag()]

    @classmethod
    def key_doc(cls) -> str:
        """Its recipe key's documentation (`memory.weights`): the docstring of its kind's base class, the
        class that names the `section` (the plan's field is made from it: runner/plan/memory_plan.py)."""
        return inspect.cleandoc(next(c.__doc__ for c in cls.__mro__ if "section" in vars(c)))

    def saved_as(self) -> str | None:
        """What a checkpoint's weights and optimizer state depend on of this policy, as a string the resume
        fingerprint compares (runner/train/checkpoint/fingerprint.py); None: the same state is saved
        whatever this policy is, so it may change on resume. By default its whole label: a pool that
        does not say otherwise refuses a resume under another of its settings."""
        return self.label()

    def describe(self) -> str:
        """The log line when it is applied."""
        return self.label()
