"""What a paired difference shows with the seeds that were run, as one of three readings:

- resolved: its 95% t-interval excludes 0 and Benjamini-Hochberg at 5% over the comparisons of its sentence
  keeps it ("fell", "rose", "lower", "higher");
- equivalent within ±margin: its 95% interval lies inside ±margin (equivalence shown, not a failure to find a
  difference; stricter than TOST's 90% interval);
- not resolved: neither, said with its half-width and the seeds that would resolve the difference seen, at
  the spread seen, at the level alpha / m that Benjamini-Hochberg keeps whatever the other comparisons are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from .runs import Difference

ALPHA = 0.05
MOST_SEEDS = 1000  # beyond this the seeds needed are said as "more than"


@dataclass
class Verdict:
    d: Difference
    adjusted: float  # Benjamini-Hochberg-adjusted p within its family; NaN for one seed
    family: int  # how many comparisons the control ran over
    margin: float  # the equivalence margin, in the metric's units

    @property
    def resolved(self) -> bool:
        return self.d.separated and self.adjusted <= ALPHA

    @property
    def equivalent(self) -> bool:
        return self.d.n >= 2 and abs(self.d.mean) + self.d.half < self.margin

    @property
    def seeds_needed(self) -> int | None:
        """The seeds whose interval, at the observed mean and sd, would exclude 0 at alpha / family; None where
        the observed difference is 0."""
        d = self.d
        if d.n < 2 or not math.isfinite(d.sd) or d.mean == 0:
            return None
        if d.sd == 0:
            return d.n
        level = ALPHA / max(self.family, 1)
        for n in range(2, MOST_SEEDS + 1):
            if stats.t.ppf(1 - level / 2, n - 1) * d.sd / math.sqrt(n) < abs(d.mean):
                return n
        return MOST_SEEDS + 1


def judge(diffs: list[Difference | None], margin: float) -> list[Verdict | None]:
    """Each difference's verdict, Benjamini-Hochberg running over those of two seeds or more (None stays None)."""
    counted = [d for d in diffs if d is not None and d.n >= 2 and math.isfinite(d.p)]
    adjusted = iter(stats.false_discovery_control(np.array([d.p for d in counted]), method="bh")
                    if counted else [])
    out = []
    for d in diffs:
        if d is None:
            out.append(None)
        elif d.n >= 2 and math.isfinite(d.p):
            out.append(Verdict(d, float(next(adjusted)), len(counted), margin))
        else:
            out.append(Verdict(d, math.nan, len(counted), margin))
    return out


def control(v: Verdict) -> str:
    """The false-discovery control a difference passed (or did not), named in its sentence."""
    if v.family == 1:
        return f"paired t-test p {_p(v.adjusted)}, the one comparison"
    kept = "kept" if v.adjusted <= ALPHA else "not kept"
    return f"{kept} by Benjamini-Hochberg at 5% over {v.family} comparisons, adjusted p {_p(v.adjusted)}"


def _p(p: float) -> str:
    return f"{p:.2g}" if p >= 0.001 else f"{p:.1e}"


def needed(v: Verdict) -> str:
    """How many seeds would resolve the difference seen, at the spread seen."""
    n = v.seeds_needed
    if n is None:
        return "the difference seen is 0"
    if n > MOST_SEEDS:
        return f"more than {MOST_SEEDS:,} seeds would be needed to resolve a difference this size at this spread"
    return f"about {n} seeds would resolve a difference this size at this spread"
