"""Small statistics the benchmarks share."""

from __future__ import annotations


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equally long series without ties (1: the same order)."""
    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(len(values)), key=values.__getitem__)
        return [order.index(i) for i in range(len(values))]
    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))
