"""The interval of a paired benchmark's figure: the median of the pairs' ratios (each pair's two sides run one
after the other, under the same conditions) and its distribution-free 95% interval."""
from __future__ import annotations

import statistics


def interval(ratios: list[float], level: float = 0.95) -> tuple[float, float]:
    """The distribution-free interval of the median: order statistics j and n - 1 - j, the widest pair whose
    binomial coverage is at least `level` (for 40 pairs, the 14th and 27th; for 6, the least and the greatest).
    Below 6 pairs no pair of order statistics covers 95%: the least and the greatest are returned all the same."""
    from scipy.stats import binom

    ordered, n = sorted(ratios), len(ratios)
    j = max([i for i in range(n // 2) if binom.cdf(n - 1 - i, n, 0.5) - binom.cdf(i, n, 0.5) >= level] or [0])
    return ordered[j], ordered[n - 1 - j]


def summary(ratios: list[float], what: str) -> str:
    """"<what> <median> (95% interval <low> to <high>, n pairs)", each as a ratio's excess over 1."""
    low, high = interval(ratios)
    return (f"{what} {statistics.median(ratios) - 1:+.2%} (95% interval {low - 1:+.2%} to {high - 1:+.2%}, "
            f"{len(ratios)} pairs)")
