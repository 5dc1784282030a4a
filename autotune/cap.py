"""The memory cap and the margin kept under it: what "fits" means for every part of the tuner."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import ByteSize, TypeAdapter, ValidationError

from ckrun.runner.problems import InputError, Place, Problem
from ckrun.runner.units import format_bytes

MARGIN = 0.05  # the fraction kept free when none is given: `ckrun tune --margin`, `ckrun.tune(margin=...)`


@dataclass(frozen=True)
class Cap:
    bytes: int
    margin: float  # fraction of the cap kept free: measured peaks vary a little from run to run

    @classmethod
    def parse(cls, max_mem: str | int, margin: float = MARGIN, named: tuple[str, str] = ("max_mem", "margin")) -> Cap:
        """The cap as a user gives it (`40GB`, `40GiB`, `512MB` or bytes) and the margin, checked: the one
        parser of a cap, for `ckrun tune` and the Python API alike. `named`: what the two are called where
        they were given (`--max-mem`, `--margin` on the command line), which a refusal starts with."""
        try:
            size = int(TypeAdapter(ByteSize).validate_python(max_mem))
        except ValidationError:
            raise _refused(named[0], f"{max_mem!r} is not a size; write it like 40GB, 40GiB, 512MB or a number of "
                                     "bytes") from None
        if size <= 0:
            raise _refused(named[0], f"the cap must be positive but got {max_mem!r}")
        if not 0 <= margin < 0.5:
            raise _refused(named[1], f"a fraction of the cap in [0, 0.5) but got {margin}")
        return cls(size, margin)

    @property
    def limit(self) -> int:
        """A plan fits when its measured peak is at most this."""
        return int(self.bytes * (1 - self.margin))

    @property
    def screen_above(self) -> int:
        """Predictions are rough: only a plan predicted clearly over the cap is skipped unmeasured."""
        return int(self.bytes * (1 + self.margin))

    def constraint(self, peak: int) -> float:
        """optuna's constraint, positive when over: scaled by the cap so TPE compares numbers near 1."""
        return (peak - self.limit) / self.bytes

    def describe(self) -> str:
        return f"{format_bytes(self.limit)} ({format_bytes(self.bytes)} cap minus {self.margin:.0%} margin)"

    def meaning(self, device_kind: str) -> str | None:
        """On a CPU the cap is not a GPU's memory: say what it holds to, before the first probe runs."""
        if device_kind != "cpu":
            return None
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        machine = f" (this machine has {format_bytes(ram)})" if ram else ""
        return (f"tune: on the CPU, --max-mem {format_bytes(self.bytes)} caps RAM: the live tensor bytes of a step "
                f"(parameters, gradients, optimizer state, activations) that ckrun's tracker counts{machine}; every "
                "probe runs real CPU steps, which take long for a large model. On a GPU machine it caps the card's memory")


def _refused(name: str, message: str) -> InputError:
    return InputError([Problem(Place(name), "", message)])
