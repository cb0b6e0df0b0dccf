"""The fields a study varied as independent choices, and the best configuration over them with the set that
cannot be told from it: what the importance, the Pareto fronts, the trials table's mark and the recommendation
read.

A field is a choice when the study ran it against every value of the other choices. Fields tied in the design
(one grid axis "a+b", a branch's B and its length) are left out: a forest would split their joint effect
among them by guessing the missing cells, and a "best" among them compares runs that differ in how long they
trained. Physical batch and accumulation steps tied only by B (accumulated points and their true-batch twins)
count as effective_batch where variance is split, and stay apart where a configuration is named (its memory
is its b's).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .measures import WORSE, Measure, rounded, stopped
from .rules import rule_comparisons
from .runs import StudyRuns, ci95, paired, quantum
from .verdicts import judge

SHORT = {"physical_batch": "b", "accum_steps": "k"}
LENGTHS = ("batch_warmup", "epochs")  # how long (and at which B) a run trained: not a choice compared at one budget
CONTINUOUS = 12  # a numeric field with more values than this was searched, not gridded: no cells to cross
EVERY_RULE = "every LR rule (B = base_batch)"
EVERY_BN = "every BN momentum rule (k = 1)"  # at k = 1 every BN rule is the default momentum: one configuration


def shown_value(value) -> str:
    """A field's value as a label shows it: 0.05, 32, sqrt."""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3g}"
    return str(int(value)) if isinstance(value, (int, float, np.integer)) and not isinstance(value, bool) else str(value)


def _warmup(value: str) -> str:
    """A batch warmup's B per epoch, a repeated B once with its epochs: a critical-batch branch's eight epochs
    at the reference's B are '32 for 8 epochs'."""
    sizes = value.split(",")
    return f"{sizes[0]} for {len(sizes)} epochs" if len(sizes) > 1 and len(set(sizes)) == 1 else ", ".join(sizes)


def label(row: pd.Series | dict, fields: list[str]) -> str:
    """A configuration as people say it: 'b = 64, k = 8, sqrt'."""
    parts = []
    for f in fields:
        v = row[f]
        if f == "batch_warmup":
            parts.append(f"warmup B = {_warmup(v)}" if isinstance(v, str) and v else "fixed B")
        elif f in SHORT:
            parts.append(f"{SHORT[f]} = {shown_value(v)}")
        elif f in ("lr_rule", "bn_momentum_rule"):
            parts.append(str(v) if f == "lr_rule" or v == EVERY_BN else f"BN {v}")
        else:
            parts.append(f"{f} = {shown_value(v)}")
    return ", ".join(parts)


def _crossed(t: pd.DataFrame, a: str, b: str) -> bool:
    return len(t[[a, b]].drop_duplicates()) == t[a].nunique() * t[b].nunique()


def _gridded(column: pd.Series) -> bool:
    return not (pd.api.types.is_numeric_dtype(column) and column.nunique() > CONTINUOUS)


def choices(study: StudyRuns, t: pd.DataFrame, merge_batch: bool = True) -> tuple[list[str], str]:
    """The varied fields that are independent choices, and what a sentence says of the others."""
    fields = [f for f in study.varied if f in t and t[f].nunique() > 1]
    note = ""
    batch = {"physical_batch", "accum_steps"} <= set(fields) and "effective_batch" in t
    if batch and not _crossed(t, "physical_batch", "accum_steps"):
        cells = len(t[["physical_batch", "accum_steps"]].drop_duplicates())
        every = t["physical_batch"].nunique() * t["accum_steps"].nunique()
        if merge_batch:
            fields = ["effective_batch", *(f for f in fields if f not in ("physical_batch", "accum_steps",
                                                                          "effective_batch"))]
            note = (f"; b and k ran in {cells} of their {every} combinations, moving with B, so they count as "
                    f"effective_batch; accumulated against true batch is the twins' sentence")
    free = {"physical_batch", "accum_steps"} if batch and not merge_batch else set()
    tied = {f for a in fields for f in fields if a != f and {a, f} - free and _gridded(t[a]) and _gridded(t[f])
            and not _crossed(t, a, f)}
    tied |= {f for f in fields if f in LENGTHS}
    if tied:
        note += (f"; {', '.join(sorted(tied))} left out: not run against every value of the other fields (tied in the "
                 f"design) or a length of training, not a choice compared at one budget")
    return [f for f in fields if f not in tied], note


def naming(study: StudyRuns, t: pd.DataFrame) -> list[str]:
    """The fields that name a configuration where one is ranked (the best, a Pareto front): the choices, b and k
    kept apart; none where a varied field was left out as tied (unnamed()), since a configuration named without it
    would average runs that differ in it (equivalence's k, over three models)."""
    fields, _ = choices(study, t, merge_batch=False)
    return [] if unnamed(study, t) else fields


def unnamed(study: StudyRuns, t: pd.DataFrame) -> list[str]:
    """The varied fields left out of the choices as tied in the design (a BN rule run at k > 1 alone): where there
    is one, no configuration is named."""
    fields, _ = choices(study, t, merge_batch=False)
    return [f for f in study.varied if f in t and t[f].nunique() > 1 and f not in fields and f != "effective_batch"]


def one_at_base(t: pd.DataFrame, fields: list[str]) -> pd.DataFrame:
    """At B = base_batch every LR rule gives the same learning rate, and at k = 1 every BN momentum rule the same
    momentum: one configuration run once per rule, bitwise copies. Their runs are labelled with no rule, so that
    none is called best there and the copies count once (in the ties, the false-discovery family and the lists of
    those that cannot be told apart); each seed's copies are averaged later (per_seed)."""
    copies = []
    if "lr_rule" in fields and {"base_batch", "effective_batch"} <= set(t):
        copies.append(("lr_rule", pd.to_numeric(t["effective_batch"]) == pd.to_numeric(t["base_batch"]), EVERY_RULE))
    if "bn_momentum_rule" in fields and "accum_steps" in t:
        copies.append(("bn_momentum_rule", pd.to_numeric(t["accum_steps"]) == 1, EVERY_BN))
    copies = [(f, at, name) for f, at, name in copies if at.any()]
    if not copies:
        return t
    t = t.copy()
    for f, at, name in copies:
        t[f] = t[f].astype(object)
        t.loc[at, f] = name
    return t


def per_seed(t: pd.DataFrame, fields: list[str], columns: list[str]) -> pd.DataFrame:
    """Each configuration's seeds, one row each: a seed's copies of one configuration averaged."""
    t = t if "seed" in t else t.assign(seed=range(len(t)))
    return t.groupby([*fields, "seed"], dropna=False)[columns].mean().reset_index()


def per_configuration(seeds: pd.DataFrame, fields: list[str], value: str, cost: str) -> pd.DataFrame:
    """Mean and 95% interval of `value` over each configuration's seeds, and its mean `cost`."""
    rows = []
    for key, g in seeds.groupby(fields, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(fields, key)), value: g[value].mean(), "half": ci95(g[value]), cost: g[cost].mean(),
                     "n": len(g)})
    return pd.DataFrame(rows)


def of(seeds: pd.DataFrame, fields: list[str], row: pd.Series) -> pd.Series:
    """Which rows of `seeds` are the configuration `row`."""
    at = pd.Series(True, index=seeds.index)
    for f in fields:
        at &= (seeds[f] == row[f]) | (seeds[f].isna() & pd.isna(row[f]))
    return at


def _ranked(mine: list[pd.DataFrame], value: str, sign: int, stopped: list[bool]) -> list[int]:
    """The configurations by their mean over their own finished seeds, best first (the mean a sentence prints; a
    mean over the seeds all share would let one configuration's missing seed reorder all the others); one
    finished in a single seed last, and before it one stopped for doing worse in a seed (`stopped`: its mean is
    over the seeds that survived)."""
    rank = [rounded(rows[value].mean()) for rows in mine]
    return sorted(range(len(mine)), key=lambda i: (mine[i][value].notna().sum() < 2, stopped[i], -sign * rank[i]))


def highest(seeds: pd.DataFrame, points: pd.DataFrame, fields: list[str], value: str, maximize: bool,
            stopped: list[bool] | None = None) -> pd.Series:
    """The configuration of the best mean, as ties() ranks before any contrast overturns it; its `level` lists
    the others whose mean is the same (an exact tie: the pick among them is their order)."""
    mine = [seeds[of(seeds, fields, row)] for _, row in points.iterrows()]
    order = _ranked(mine, value, 1 if maximize else -1, stopped or [False] * len(mine))
    mean = [rounded(rows[value].mean()) for rows in mine]
    top = points.iloc[order[0]].astype(object)  # (a float row holds the list of ties only as objects)
    top["level"] = [label(points.iloc[i], fields) for i in order[1:] if mean[i] == mean[order[0]]]
    return top


def settled_by(points: pd.DataFrame, first: pd.Series, fields: list[str], cost: str, least: str, order: str) -> str:
    """How the first of an exact tie of the best mean was named: `least` ('for the least peak memory of them') where
    its `cost` is below every tied one's; `order` where they cost the same (the sort by cost kept their order)."""
    tied = points[[label(row, fields) in first.get("level", []) for _, row in points.iterrows()]]
    if tied.empty or (tied[cost] > first[cost]).all():
        return least
    return order if (tied[cost] == first[cost]).all() else f"{least}, then {order}"


def picked(top: pd.Series, first: pd.Series, fields: list[str], configurations: int, maximize: bool,
           named: str, settled: str = "") -> str:
    """What made `top` the best: the pick of the best mean of all (biased by the pick), one of an exact tie of it
    (named `settled`: how the first of the tie was chosen), or a contrast resolved above `first`, the configuration
    of the best mean (`named`, as a sentence labels it)."""
    level = first.get("level", [])
    most = "highest" if maximize else "lowest"
    if all(top[f] == first[f] or (pd.isna(top[f]) and pd.isna(first[f])) for f in fields):
        bias = (f"the {most} of {configurations} configurations, so biased {'upward' if maximize else 'downward'} by "
                f"the pick")
        if level:
            return (f"tied for the {most} mean with {'; '.join(level)}, and named {settled}; "
                    f"{'both' if len(level) == 1 else 'all'} {bias}")
        return bias
    return (f"resolved {'above' if maximize else 'below'} {named} on the seeds the two share, though that one had "
            f"the {most} mean")


def ties(seeds: pd.DataFrame, points: pd.DataFrame, fields: list[str], value: str,
         maximize: bool, stopped: list[bool] | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The configurations that cannot be told from the one of the best mean: each compared with it, paired by
    seed, under Benjamini-Hochberg over those comparisons (the best is picked from all of them, so its own mean is
    biased upward by the pick). The best is the first row. Second, those that share fewer than two seeds with it:
    not compared, so neither tied nor resolved. Third, those resolved from it (a column `better`: resolved better,
    which only picks that go round in a circle leave). In each, a column `shared` counts the seeds a comparison
    with the best paired (NaN for the best itself).

    Each mean ranks over the configuration's own finished seeds (the mean a sentence prints), a configuration with
    one finished seed is never the best, and one resolved above the pick on the seeds
    the two share is the pick instead. Where such picks go round in a circle (different seeds in each pair), the
    comparisons keep to the seeds all share, where they cannot."""
    sign = 1 if maximize else -1
    mine = [seeds[of(seeds, fields, row)] for _, row in points.iterrows()]
    shared = set.intersection(*(set(rows["seed"]) for rows in mine))
    ranked = _ranked(mine, value, sign, stopped or [False] * len(mine))
    step, order = quantum(seeds[value]), ranked
    for attempt in range(len(points) + 1):
        within, order = (seeds[seeds["seed"].isin(shared)], ranked) if attempt == len(points) else (seeds, order)
        top = within[of(within, fields, points.iloc[order[0]])]
        diffs = [paired(top, within[of(within, fields, points.iloc[i])], value, step) for i in order[1:]]
        verdicts = judge(diffs, 0.0)
        above = [i for i, v in zip(order[1:], verdicts) if v is not None and v.resolved and sign * v.d.mean < 0]
        if not above or attempt == len(points):
            break
        order = [above[0], *(i for i in order if i != above[0])]
    tied = [(i, v.d.n) for i, v in zip(order[1:], verdicts) if v is not None and v.d.n >= 2 and not v.resolved]
    apart = [(i, 0 if v is None else v.d.n) for i, v in zip(order[1:], verdicts) if v is None or v.d.n < 2]
    resolved = [(i, sign * v.d.mean < 0, v.d.n) for i, v in zip(order[1:], verdicts)
                if v is not None and v.d.n >= 2 and v.resolved]
    return (points.iloc[[order[0], *(i for i, _ in tied)]].assign(shared=[np.nan, *(n for _, n in tied)]),
            points.iloc[[i for i, _ in apart]].assign(shared=[n for _, n in apart]),
            points.iloc[[i for i, _, _ in resolved]].assign(better=[b for _, b, _ in resolved],
                                                            shared=[n for _, _, n in resolved]))


@dataclass
class Best:
    trials: pd.Index  # of `t` (finished, finite objective): the best configuration's and its ties'
    fields: list[str]  # the fields that name a configuration
    tied: pd.DataFrame  # the best configuration and those that cannot be told from it, best first
    configurations: int  # how many there were
    uncompared: pd.DataFrame  # those that share fewer than two seeds with the best (column `shared`)
    highest: pd.Series  # the configuration of the best mean (the best, unless a contrast overturned it)
    resolved: pd.DataFrame  # those resolved from the best (column `better`)
    settled: str  # how the first of an exact tie of the best mean was named


def below_per_b(study: StudyRuns, m: Measure, tied: pd.DataFrame, fields: list[str]) -> list[str]:
    """The ties that the per-B lines resolve worse than a configuration that is itself the best or one of its
    ties: a (rule, B) whose cost against its smallest B is resolved worse there (that contrast pools the (b, k)
    that make B, and is controlled over the per-B family), where that smallest B's configuration is in `tied`;
    the best's own contrast, one (b, k) at a time, left it open. Each by its label."""
    found = rule_comparisons(study.trials, m)
    if found is None or not {"lr_rule", "physical_batch", "accum_steps"} <= set(fields):
        return []
    _, compared, verdicts = found
    cost = {(r, b): (base, v) for (r, b, base, _), v in zip(compared, verdicts)}

    def batch(row) -> int:
        return int(row["physical_batch"] * row["accum_steps"])
    anchors = {(row["lr_rule"], batch(row)) for _, row in tied.iterrows()}
    below = []
    for _, row in tied.iloc[1:].iterrows():
        base, v = cost.get((row["lr_rule"], batch(row)), (None, None))
        if (v is not None and v.resolved and m.worse(v.d)
                and anchors & {(EVERY_RULE, base), (row["lr_rule"], base)}):
            below.append(label(row, fields))
    return below


def accounted(ties: list[str], lower: list[str], resolved: pd.DataFrame, fields: list[str],
              shown: int = 5) -> list[str]:
    """The configurations compared with the best, each group counted and named (up to `shown` of a long one), so
    that the counts add up to the comparisons: those that cannot be told from it, those the per-B lines resolve
    worse (below_per_b), and those resolved from it directly."""
    def names(rows: list[str]) -> str:
        return "; ".join(rows[:shown]) + ("; …" if len(rows) > shown else "")
    worse = [label(row, fields) for _, row in resolved.iterrows() if not row["better"]]
    better = [label(row, fields) for _, row in resolved.iterrows() if row["better"]]
    return [f"{len(ties)} other{'s' * (len(ties) > 1)} cannot be told from it ({names(ties)})" if ties else "",
            f"{len(lower)} set apart, though each alone cannot be told from it: the per-B lines resolve each worse "
            f"than its rule's smallest B (each B's (b, k) pooled), which is the best or cannot be told from it: "
            f"{'; '.join(lower)}" if lower else "",
            f"{len(worse)} resolved worse than it: {names(worse)}" if worse else "",
            f"{len(better)} resolved better than it on the seeds all share, where the picks went round in a circle: "
            f"{names(better)}" if better else ""]


def not_compared(apart: pd.DataFrame, fields: list[str]) -> str:
    """'; not compared with it (no seed shared): a; b', for ties()'s second frame; '' where there is none."""
    said = []
    for n, rows in apart.groupby("shared"):
        said.append(f"not compared with it ({'no seed' if n == 0 else 'one seed'} shared): "
                    + "; ".join(label(row, fields) for _, row in rows.iterrows()))
    return "".join(f"; {s}" for s in said)


def best_set(study: StudyRuns, t: pd.DataFrame) -> Best | None:
    """The best configuration with its ties; None where nothing can be told apart (one seed) or no field is an
    independent choice."""
    fields = naming(study, t)
    value, direction = study.objectives[0]
    if not fields or "seed" not in t or t["seed"].nunique() < 2 or value not in t:
        return None
    t = one_at_base(t, fields)
    memory = "peak_memory_bytes" in t and t["peak_memory_bytes"].notna().any()
    seeds = per_seed(t.assign(_cost=t["peak_memory_bytes"] if memory else 0.0), fields, [value, "_cost"])
    points = per_configuration(seeds, fields, value, "_cost")
    if len(points) < 2:
        return None
    # An exact tie of the best mean goes to the one of least peak memory, where every configuration measured it.
    order = f"first in the order of {', then '.join(SHORT.get(f, f) for f in fields)}"
    settled = "for the least peak memory of them" if points["_cost"].notna().all() and memory else order
    points = points.sort_values("_cost", kind="stable") if settled.startswith("for") else points
    gone = diverged_in_a_seed(study.trials, fields)
    stopped = [bool(_any_of(gone, fields, points.iloc[[i]]).any()) for i in range(len(points))]
    tied, apart, resolved = ties(seeds, points, fields, value, direction == "maximize", stopped)
    first = highest(seeds, points, fields, value, direction == "maximize", stopped)
    if settled.startswith("for"):
        settled = settled_by(points, first, fields, "_cost", settled, order)
    return Best(members(t, fields, tied), fields, tied, len(points), apart, first, resolved, settled)


def members(t: pd.DataFrame, fields: list[str], configurations: pd.DataFrame) -> pd.Index:
    """The trials of `t` that are one of `configurations` (at B = base_batch, whichever LR rule they ran)."""
    t = one_at_base(t, fields)
    return t.index[_any_of(t, fields, configurations)]


def _any_of(frame: pd.DataFrame, fields: list[str], configurations: pd.DataFrame) -> pd.Series:
    """Which rows of `frame` are one of `configurations`."""
    marked = pd.Series(False, index=frame.index)
    for _, row in configurations.iterrows():
        marked |= of(frame, fields, row)
    return marked


def diverged_in_a_seed(trials: pd.DataFrame, fields: list[str]) -> pd.DataFrame:
    """The configurations (their `fields`) in which a trial diverged or was pruned. Such a trial was stopped for
    doing worse, so a mean over the seeds that finished is a pick among survivors: no ranking counts the
    configuration as if it had not."""
    if not fields or "reason" not in trials or not set(fields) <= set(trials):
        return pd.DataFrame(columns=fields)
    return one_at_base(trials[trials["reason"].isin(WORSE)], fields)[fields].drop_duplicates()


def stopped_in(trials: pd.DataFrame) -> str:
    """How the study's trials that ended worse ended ('diverged', 'pruned', 'diverged or pruned'), as
    diverged_in_a_seed() leaves them out."""
    return stopped(trials.loc[trials["reason"].isin(WORSE), "reason"]) if "reason" in trials else "diverged"


def without(frame: pd.DataFrame, fields: list[str], configurations: pd.DataFrame) -> pd.DataFrame:
    """`frame`'s rows that are none of `configurations`."""
    return frame[~_any_of(frame, fields, configurations)]
