"""What a paired difference shows with the seeds that were run, as one of three readings:

- resolved: its 95% t-interval excludes 0 and Benjamini-Hochberg at 5% over the comparisons of its sentence
  keeps it ("fell", "rose", "lower", "higher");
- equivalent within ±margin: its 95% interval lies inside ±margin (equivalence shown, not a failure to find a
  difference; stricter than TOST's 90% interval);
- not resolved: neither, said with its half-width and, at the spread seen, the seeds that would settle it: where
  the difference seen lies inside the margin, those whose 95% interval would lie inside it (equivalence); else
  those that would resolve it from 0 at the level alpha / m that Benjamini-Hochberg keeps whatever the other
  comparisons are.
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
    def shows_equivalence(self) -> bool:
        """Whether more seeds are asked of to show equivalence (the difference seen lies inside the margin) rather
        than to resolve the difference from 0."""
        return abs(self.d.mean) < self.margin

    @property
    def seeds_needed(self) -> int | None:
        """Where the difference seen lies inside the margin, the seeds whose 95% interval, at the observed mean and
        sd, would lie inside it (equivalence shown); else the seeds whose interval would exclude 0 at alpha /
        family. None where neither can be asked (one seed, or a difference of 0 outside a margin of 0)."""
        d = self.d
        if d.n < 2 or not math.isfinite(d.sd) or (d.mean == 0 and not self.shows_equivalence):
            return None
        if d.sd == 0:
            return d.n
        if self.shows_equivalence:
            def enough(n: int) -> bool:
                return abs(d.mean) + stats.t.ppf(1 - ALPHA / 2, n - 1) * d.sd / math.sqrt(n) < self.margin
        else:
            level = ALPHA / max(self.family, 1)

            def enough(n: int) -> bool:
                return stats.t.ppf(1 - level / 2, n - 1) * d.sd / math.sqrt(n) < abs(d.mean)
        return next((n for n in range(2, MOST_SEEDS + 1) if enough(n)), MOST_SEEDS + 1)


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


def needed(v: Verdict, margin_text: str) -> str:
    """How many seeds would settle the difference seen, at the spread seen: show it equivalent within the margin
    where it lies inside it, else resolve it from 0."""
    n = v.seeds_needed
    if n is None:
        return "the difference seen is 0"
    what = (f"show equivalence within ±{margin_text}" if v.shows_equivalence else
            "resolve a difference this size from 0")
    if n > MOST_SEEDS:
        return f"more than {MOST_SEEDS:,} seeds would be needed to {what} at this spread"
    return f"about {n} seeds would {what} at this spread"
