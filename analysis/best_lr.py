"""The best learning rate against the effective batch B, from a study's trials: at each B the LR each seed did
best at, their geometric mean with a 95% interval over the seeds, and the curve's shape. Li et al. (2024)
find that Adam's best LR rises and then falls with B, peaking near the gradient noise scale; for SGD it only
rises (McCandlish et al. 2018). A shape is named only where the seeds resolve it, and no interval is narrower
than the grid of LRs tried allows: each seed's best is known to half the spacing of the LRs tried around it (the
curve near its best taken as symmetric in log LR), which seeds that agree cannot narrow. A seed whose best is the
lowest (highest) LR tried at a B leaves every interval through that B open on the side the true best beyond it
would move: a step, or the slope, is not resolved where a best beyond the grid could undo it.

    python -m batchsweep.analysis.best_lr STUDY [STUDY ...] [--tracking-uri URI] [--figure best_lr.png] [--by-epoch]

For a report: best_lr_against_b(trials, metric, direction), its sentence(), table() and figure().
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from .measures import WORSE  # (a trial that ended so was tried and did worse than any that finished)
from .wording import listed

RESAMPLES = 2000  # bootstrap resamples of the seeds
ALSO_SCALED = ("beta1", "beta2", "eps", "decay", "bn_momentum")  # what an LR rule may move besides the LR
STILL = 1e-9  # a spread of log best LR over B below this is one LR at every B (float noise of equal LRs)
PEAKS = np.linspace(-4.0, 4.0, 801)  # candidate log2(peak / geometric middle of the Bs): 16x beyond either end
# The LR rules as exponents of B: (exponent, its name, its reading).
RULES = ((0.0, "LR unchanged", "no scaling"), (0.5, "square root", "square-root scaling"),
         (1.0, "linear", "linear scaling"))
# A rule is read only where the slope's interval lies within NEAR of its exponent: halfway to the neighbouring
# rules', so the interval holds it and leaves the others out by that margin (an interval that holds 1 but reaches
# 2.12 is not read as linear: a best LR that moves as B^1.5 holds 1 too).
NEAR = 0.25
# What a slope's bound is compared with in words (a direction, a rule, a rule's margin): shown() never rounds onto
# or across one of them.
MARKS = tuple(sorted({e + d for e, _, _ in RULES for d in (-NEAR, 0.0, NEAR)}))
ON = 1e-9  # a bound within this of a mark is that mark: shown() prints it so and rule_reading() compares it so


@dataclass(frozen=True)
class BestAt:
    """The best LR at one B: the geometric mean over the seeds of each seed's best, and its 95% t-interval (never
    narrower than the grid's rounding, `grid`; 0 below or inf above where a seed's best is that edge of the grid)."""

    batch: int
    lr: float
    low: float
    high: float
    seeds: tuple[float, ...]  # each seed's best LR, in seed order
    at_edge: int  # seeds whose best was the lowest or highest LR they tried: the true best may lie beyond
    at_top: int  # of those, the seeds whose best was the highest
    grid: float  # half the log spacing of the LRs tried around the seeds' bests (the widest of the seeds)


@dataclass(frozen=True)
class BestLR:
    metric: str
    direction: str
    points: tuple[BestAt, ...]  # by B
    peak: float  # Li et al.'s fitted peak B (NaN: fewer than 3 Bs); named where the shape turns
    peak_low: float  # its 95% bootstrap interval over the seeds
    peak_high: float
    slope: float  # of log best LR against log B, a line through every B; its 95% t-interval over the seeds
    slope_low: float
    slope_high: float
    # (B, next B, the seeds' mean of log(best there / best here) and its 95% interval, -inf or inf on a side a best at
    # the edge of the LRs tried leaves open)
    steps: tuple[tuple[int, int, float, float, float], ...]
    noise_scale: float  # median over the best trials that measured it (NaN: none did)
    noise_range: tuple[float, float]
    noise_trials: int
    shape: str  # "rises then falls" | "only rises" | "only falls" | "did not move" | "not resolved" (see _shape)
    # (the slope's interval is -inf or inf on a side a seed's best at the edge of the LRs tried leaves open)
    # | "beyond the LRs tried" (every seed's best the same end of the LRs tried at every B: no slope is read)
    ends: tuple[float, float]  # the lowest and highest base LR tried (the study's setting; the LR where none)

    def sentence(self) -> str:
        """What the seeds resolve, in one paragraph."""
        n = min(len(p.seeds) for p in self.points)
        lo, hi = self.points[0].batch, self.points[-1].batch
        if self.shape == "beyond the LRs tried":
            top = self.points[0].at_top > 0
            end = self.ends[1] if top else self.ends[0]
            text = (f"At every B from {lo} to {hi} every seed's best LR was the {'highest' if top else 'lowest'} LR "
                    f"tried, so whether the best LR moves with B is not known: widen the LR grid: "
                    f"{'raise the highest' if top else 'lower the lowest'} base_lr tried ({end:.3g}; a study file's "
                    f"[tune.base_lr] {'high' if top else 'low'}, or its [grid] base_lr values) and run the study "
                    f"again.")
        elif n < 2:
            text = (f"With one seed no shape of the best LR against B can be told from seed noise (slope "
                    f"{_two(self.slope)} in log-log between B = {lo} and {hi}).")
        elif self.shape == "did not move":
            text = (f"The best LR tried did not move with B from {lo} to {hi}: each seed's best LR was the same at "
                    f"every B (slope 0; each best is known to half the spacing of the LRs tried around it, so the "
                    f"slope's 95% interval is {shown(self.slope_low)} to {shown(self.slope_high)}).")
        elif self.slope == 0 and all(np.allclose(p.seeds, self.points[0].seeds) for p in self.points):
            side = ("on either side" if math.isinf(self.slope_low) and math.isinf(self.slope_high)
                    else "above" if math.isinf(self.slope_high) else "below")
            text = (f"Each seed's best of the LRs tried was the same at every B from {lo} to {hi}, but with a best at "
                    f"the edge of the LRs tried the slope's 95% interval is not bounded {side}: whether the best LR "
                    f"moves with B is not resolved.")
        elif self.shape == "rises then falls":
            spread = (f"95% bootstrap interval over {n} seeds {self.peak_low:.0f} to {self.peak_high:.0f}"
                      if n >= 5 else f"resampling {n} seeds moves it from {self.peak_low:.0f} to "
                      f"{self.peak_high:.0f}, too few seeds for an interval")
            text = (f"The best LR rises and then falls with B: Li et al.'s curve peaks at B ≈ {self.peak:.0f} "
                    f"({spread}).")
        elif self.shape == "only rises":
            text = (f"The best LR only rises with B from {lo} to {hi} (slope {_two(self.slope)} in log-log, "
                    f"{_span(self.slope_low, self.slope_high)}; no fall between neighbouring Bs is resolved): no peak "
                    f"in the range.")
        elif self.shape == "only falls":
            text = (f"The best LR only falls with B from {lo} to {hi} (slope {_two(self.slope)}, "
                    f"{_span(self.slope_low, self.slope_high)}): no peak in the range; a peak, if any, lies below B = "
                    f"{lo}.")
        elif self.slope_low > 0 or self.slope_high < 0:
            rises = self.slope_low > 0
            against = [f"{a} to {b}" for a, b, mean, low, high in self.steps
                       if (mean < 0 if rises else mean > 0) and low <= 0 <= high]
            text = (f"The best LR {'rises' if rises else 'falls'} with B from {lo} to {hi} overall (slope "
                    f"{_two(self.slope)} in log-log, {_span(self.slope_low, self.slope_high)})"
                    + (f", but its mean {'falls' if rises else 'rises'} from B = {', '.join(against)}, which {n} "
                       f"seeds do not resolve: whether it has a peak in the range is not resolved."
                       if against else f", but not at every step; no peak is resolved with {n} seeds."))
        else:
            text = (f"No peak is resolved between B = {lo} and {hi} with {n} seeds, nor a direction (slope "
                    f"{_two(self.slope)}, {_span(self.slope_low, self.slope_high)}).")
        return text + self._beside()

    def _beside(self) -> str:
        """What the sentence adds after the shape: the falls resolved, the edges of the LRs tried, the noise scale."""
        text = ""
        falls = [f"{a} to {b}" for a, b, _, _, high in self.steps if high < 0]
        if falls and self.shape not in ("only falls", "beyond the LRs tried"):
            text += f" It falls, beyond the seeds' spread and the LR grid's spacing, from B = {', '.join(falls)}."
        edges = [p.batch for p in self.points if p.at_edge]
        if edges and self.shape != "beyond the LRs tried":
            text += (f" At B = {', '.join(map(str, edges))} some seed's best LR is the edge of the LRs tried: "
                     f"the true best may lie beyond it, so no move it could undo is read as resolved.")
        if math.isnan(self.noise_scale):
            return text + " No trial measured the noise scale (it needs accum_steps >= 2)."
        text += (f" The gradient noise scale measured by the best trials is {self.noise_scale:.0f} (median of "
                 f"{self.noise_trials}, range {self.noise_range[0]:.0f} to {self.noise_range[1]:.0f})")
        if self.shape == "rises then falls":
            return text + f": the peak is {self.peak / self.noise_scale:.1f} times it."
        return text + "."


def over_training(trials: pd.DataFrame, history: pd.DataFrame, metric: str, direction: str,
                  seed: int = 0) -> list[tuple[int, BestLR]]:
    """The best LR against B after each whole epoch of the search (Li et al. find Adam's peak moving to larger B as
    training goes on): best_lr_against_b on each epoch's value of each trial, from the history. A trial counts
    at an epoch with its value there; one without that ended diverged or pruned counts as worse. Empty where
    fewer than 2 epochs can be read."""
    if history is None or history.empty or not {"run_id", "epoch", metric} <= set(history) or "run_id" not in trials:
        return []
    rows = history.dropna(subset=[metric])
    rows = rows[rows["epoch"] % 1 == 0]
    reason = trials["reason"] if "reason" in trials else pd.Series(None, index=trials.index, dtype=object)
    out = []
    for epoch in sorted(rows["epoch"].unique()):
        now = rows[rows["epoch"] == epoch].set_index("run_id")
        value = trials["run_id"].map(now[metric])
        seen = value.notna()
        at = trials.assign(**{metric: value, "status": np.where(seen, "FINISHED", "FAILED"),
                              "reason": reason.where(~seen, None)})
        if "noise_scale" in now:  # the noise scale of that epoch, not the run's last
            at["noise_scale"] = trials["run_id"].map(now["noise_scale"])
        try:
            out.append((int(epoch), best_lr_against_b(at, metric, direction, seed)))
        except ValueError:  # (too few Bs or seeds there)
            continue
    return out if len(out) >= 2 else []


def moved(epochs: list[tuple[int, BestLR]]) -> str:
    """Where the best LR peaked after each epoch, and whether the seeds resolve a move."""
    if not epochs:
        return ""
    n = min(len(p.seeds) for _, r in epochs for p in r.points)
    each = "; ".join(f"after epoch {e}, " + ", ".join(f"{p.lr:.3g} at B = {p.batch}" for p in r.points)
                     for e, r in epochs)
    top = ", ".join(f"{max(r.points, key=lambda p: p.lr).batch} after epoch {e}" for e, r in epochs)
    text = (f"Over training (Li et al. find Adam's peak moving to larger B as training goes on), each B's best LR "
            f"{each}; the highest at B = {top}.")
    turned = [(e, r) for e, r in epochs if r.shape == "rises then falls"]
    if len(turned) < len(epochs):
        flat = [str(e) for e, r in epochs if r.shape != "rises then falls"]
        return text + (f" A rise and fall is not resolved after epoch {', '.join(flat)} with {n} seed"
                       f"{'s' * (n != 1)}: whether the peak moves is not resolved.")
    peaks = "; ".join(f"≈{r.peak:.0f} after epoch {e} (resampling the seeds: {r.peak_low:.0f} to {r.peak_high:.0f})"
                      for e, r in turned)
    apart = all(a.peak_high < b.peak_low or b.peak_high < a.peak_low for (_, a), (_, b) in zip(turned, turned[1:]))
    if n >= 5 and apart:
        return text + f" Li et al.'s peak: {peaks}; it moved beyond the seeds' spread."
    return text + (f" Li et al.'s peak: {peaks}; " + ("too few seeds to tell a move from their spread."
                                                       if n < 5 else "the resampled ranges overlap: no move is "
                                                       "resolved."))


def _two(x: float) -> str:
    """Two decimals, never "-0.00" (+ 0.0 turns a rounded -0.0 into 0.0)."""
    return f"{round(x, 2) + 0.0:.2f}"


def shown(x: float, marks: tuple[float, ...] = MARKS) -> str:
    """A bound of the slope's interval: two decimals, more where two would show it on or across a value the words
    compare it with (0.0032 reads 0.003, not 0.00 beside 'it excludes 0'); within ON of a mark it is that mark."""
    for places in range(2, 10):
        if all(_side(round(x, places), m) == _side(x, m) for m in marks):
            break
    return f"{round(x, places) + 0.0:.{places}f}"


def _side(v: float, mark: float) -> int:
    """1 above `mark`, -1 below, 0 within ON of it (where shown() prints it as the mark)."""
    return 0 if abs(v - mark) < ON else 1 if v > mark else -1


def rule_reading(low: float, high: float) -> str:
    """Which LR rule the slope's 95% interval (low, high) reads as: one only where the interval lies within NEAR of
    its exponent; otherwise the rules it is consistent with (those it holds), and each B's best LR to use. Its ends
    are compared as shown() prints them."""
    if math.isnan(low) or math.isnan(high):
        return "No LR rule can be read: the slope has no interval over the seeds; use each B's best LR"
    exponents = listed([f"{e:g} ({name})" for e, name, _ in RULES])
    held = [(e, reading) for e, _, reading in RULES if _side(low, e) <= 0 <= _side(high, e)]
    near = [(e, reading) for e, reading in held if _side(low, e - NEAR) >= 0 and _side(high, e + NEAR) <= 0]
    if near:
        (e, reading), = near
        return (f"It reads as {reading}: of the exponents {exponents}, the interval holds {e:g} and lies within "
                f"{NEAR:g} of it (halfway to the neighbouring exponents)")
    if not held:
        return (f"It is consistent with no rule: the interval holds none of the exponents {exponents}, and "
                f"{_lies(low, high)}; use each B's best LR")
    return (f"It is consistent with {listed([r for _, r in held])} (the interval holds "
            f"{listed([f'{e:g}' for e, _ in held])}), but does not lie within {NEAR:g} of one exponent (halfway to the "
            f"neighbouring ones), so no rule is read from it: use each B's best LR")


def _lies(low: float, high: float) -> str:
    """Where an interval that holds no rule's exponent lies among them."""
    span = f"{shown(low)} to {shown(high)}"
    below = [(e, name) for e, name, _ in RULES if _side(high, e) < 0]
    above = [(e, name) for e, name, _ in RULES if _side(low, e) > 0]
    if not above:
        return f"lies below {below[0][0]:g} (the best LR falls as B grows: {span} excludes {below[0][0]:g})"
    if not below:
        return f"lies above {above[-1][0]:g} (steeper than {above[-1][1]}: {span} excludes {above[-1][0]:g})"
    (a, under), (b, over) = above[-1], below[0]
    under, over = (n.replace("square root", "the square root") for n in (under, over))
    return f"lies between {a:g} and {b:g} (between {under} and {over}: {span} excludes both)"


def _span(low: float, high: float) -> str:
    """The slope's 95% interval in words, a side left open by a best at the edge of the LRs tried said so."""
    if math.isinf(low) and math.isinf(high):
        return "95% interval not bounded on either side: a seed's best sat at the edge of the LRs tried"
    if math.isinf(high):
        return f"95% interval {shown(low)} or more, not bounded above: a seed's best sat at the edge of the LRs tried"
    if math.isinf(low):
        return f"95% interval {shown(high)} or less, not bounded below: a seed's best sat at the edge of the LRs tried"
    return f"95% interval {shown(low)} to {shown(high)}"


def best_lr_against_b(trials: pd.DataFrame, metric: str, direction: str, seed: int = 0) -> BestLR:
    """From one row per trial (effective_batch, lr, seed, the metric; status FINISHED counts): at each B each
    seed's best LR, refined by a parabola in log LR through its neighbours, then the shape over B."""
    if metric not in trials:
        raise ValueError(f"no trial has {metric}: nothing to find a best LR from")
    sign = 1.0 if direction == "maximize" else -1.0
    index = trials.index
    reason = trials["reason"] if "reason" in trials else pd.Series(None, index=index, dtype=object)
    status = trials["status"] if "status" in trials else pd.Series("FINISHED", index=index)
    value = (sign * pd.to_numeric(trials[metric], errors="coerce")).where(~reason.isin(WORSE), -np.inf)
    kept = (reason.isin(WORSE) | ((status == "FINISHED") & np.isfinite(value))) & trials["lr"].notna()
    done = trials[kept & trials["effective_batch"].notna()].assign(_value=value)
    if not np.isfinite(done["_value"]).any():
        raise ValueError(f"no finished trial has {metric}: nothing to find a best LR from")
    best = {}  # (B, seed) -> (log best LR, at the edge, the best trial's index, at the top, half the spacing)
    for (batch, s), group in done.groupby(["effective_batch", "seed"]):
        other = [c for c in ALSO_SCALED if c in group and group[c].nunique() > 1]
        if other:
            raise ValueError(f"at B = {int(batch)} the trials differ in more than the LR ({', '.join(other)}): the "
                             f"best LR against B needs trials that differ only in the LR at each B (a study such "
                             f"as lr_search or adam_lr_search)")
        if np.isfinite(group["_value"]).any():  # (a seed whose every LR diverged has no best)
            best[int(batch), int(s)] = _best_of(group.sort_values("lr"))
    batches = sorted({b for b, _ in best})
    seeds = sorted({s for _, s in best if all((b, s) in best for b in batches)})
    if len(seeds) < 1 or len(batches) < 2:
        raise ValueError("the best LR against B needs at least 2 effective batches with the same seeds")
    logs = np.array([[best[b, s][0] for s in seeds] for b in batches])  # (B, seed)
    centre, x = logs.mean(axis=1), np.log(np.array(batches, dtype=float))
    grid = np.array([max(best[b, s][4] for s in seeds) for b in batches])  # (B,)
    # A seed's best at the lowest (highest) LR tried: the true best may lie anywhere below (above) it.
    bottom = np.array([any(best[b, s][1] and not best[b, s][3] for s in seeds) for b in batches])
    up = np.array([any(best[b, s][3] for s in seeds) for b in batches])
    points = tuple(BestAt(b, math.exp(c), *np.exp(_open(_interval(row, g), below, above)), tuple(np.exp(row)),
                          sum(best[b, s][1] for s in seeds), sum(best[b, s][3] for s in seeds), g)
                   for b, c, row, g, below, above in zip(batches, centre, logs, grid, bottom, up))
    peak, peak_low, peak_high = _peak_with_interval(x, logs, seed)
    # Each seed's best the same at every B: a slope of exactly 0, not polyfit's rounding (-1e-16 read as a fall).
    still = bool(np.ptp(logs, axis=0).max() < STILL)
    slope_low, slope_high = _slope_interval(x, logs, grid, still, bottom, up)
    steps = tuple((a, b, *_change(logs, grid, bottom, up, i, i + 1))
                  for i, (a, b) in enumerate(zip(batches, batches[1:])))
    top = int(np.argmax(centre))  # a turn: the best LR at an inside B resolved above both ends', seed by seed
    turned = 0 < top < len(batches) - 1 and all(_change(logs, grid, bottom, up, end, top)[1] > 0
                                                 for end in (0, len(batches) - 1))
    noise = _noise(done, [best[b, s][2] for b in batches for s in seeds])
    slope = 0.0 if still else float(np.polyfit(x, centre, 1)[0])
    # Every seed's best the top (or every one the bottom) of the LRs tried at every B: the true bests lie beyond,
    # anywhere, so no slope between them is read.
    n = len(seeds)
    beyond = all(p.at_top == n for p in points) or all(p.at_edge - p.at_top == n for p in points)
    bounded = math.isfinite(slope_low) and math.isfinite(slope_high)
    shape = ("beyond the LRs tried" if beyond else "did not move" if still and bounded
             else _shape(turned, slope_low, slope_high, steps))
    axis = "base_lr" if "base_lr" in done and done["base_lr"].notna().all() else "lr"
    ends = (float(done[axis].min()), float(done[axis].max()))
    return BestLR(metric, direction, points, peak, peak_low, peak_high, slope, slope_low, slope_high, steps,
                  *noise, shape, ends)


def _interval(values: np.ndarray, grid: float = 0.0) -> tuple[float, float]:
    """The 95% t-interval of the mean over the seeds (NaN with one seed), never narrower than ±grid, the most the
    LR grid's rounding can move that mean: seeds that round to the same LRs share that error, so their spread
    does not show it (where they disagree by more, the rounding is in their spread). With 3 seeds a bootstrap
    would call any three that agree in sign resolved, which chance does one time in four."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan
    half = max(stats.t.ppf(0.975, n - 1) * np.std(values, ddof=1) / math.sqrt(n), grid)
    return float(np.mean(values) - half), float(np.mean(values) + half)


def _change(logs: np.ndarray, grid: np.ndarray, bottom: np.ndarray, up: np.ndarray, i: int, j: int
            ) -> tuple[float, float, float]:
    """log(best at the j-th B / best at the i-th), `logs` by (B, seed): the seeds' mean and its interval, open on a
    side a best beyond the grid at either B (`bottom`, `up`: some seed's best the lowest, the highest LR tried)
    could move it to."""
    d = logs[j] - logs[i]
    return float(d.mean()), *_open(_interval(d, grid[i] + grid[j]), up[i] or bottom[j], bottom[i] or up[j])


def _slope_interval(x: np.ndarray, logs: np.ndarray, grid: np.ndarray, still: bool, bottom: np.ndarray,
                    up: np.ndarray) -> tuple[float, float]:
    """The 95% interval of the slope of log best LR against log B (x) over the seeds' own slopes, never narrower
    than the most rounding each B's best to its grid (up to grid[i] in log) can move a least-squares slope, and
    open on a side a best beyond the grid at a B of nonzero weight could pull it without bound."""
    weights = (x - x.mean()) / ((x - x.mean()) ** 2).sum()
    slopes = np.zeros(logs.shape[1]) if still else np.polyfit(x, logs, 1)[0]  # each seed's slope
    lean = np.where(np.abs(weights) > 1e-9 * np.abs(weights).max(), np.sign(weights), 0)
    return _open(_interval(slopes, float(np.abs(weights) @ grid)), bool(np.any(up & (lean < 0) | bottom & (lean > 0))),
                 bool(np.any(up & (lean > 0) | bottom & (lean < 0))))


def _open(interval: tuple[float, float], below: bool, above: bool) -> tuple[float, float]:
    """The interval with its lower (upper) end at -inf (inf) where a best beyond the LRs tried could move it there."""
    low, high = interval
    return (-math.inf if below and not math.isnan(low) else low), (math.inf if above and not math.isnan(high) else high)


def _peak_with_interval(x: np.ndarray, logs: np.ndarray, seed: int) -> tuple[float, float, float]:
    """Li et al.'s peak fitted to the seeds' mean, and its 95% interval by a bootstrap over the seeds (with 3
    seeds, 10 distinct resamples: a rough interval)."""
    if len(x) < 3:
        return math.nan, math.nan, math.nan
    picks = np.random.default_rng(seed).integers(0, logs.shape[1], size=(RESAMPLES, logs.shape[1]))
    peaks = [_peak(x, m) for m in logs[:, picks].mean(axis=2).T]
    low, high = np.percentile(peaks, [2.5, 97.5])
    return _peak(x, logs.mean(axis=1)), float(low), float(high)


def _shape(turned: bool, slope_low: float, slope_high: float, steps: tuple) -> str:
    """A turn where the best LR at an inside B is resolved above both ends'; otherwise a direction where the
    slope's interval excludes 0 and no step's mean goes against it (a fall at the last step, unresolved, may be a
    peak: "only rises" would deny it); otherwise not resolved."""
    if turned:
        return "rises then falls"
    if slope_low > 0 and all(mean >= 0 for _, _, mean, _, _ in steps):
        return "only rises"
    if slope_high < 0 and all(mean <= 0 for _, _, mean, _, _ in steps):
        return "only falls"
    return "not resolved"


def _best_of(group: pd.DataFrame) -> tuple[float, bool, object, bool, float]:
    """The log of the LR one seed did best at, one B's trials sorted by LR, whether it is an end of the LRs tried
    and the top one, and half the widest log spacing from it to its neighbours (how far the true best may sit from
    it). Between two neighbours the vertex of the parabola through the three (in log LR) refines it, kept between
    them; at an end it is the end, and the best may lie beyond (unless the next LR was tried and diverged or was
    pruned)."""
    values, logs = group["_value"].to_numpy(), np.log(group["lr"].to_numpy(dtype=float))
    i = int(np.argmax(values))
    tried = np.unique(logs)
    at = int(np.searchsorted(tried, logs[i]))
    spacing = max(np.diff(tried[max(at - 1, 0):at + 2]), default=0.0) / 2
    if 0 < i < len(values) - 1 and np.isfinite(values[i - 1:i + 2]).all():
        a, b, _ = np.polyfit(logs[i - 1:i + 2], values[i - 1:i + 2], 2)
        vertex = -b / (2 * a) if a < 0 else logs[i]
        return float(np.clip(vertex, logs[i - 1], logs[i + 1])), False, group.index[i], False, float(spacing)
    edge = len(values) > 1 and i in (0, len(values) - 1)
    return float(logs[i]), edge, group.index[i], edge and i == len(values) - 1, float(spacing)


def _peak(x: np.ndarray, y: np.ndarray) -> float:
    """Li et al.'s (2024) Adam curve, lr(B) = lr_max / (sqrt(P / B) + sqrt(B / P)) * 2, fitted in log-log by
    least squares over P (lr_max in closed form). A best fit at the candidates' edge means no peak near the Bs:
    it is returned as that edge, far outside them."""
    middle = x.mean()
    p = (middle + PEAKS * math.log(2))[:, None]  # log P candidates
    shape = -np.logaddexp((p - x) / 2, (x - p) / 2)  # log of 1 / (sqrt(P/B) + sqrt(B/P))
    resid = y - shape
    resid -= resid.mean(axis=1, keepdims=True)
    return float(math.exp(p[int(np.argmin((resid ** 2).sum(axis=1))), 0]))


def _noise(done: pd.DataFrame, best_rows: list) -> tuple[float, tuple[float, float], int]:
    if "noise_scale" not in done:
        return math.nan, (math.nan, math.nan), 0
    values = done.loc[best_rows, "noise_scale"].dropna()
    values = values[values > 0]
    if values.empty:
        return math.nan, (math.nan, math.nan), 0
    return float(values.median()), (float(values.min()), float(values.max())), len(values)


def figure(result: BestLR, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw(result: BestLR):
    """Each seed's best LR and their geometric mean with its interval against B (log-log), Li et al.'s fitted
    curve where it peaks in the range, the peak's interval and the measured noise scale."""
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    batches = np.array([p.batch for p in result.points], dtype=float)
    for p in result.points:
        ax.scatter([p.batch] * len(p.seeds), p.seeds, color="0.6", s=12, zorder=2)
    lrs = np.array([p.lr for p in result.points])
    low, high = np.array([p.low for p in result.points]), np.array([p.high for p in result.points])
    ax.errorbar(batches, lrs, yerr=[np.where(low > 0, lrs - low, 0), np.where(np.isfinite(high), high - lrs, 0)],
                fmt="o-", color="C0", capsize=3, label="best LR (geometric mean over seeds, 95% interval)")
    for side, marker in ((low == 0, "v"), (~np.isfinite(high), "^")):  # (an interval a best at an edge leaves open)
        if side.any():
            ax.scatter(batches[side], lrs[side], marker=marker, s=60, color="C3", zorder=3,
                       label=f"interval not bounded {'below' if marker == 'v' else 'above'} (a best at the edge "
                             f"of the LRs tried)")
    if result.shape == "rises then falls":
        grid = np.geomspace(batches[0], batches[-1], 100)
        curve = 1 / (np.sqrt(result.peak / grid) + np.sqrt(grid / result.peak))
        at = 1 / (np.sqrt(result.peak / batches) + np.sqrt(batches / result.peak))
        scale = math.exp(np.mean(np.log(lrs) - np.log(at)))
        ax.plot(grid, scale * curve, color="C1", label=f"Li et al.'s curve, peak B = {result.peak:.0f}")
        ax.axvspan(result.peak_low, result.peak_high, color="C1", alpha=0.15)
    if not math.isnan(result.noise_scale):
        ax.axvline(result.noise_scale, color="C2", ls="--", label=f"noise scale {result.noise_scale:.0f} (median)")
    ax.set(xscale="log", yscale="log", xlabel="effective batch B", ylabel="learning rate",
           title=f"best LR by {result.metric}: {result.shape}")
    ax.set_xticks(batches, [str(int(b)) for b in batches])
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # labels within one decade too
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def table(result: BestLR) -> str:
    rows = ["| B | best LR | 95% interval | each seed's best | at the edge |", "|---|---|---|---|---|"]
    for p in result.points:
        seeds = ", ".join(f"{v:.3g}" for v in p.seeds)
        span = (f"{p.low:.3g} to {p.high:.3g}" if 0 < p.low and p.high < math.inf else "not bounded"
                if p.low == 0 and p.high == math.inf else f"{p.high:.3g} or less" if p.low == 0
                else f"{p.low:.3g} or more")
        rows.append(f"| {p.batch} | {p.lr:.3g} | {span} | {seeds} | {p.at_edge} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchsweep.analysis.best_lr", description=__doc__.split("\n")[0])
    parser.add_argument("study", nargs="+", help="one study, or several whose trials are one search (more LRs)")
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns/mlflow.db")
    parser.add_argument("--figure", default="", help="write the figure here (.png)")
    parser.add_argument("--by-epoch", action="store_true", help="also the best LR against B after each epoch")
    args = parser.parse_args(argv)
    from .runs import AnalysisError, load_studies

    try:
        runs = load_studies(args.study, args.tracking_uri)
        objectives = {r.objectives[0] for r in runs}
        if len(objectives) > 1:
            raise ValueError(f"the studies have different objectives ({', '.join(sorted(map(str, objectives)))}): "
                             f"give studies of one search")
        metric, direction = runs[0].objectives[0]
        trials = pd.concat([r.trials for r in runs], ignore_index=True)
        result = best_lr_against_b(trials, metric, direction)
    except (AnalysisError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(result), result.sentence(), sep="\n\n")
    if args.by_epoch:
        epochs = over_training(trials, pd.concat([r.history for r in runs], ignore_index=True), metric, direction)
        for epoch, at in epochs:
            print(f"\nAfter epoch {epoch}:", table(at), at.sentence(), sep="\n\n")
        print("\n" + (moved(epochs) or "Fewer than 2 epochs of every B's seeds in the history: nothing over training."))
    if args.figure:
        figure(result, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
