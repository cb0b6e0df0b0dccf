"""How a paired difference, a list and a number read in the report's sentences (findings.py, rules.py and the
recommendation word their comparisons alike)."""
from __future__ import annotations

import math

from .measures import ACCURACY, Measure, not_rounded_away
from .runs import Difference
from .verdicts import Verdict, control, judge, needed


def percent(x: float, full: float = 1.0) -> str:
    """An accuracy in percent, of a value whose 100% is `full` (figures.full_scale)."""
    return f"{100 * x / full:.1f}%"


def listed(items: list[str]) -> str:
    """a; a and b; a, b and c."""
    return f"{', '.join(items[:-1])} and {items[-1]}" if len(items) > 1 else items[0]


def lowered(sentence: str) -> str:
    """A sentence that goes on after a label: 'The noise scale' reads 'the noise scale'; 'BN' stays."""
    return sentence[0].lower() + sentence[1:] if sentence[1:2].islower() else sentence


def signed_end(x: float, places: int) -> str:
    """An end of a separated interval, signed: it is not zero, and "-0.0" would read as if the interval reached it."""
    return not_rounded_away(x, places, "+,")


def significant(x: float, sign: str = "") -> str:
    """Two significant digits: BN statistics' errors span 0.001 to 1, where fixed decimals hide differences."""
    rounded = float(f"{abs(x):.2g}")  # (0.0999... has the places of 0.10, not of 0.099)
    places = max(0, 1 - math.floor(math.log10(rounded))) if rounded and math.isfinite(rounded) else 0
    return f"{x:{sign}.{places}f}"


def plus_minus(d: Difference, m: Measure, places: int) -> str:
    """'+0.4 ± 1.2 points'; a mean in points that rounds to zero reads '0.0', unsigned (not '-0.0'); a metric of
    its own shows such a mean in two significant digits (Measure.shown)."""
    label, unit = ("", " points") if m.points else (f"{m.name} ", "")
    mean = m.scaled(d.mean)
    mean = m.shown(mean, places, "+") if round(mean, places) or not m.points else f"{0:.{places}f}"
    return f"{label}{mean} ± {m.shown(m.scaled(d.half), places)}{unit}"


def stated(d: Difference, ahead: str = "higher", behind: str = "lower", m: Measure = ACCURACY,
           v: Verdict | None = None) -> str:
    """How a paired difference reads (verdicts): a difference only where it is resolved, and with the control
    that kept it; equivalence only inside the margin; else not resolved, with the seeds that would resolve it.
    `v` is its verdict within its sentence's family; alone, it is a family of one."""
    if d.n < 2:
        return f"{m.amount(d.mean)} {ahead if d.mean > 0 else behind} in one seed, which cannot be told from seed noise"
    v = v or judge([d], m.margin)[0]
    places = m.interval_places(d.half)
    if v.resolved or (v.equivalent and d.separated):  # (inside the margin but off 0: both said, not "equivalent")
        lo, hi = m.scaled(d.mean - d.half), m.scaled(d.mean + d.half)
        while places < 6 and not (round(lo, places) and round(hi, places)):  # (an end that read 0 would reach it)
            places += 1
        inside = f", inside the ±{m.margin_text} equivalence margin" if v.equivalent else ""
        kept = control(v) if v.resolved else f"its own interval excludes 0, but it is {control(v)}"
        return (f"{m.amount(d.mean, places)} {ahead if d.mean > 0 else behind}, 95% CI {signed_end(lo, places)} to "
                f"{signed_end(hi, places)} over {d.n} seeds; {kept}{inside}")
    if v.equivalent:
        return f"equivalent within ±{m.margin_text} ({plus_minus(d, m, places)} over {d.n} seeds)"
    why = f"; its own interval excludes 0, but it is {control(v)}" if d.separated else ""
    return f"not resolved with {d.n} seeds ({plus_minus(d, m, places)}{why}; {needed(v, m.margin_text)})"


def controlled(labelled: list[tuple[str, Difference | None]], what: str) -> list[str]:
    """With many comparisons, how many differences survive false-discovery control beside their own intervals,
    and which."""
    labelled = [(name, d) for name, d in labelled if d is not None and d.n >= 2]
    if len(labelled) < 4:
        return []
    verdicts = judge([d for _, d in labelled], math.inf)
    apart = sum(d.separated for _, d in labelled)
    kept = [name for (name, _), v in zip(labelled, verdicts) if v.resolved]
    differ = "differs by its" if apart == 1 else "differ by their"
    named = f": {listed(kept)}" if kept else ""
    return [f"Of the {len(labelled)} {what}, {apart} {differ} own 95% interval and {len(kept)} "
            f"survive{'s' * (len(kept) == 1)} false-discovery control (Benjamini-Hochberg at 5%, paired t-tests over "
            f"the seeds){named}."]


def where_at(b: int, **names) -> str:
    """'none at B = 256', or 'B = 256' alone."""
    return " at ".join([", ".join(str(v) for v in names.values()), f"B = {b}"]) if names else f"B = {b}"
