"""The memory cap and the margin kept under it: what "fits" means for every part of the tuner."""

from __future__ import annotations

from dataclasses import dataclass

from runner.units import format_bytes


@dataclass(frozen=True)
class Cap:
    bytes: int
    margin: float  # fraction of the cap kept free: measured peaks vary a little from run to run

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
