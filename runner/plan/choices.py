"""What every recipe section that one of several classes stands for shares: a memory policy
(runner/plan/policies.py) and a distributed strategy (runner/plan/strategies.py) are each told apart by one
literal field (`policy`, `strategy`), written by the tuner as one label (`every:3`, `hsdp:2`: the
literal, then an argument), and read back from it here, the one way for both.

Pure data: importing this module imports neither torch nor anything of ckrun's.
"""

from __future__ import annotations

from typing import ClassVar, get_args

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base of every recipe section: strict types, unknown keys rejected, docstrings as help."""

    model_config = ConfigDict(strict=True, extra="forbid", use_attribute_docstrings=True, frozen=True)


class Choice(Strict):
    """One class of a discriminated union; `discriminator` names the field whose literal tells it apart."""

    discriminator: ClassVar[str]

    @classmethod
    def tags(cls) -> tuple[str, ...]:
        """The literals this class is written as (compression's cast: `bf16` and `fp8`)."""
        return get_args(cls.model_fields[cls.discriminator].annotation)

    @classmethod
    def tag(cls) -> str:
        return cls.tags()[0]

    @classmethod
    def from_argument(cls, argument: str) -> dict:
        """The fields a tuner label's argument (`3` of `every:3`, `2` of `hsdp:2`) stands for."""
        return {}

    def label(self) -> str:
        """The choice as one tuner label: `every:3`, `layers:0,2,5`, `bf16`, `hsdp:2`."""
        return getattr(self, self.discriminator)


def members(union) -> tuple[type[Choice], ...]:
    """The classes of an `Annotated[A | B | ..., Field(discriminator=...)]` union."""
    return get_args(get_args(union)[0])


def choice_class(kind: tuple[type[Choice], ...], label: str) -> type[Choice]:
    """The class among `kind` whose literal a tuner label (`every:3`) begins with."""
    tag = label.partition(":")[0]
    for cls in kind:
        if tag in cls.tags():
            return cls
    known = ", ".join(t for cls in kind for t in cls.tags())
    raise ValueError(f"no {kind[0].discriminator} is written {label!r}; one of {known}")


def choice_fields(kind: tuple[type[Choice], ...], label: str) -> dict:
    """A tuner label (`every:3`, `layers:1,3`, `fp8`, `tp:2`) as the recipe data of its class."""
    cls = choice_class(kind, label)
    tag, _, argument = label.partition(":")
    return {cls.discriminator: tag, **(cls.from_argument(argument) if argument else {})}
