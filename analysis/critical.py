"""The critical batch from steps to a target accuracy, as McCandlish et al. (2018) and Shallue et al. (2018)
define it: S = S_min (1 + B_crit / B) fitted to the optimizer steps each run took to reach the target against its
B, beside the gradient noise scale measured at the epoch the target was reached (B_noise, which McCandlish et al.
find close to B_crit). B_crit's interval is a t-interval on log B_crit over each seed's own fit (a bootstrap over 5
seeds covered about 84% where it claimed 95%); one that passes the Bs fitted says B_crit is not bounded there. The
noise scale's interval is a bootstrap over the seeds, said only from FEWEST_SEEDS seeds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats
from scipy.optimize import least_squares

from .wording import listed

BOOTSTRAPS = 1000
# Below this a bootstrap over the seeds has too few distinct resamples (3 seeds: 10) to cover 95%: the noise scale's
# interval is not said (best_lr.py bootstraps from the same number).
FEWEST_SEEDS = 5
FAR = 64  # the fit searches B_crit within this factor of the Bs run; beyond the range it is not bounded anyway


@dataclass
class Fit:
    b_crit: float  # over every run fitted
    s_min: float
    lo: float  # 95% t-interval over the seeds of log B_crit, each seed fitted on its own (NaN: fewer than 2 seeds fit)
    hi: float
    sizes: list[int]  # the Bs the fit used
    runs: int
    seeds: list[float]  # each seed's own B_crit, in seed order (the seeds with 3 Bs or more)
    sides: list[int]  # each seed's own fit: 1 at the search's upper bound, -1 at its lower, 0 within (a bound, no value)
    names: list  # those seeds
    side: int  # the fit over every run, likewise


def fit(sizes, steps) -> tuple[float, float] | None:
    """(B_crit, S_min) by least squares on log steps (the steps span a decade over B: on the steps themselves the
    smallest B would carry the fit alone); None with fewer than 3 Bs."""
    b, s = np.asarray(sizes, float), np.asarray(steps, float)
    if len(np.unique(b)) < 3:
        return None

    def residuals(theta):
        return theta[0] + np.log1p(np.exp(theta[1]) / b) - np.log(s)

    bounds = ([-np.inf, math.log(b.min() / FAR)], [np.inf, math.log(b.max() * FAR)])
    r = least_squares(residuals, [math.log(s.min()), math.log(float(np.median(b)))], bounds=bounds)
    return float(math.exp(r.x[1])), float(math.exp(r.x[0]))


def _resamples(points: pd.DataFrame, statistic) -> list[float]:
    """`statistic` of the points of seeds drawn with replacement, BOOTSTRAPS times (each distinct draw once)."""
    seeds = sorted(points["seed"].unique())
    rng, cache, out = np.random.default_rng(0), {}, []
    for _ in range(BOOTSTRAPS):
        draw = tuple(sorted(rng.choice(seeds, len(seeds))))
        if draw not in cache:
            cache[draw] = statistic(pd.concat([points[points["seed"] == s] for s in draw]))
        if cache[draw] is not None and math.isfinite(cache[draw]):
            out.append(cache[draw])
    return out


def _interval(draws: list[float]) -> tuple[float, float]:
    if len(draws) < BOOTSTRAPS / 2:
        return math.nan, math.nan
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def critical(points: pd.DataFrame) -> Fit | None:
    """The fit over every run that reached the target (columns seed, effective_batch, steps), and the t-interval of
    log B_crit over the seeds' own fits."""
    found = fit(points["effective_batch"], points["steps"])
    if found is None:
        return None
    own = [(s, f[0], _bound(f[0], p["effective_batch"])) for s, p in sorted(points.groupby("seed"))
           if (f := fit(p["effective_batch"], p["steps"]))]
    values, sides = [b for _, b, _ in own], [side for _, _, side in own]
    # (a seed's fit at a bound is no measurement of B_crit: no interval is taken over it)
    lo, hi = _log_t(values) if not any(sides) else (math.nan, math.nan)
    return Fit(*found, lo, hi, sorted(int(b) for b in points["effective_batch"].unique()), len(points), values, sides,
               [s for s, _, _ in own], _bound(found[0], points["effective_batch"]))


def _bound(b_crit: float, sizes) -> int:
    """1 where a fit of B_crit over runs at `sizes` lies at the search's upper bound, -1 at its lower, 0 within."""
    return 1 if b_crit >= max(sizes) * FAR * 0.999 else -1 if b_crit <= min(sizes) / FAR * 1.001 else 0


def _log_t(values: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the geometric mean of `values` (NaN with fewer than 2)."""
    if len(values) < 2:
        return math.nan, math.nan
    logs = np.log(values)
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
    return float(math.exp(logs.mean() - half)), float(math.exp(logs.mean() + half))


def noise_at_target(trials: pd.DataFrame, history: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per run: the reliable noise scale at the end of the first epoch whose validation accuracy reached the
    target (columns run_id, seed, noise); runs without one are left out."""
    if history.empty or not {"noise_scale", "val_acc"} <= set(history):
        return pd.DataFrame(columns=["run_id", "seed", "noise"])
    h = history[history["run_id"].isin(trials["run_id"]) & (history["val_acc"] >= target)]
    first = h.sort_values("epoch").groupby("run_id").first()
    ok = first["noise_scale"].notna()
    if "noise_scale_reliable" in first:
        ok &= first["noise_scale_reliable"].fillna(1.0) > 0
    noise = first.loc[ok, "noise_scale"].rename("noise").reset_index()
    return noise.merge(trials[["run_id", "seed"]], on="run_id")


def _too_few(seeds: int) -> str:
    distinct = math.comb(2 * seeds - 1, seeds)
    return (f"no interval: {seeds} seed{'s' * (seeds != 1)} give{'s' * (seeds == 1)} only {distinct} distinct "
            f"resample{'s' * (distinct != 1)}, too few for a 95% bootstrap interval ({FEWEST_SEEDS} seeds or more)")


def _places(x: float) -> int:
    """Decimals that show two significant digits below 10 (0.21 is no 0 on a log scale), none above."""
    return max(0, 1 - math.floor(math.log10(x))) if x > 0 else 0


def _n(x: float) -> str:
    return f"{x:,.{_places(x)}f}"


def _beside(x: float, marks: list[int]) -> str:
    """An interval's end shown with the decimals that keep it off the Bs fitted's ends it is compared with (256.3
    reads 256.3 beside 'reaches past 256', not 256), and two significant digits at least."""
    first = _places(x)
    places = next((p for p in range(first, first + 4)
                   if all((round(x, p) > m) == (x > m) and (round(x, p) == m) == (x == m) for m in marks)), first + 4)
    return f"{x:,.{places}f}"


def _unresolved(points: pd.DataFrame, sizes: list) -> dict[int, tuple[float, float]]:
    """Per B (against the B before it): the range of its ratio where the steps are known only to within an evaluation
    (column `before`: the steps at the evaluation before the one that reached the target) and that range's ends lie
    twofold or more apart (perfect scaling and none alike): no ratio measured there."""
    if "before" not in points or points["before"].isna().all():
        return {}
    hi = points.groupby("effective_batch")["steps"].median()
    lo = points.groupby("effective_batch")["before"].median()
    spans = {}
    for a, b in zip(sizes, sizes[1:]):
        power = 1 / math.log2(b / a)
        least = (lo[b] / hi[a]) ** power
        most = (hi[b] / lo[a]) ** power if lo[a] > 0 else math.inf
        if least == 0 or most / least >= 2:
            spans[b] = (least, most)
    return spans


def _span(least: float, most: float) -> str:
    return f"{least:.2f} to {'∞' if math.isinf(most) else f'{most:.2f}'}"


def reading(points: pd.DataFrame, noise: pd.DataFrame, lost: dict[int, tuple[int, int, int]] | None = None,
            censored: list[int] = (), diverged: dict[int, tuple[int, int]] | None = None) -> str:
    """One series' steps per doubling, its fitted B_crit, and the noise scale at the target, in words. `lost`: per B
    run but left out of the doublings and the fit as half or more of its runs did not reach the target, (the runs
    that never reached it, those that diverged, all runs); `censored`: the B of each run that never reached it at a B whose other runs did. Those Bs count in the
    doublings (the run as slower than every one that reached it) but not in the fit: the runs there that reached
    it would enter it as if they were all, the slowest taken out. `diverged`: per B where most reached it, (the runs
    that diverged, all runs there), so that the runs that never reached it are counted of the same total."""
    said, sizes, shares, spans = _doublings(points, censored)
    out = sorted(set(censored))
    f = critical(points[~points["effective_batch"].isin(out)])
    ran = points["effective_batch"].nunique()
    if f is None and not lost and ran < 3:  # (not that runs failed: the series ran at fewer Bs than a fit takes)
        said += f"; B_crit could not be fitted (the runs are at {ran} Bs; a fit takes 3)"
    else:
        said += _fitted(f, sizes, shares, spans, lost or {})
    if out:
        runs = points["effective_batch"].value_counts()
        gone = diverged or {}
        each = "; ".join(f"{list(censored).count(b)} of {gone[b][1]} at B = {b}, where {gone[b][0]} other"
                         f"{'s' * (gone[b][0] > 1)} diverged" if b in gone else
                         f"{list(censored).count(b)} of {runs.get(b, 0) + list(censored).count(b)} at B = {b}"
                         for b in out)
        said += (f"; B = {', '.join(map(str, out))} left out of the fit, as some runs there never reached it "
                 f"({each}): the runs there that did would enter it as if complete, the slowest left out")
    if noise.empty:
        return said + "; no reliable noise scale was measured at the epoch the target was reached"
    lo, hi = _interval(_resamples(noise, lambda p: float(p["noise"].median())))
    seeds = noise["seed"].nunique()
    spread = f"; {_too_few(seeds)}" if seeds < FEWEST_SEEDS else "" if math.isnan(lo) else \
        f", 95% bootstrap interval over the seeds {_n(lo)} to {_n(hi)}"
    where = " at the Bs not left out" if lost or out else ""  # (a run that reached it at a B left out: not among them)
    return (said + f"; the gradient noise scale at the epoch the target was reached was {_n(noise['noise'].median())}"
            f" (median of the {len(noise)} runs{where} that measured it there{spread})")


def _doublings(points: pd.DataFrame, censored: list[int]) -> tuple[str, list[int], list[float], dict]:
    """The median steps' share from each B to the next, in words, with the Bs, the shares (the medians' own ratio,
    never a per-doubling rate raised back to a rounded exponent) and the unresolved spans."""
    # A censored run took more steps than its B's runs last, so more than every run there that reached it: in the
    # medians it counts as slower than all of them (fewer than half of a fitted B's runs are censored, so each
    # median is the true one; leaving them out would bias it low).
    beyond = pd.DataFrame({"effective_batch": list(censored), "steps": math.inf, "before": math.inf})
    every = pd.concat([points, beyond]) if censored else points
    medians = every.groupby("effective_batch")["steps"].median().sort_index()
    sizes = list(medians.index)
    shares = [medians.iloc[i] / medians.iloc[i - 1] for i in range(1, len(sizes))]
    spans = _unresolved(every if "before" in points and points["before"].notna().any() else points, sizes)
    slow = (f" (a run that never reached it counted as slower than every run that did: {len(censored)} "
            f"run{'s' * (len(censored) > 1)} at B = {', '.join(map(str, sorted(set(censored))))})" if censored else "")
    if not shares:
        return f"only B = {sizes[0]} reached it", sizes, shares, spans
    pairs = list(zip(sizes, sizes[1:], shares))
    if not spans and all(_doubled(a, b) == 1 for a, b, _ in pairs):
        return (f"each doubling of B took the median steps to {', '.join(f'{r:.2f}' for r in shares)} of the B "
                f"before{slow}"), sizes, shares, spans
    if not spans:  # (Bs more than a doubling apart: the share over them, and the share a doubling it makes)
        each = [f"from B = {a} to {b} ({_times(a, b)}) the median steps went to {r:.2f} of B = {a}'s"
                + (f" ({_rate(r, a, b):.2f} a doubling)" if _doubled(a, b) != 1 else "") for a, b, r in pairs]
        return "; ".join(each) + slow, sizes, shares, spans
    # (a ratio the evaluations cannot resolve is its range, never a number first)
    each = [f"not resolved at B = {b} ({_span(*spans[b])}" + (f"; a doubling's share from B = {a}, {_times(a, b)})"
                                                          if _doubled(a, b) != 1 else ")")
            if b in spans else f"{_rate(r, a, b):.2f} at B = {b}" + (f" (a doubling's share from B = {a}, "
                                                                    f"{_times(a, b)}: {r:.2f} over them)"
                                                                    if _doubled(a, b) != 1 else "")
            for a, b, r in pairs]
    return (f"each doubling of B took the median steps to this share of the B before's: {'; '.join(each)} (a "
            f"ratio is not resolved at this evaluation's granularity where the steps, known only to within an "
            f"evaluation, leave a range whose ends lie twofold or more apart){slow}"), sizes, shares, spans


def _rate(share: float, a: float, b: float) -> float:
    """The share a doubling that compounds to `share` from B = a to b."""
    return share ** (1 / math.log2(b / a))


def _doubled(a: float, b: float) -> float:
    """How many doublings take B = a to b (2 from 32 to 128; 1.58 from 32 to 96), rounded to two decimals."""
    return round(math.log2(b / a), 2)


def _times(a: float, b: float) -> str:
    n = _doubled(a, b)
    words = {1: "one doubling", 2: "two doublings", 3: "three doublings", 4: "four doublings"}
    return words.get(n, f"{n:g} doublings")


def _fitted(f: Fit | None, sizes: list[int], shares: list[float], spans: dict,
            lost: dict[int, tuple[int, int]]) -> str:
    """What the fit of S = S_min (1 + B_crit / B) says: B_crit with the t-interval of the seeds' own fits, or the
    side of the Bs fitted that interval passes, where it bounds nothing."""
    if f is None:
        return "; B_crit could not be fitted (fewer than 3 Bs where every run reached the target)"
    n, fitted = len(f.seeds), f"from {f.runs} runs at B = {f.sizes[0]} to {f.sizes[-1]}"
    if any(f.sides):
        return _at_bound(f, fitted) + _beyond(f, sizes, shares, spans, lost, 1 in f.sides)
    if n < 2 or np.ptp(np.log(f.seeds)) < 1e-9:  # (seeds whose steps agree: their spread is no measure of B_crit's)
        lo = hi = f.b_crit if n < 2 else f.seeds[0]
        at = _n(lo)
        if n < 2 and f.side:  # (a fit at the search's bound: beyond it, not a value)
            lo = hi = math.inf if f.side > 0 else 0.0
            at = f"a B_crit at the search's bound, so not bounded {'above' if f.side > 0 else 'below'}"
        own = (f"{'no seed' if n == 0 else 'only 1 seed'} reached the target at 3 Bs or more to be fitted on its "
               f"own, so there is no spread over seeds; the fit over every run gave {at}" if n < 2 else
               f"each of the {n} seeds' own fits gave {at}, so their spread measures nothing")
    else:
        lo, hi = f.lo, f.hi
        own = (f"each seed's own fit {', '.join(_n(b) for b in f.seeds)}, 95% t-interval over the {n} seeds (on log "
               f"B_crit) {_beside(lo, f.sizes)} to {_beside(hi, f.sizes)}")
    above, below = hi > max(f.sizes), lo < min(f.sizes)
    if not above and not below:
        if lo == hi:
            return f"; B_crit has no interval: {own} (a point estimate only; {fitted})"
        return f"; B_crit ≈ {_n(math.sqrt(lo * hi))} ({own}; S_min ≈ {_n(f.s_min)} steps over every run; {fitted})"
    side = "on either side" if above and below else "above" if above else "below"
    past = listed([f"the {w} B fitted ({b})" for w, b, on in (("smallest", min(f.sizes), below),
                                                                ("largest", max(f.sizes), above)) if on])
    lies = "the fit lies" if lo == hi else "its interval reaches"
    said = f"; B_crit is not bounded {side} by the Bs fitted: {lies} past {past} ({own}; {fitted})"
    return said + _beyond(f, sizes, shares, spans, lost, above)


def _at_bound(f: Fit, fitted: str) -> str:
    """B_crit where a seed's own fit lies at the search's bound: that seed's fit is not bounded there, so neither is
    B_crit, and no interval is taken over it."""
    words = {1: ("above", f"past {FAR} times the largest B it ran"), -1: ("below", f"below the smallest B it ran / {FAR}")}
    why = []
    for at, (word, where) in words.items():
        names = [str(s) for s, side in zip(f.names, f.sides) if side == at]
        if names:
            many = len(names) > 1
            why.append(f"seed{'s' * many} {listed(names)}'s own fit{'s lie' if many else ' lies'} at the search's "
                       f"bound (B_crit {where}), so {'they are' if many else 'it is'} not bounded {word}")
    side = "on either side" if len(why) == 2 else "above" if 1 in f.sides else "below"
    each = ", ".join(f"not bounded {words[at][0]}" if at else _n(b) for b, at in zip(f.seeds, f.sides))
    each = f"each seed's own fit {each}; " if not all(f.sides) else ""
    return f"; B_crit is not bounded {side}: {'; '.join(why)}, and neither is B_crit ({each}{fitted})"


def _beyond(f: Fit, sizes: list[int], shares: list[float], spans: dict, lost: dict[int, tuple[int, int]],
            above: bool) -> str:
    """Where B_crit is not bounded above: the last doubling's share of the steps, and the runs beyond the Bs fitted
    that never reached the target."""
    if not above:
        return ""
    scale = "0.50 is perfect scaling, 1 none"
    # (a B counted in the doublings but left out of the fit: its doubling is named, not taken for the fit's last)
    a, b = sizes[-2], sizes[-1]
    outside = b > max(f.sizes)
    last = f" (from {a} to {b}, outside the fit)" if outside else ""
    said = (f": the last doubling's share of the steps of the B before{last} is not resolved "
            f"({_span(*spans[b])}; {scale})" if b in spans else
            f": the last doubling{last} took the steps to {shares[-1]:.2f} of the B before ({scale})")
    if _doubled(a, b) != 1:  # (the last two Bs lie more than a doubling apart: the share a doubling between them)
        between = f"from B = {a} to {b} ({_times(a, b)}{', outside the fit' if outside else ''})"
        said = (f": the share of the steps a doubling {between} is not resolved ({_span(*spans[b])}; {scale})"
                if b in spans else f": {between} the steps went to {shares[-1]:.2f} of B = "
                f"{a}'s ({_rate(shares[-1], a, b):.2f} a doubling; {scale})")
    past = [(b, never, diverged, runs) for b, (never, diverged, runs) in sorted(lost.items()) if b > max(f.sizes)]
    beyond = [f"{never} of {runs} at B = {b}" for b, never, _, runs in past if never]
    if beyond:  # (right-censored: their steps to the target exceed the runs' length, which no fit here counts)
        said += (f"; runs beyond it never reached the target in their epochs ({', '.join(beyond)}), which "
                 f"argues against a B_crit far above {max(f.sizes)} (those runs are censored, not fitted)")
    diverged = [f"{d} of {runs} at B = {b}" for b, _, d, runs in past if d]
    if diverged:  # (a run that diverged took no steps to the target at all: no bound on B_crit either way)
        said += f"; runs beyond it that diverged ({', '.join(diverged)}) say nothing of B_crit"
    return said
