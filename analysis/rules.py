"""The LR rules compared over B and at one B, and accumulation against its true-batch twin: every trial at a B
counted, paired by seed, each family under Benjamini-Hochberg (verdicts.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .measures import (ACCURACY, WORSE, Measure, finished, no_batchnorm, one_batch, rounded, stopped, stopped_verb,
                       tuned)
from .plotting import in_order
from .runs import Difference, paired, quantum
from .verdicts import judge
from .wording import controlled, listed, plus_minus, stated, where_at


# How a run with no reason logged ended, by its MLflow status (FINISHED runs are never missing): the verb a twin's
# sentence puts first, then the words that the count of trials that did not finish uses too (one state, one name).
STATES = {"RUNNING": ("is ", "still marked running"), "KILLED": ("was ", "killed"), "SCHEDULED": ("", "never started"),
          "FAILED": ("", "failed with no reason logged")}
ABSENT = "has no run logged"  # a (b, k) that makes a B in other seeds, with no row in this one (never logged)


def missing_halves(trials: pd.DataFrame, b: int | None = None) -> list[tuple[str, int, str, bool]]:
    """Where a (b, k) that makes a B did not finish as asked in a seed for a reason other than doing worse (out of
    memory, an error, killed, still running, a script that did not run as asked, or no run logged at all while
    another rule or seed ran it at that B) while another (b, k) there did, that seed's value at B is the other half
    alone: each such case ('the true batch (b = 512, k = 1) under sqrt ended with an error in seed 2 at B = 512',
    its number of seeds, the other half: 'accumulated', whether that is every seed that ran at B), at B = `b` or at
    every B."""
    if not {"physical_batch", "accum_steps", "seed", "lr_rule", "status"} <= set(trials):
        return []
    rows = one_batch(trials)
    rows = rows if b is None else rows[rows["effective_batch"] == b]
    reason = rows["reason"] if "reason" in rows else pd.Series(None, index=rows.index, dtype=object)
    mismatch = rows["config_mismatch"] if "config_mismatch" in rows else pd.Series(None, index=rows.index, dtype=object)
    done = finished(rows)  # (a run that did not run as asked compares nothing: its half is missing as well)
    lost = rows[~rows.index.isin(done.index) & ~reason.isin(WORSE)]
    lost = lost.assign(_why=[ended_how(r, st, m) for r, st, m in
                             zip(reason[lost.index], lost["status"], mismatch[lost.index])])
    said = []
    for (bb, pb, k, why), g in pd.concat([lost, _absent(rows)]).groupby(
            ["effective_batch", "physical_batch", "accum_steps", "_why"]):
        other = done[(done["effective_batch"] == bb) & ((done["physical_batch"] != pb) | (done["accum_steps"] != k))]
        g = g[[((other["lr_rule"] == r) & (other["seed"] == sd)).any() for r, sd in zip(g["lr_rule"], g["seed"])]]
        if g.empty:
            continue
        at = rows[rows["effective_batch"] == bb]
        seeds = sorted(int(x) for x in g["seed"].unique())
        rules = in_order("lr_rule", g["lr_rule"].unique())
        under = "" if set(rules) >= set(at["lr_rule"]) else f" under {listed(rules)}"
        every = set(seeds) >= set(at["seed"]) and len(seeds) > 1
        if every and why == ABSENT:  # (a run the other rules have there: not the study's design, as far as it shows)
            ran = in_order("lr_rule", at.loc[(at["physical_batch"] == pb) & (at["accum_steps"] == k), "lr_rule"]
                           .unique())
            where = f" in any seed ({listed(ran)} ran it)"
        else:
            where = f" in seed{'s' * (len(seeds) > 1)} {listed([str(x) for x in seeds])}"
        said.append((f"{'the true batch' if k == 1 else 'accumulation'} (b = {int(pb)}, k = {int(k)}){under} {why}"
                     f"{where}" + (f" at B = {int(bb)}" if b is None else ""), len(seeds),
                     "accumulated" if k == 1 else "true-batch", every))
    return said


def one_half(trials: pd.DataFrame) -> dict[int, str]:
    """The Bs above the smallest b at which only one half ran (no run of the other logged in any seed or status),
    in a study that ran both halves at another such B: B -> 'only the true batch (b = 512, k = 1) ran, so accumulation was
    not measured'. A half that ran and did not finish is missing_halves()'s."""
    t = one_batch(trials)
    if not {"batch", "physical_batch", "accum_steps", "effective_batch"} <= set(t) or t["batch"].nunique() < 2:
        return {}
    above = t[t["effective_batch"] > t["physical_batch"].min()]
    if not (above.groupby("effective_batch")["batch"].nunique() > 1).any():  # (a study with no twins at all)
        return {}
    out = {}
    for b, rows in above.groupby("effective_batch"):
        if rows["batch"].nunique() > 1:
            continue
        made = rows[["physical_batch", "accum_steps"]].drop_duplicates().sort_values("accum_steps")
        pairs = listed([f"b = {pb:.0f}, k = {k:.0f}" for pb, k in made.itertuples(index=False)])
        ran, other = (("the true batch", "accumulation") if rows["batch"].iloc[0] == "true batch" else
                      ("accumulation", "the true batch"))
        out[int(b)] = f"only {ran} ({pairs}) ran, so {other} was not measured"
    return out


def ended_how(reason, status: str, mismatch=None) -> str:
    """How a run that did not finish as asked ended, in words: the mismatch the tracer saw, its reason where one was
    logged, else its status."""
    if isinstance(mismatch, str) and mismatch:
        return f"did not run as it was asked to ({mismatch})"
    if reason == "oom":
        return "ran out of memory"
    if reason == "error":
        return "ended with an error"
    if isinstance(reason, str) and reason:
        return f"ended ({reason})"
    verb, state = STATES.get(str(status), ("ended ", f"with status {status}"))
    return verb + state


def unlogged(status: str) -> str:
    """A run with no reason logged, by its status, as a count names it: 'still marked running', 'killed'."""
    return STATES.get(str(status), ("", f"status {status}"))[1]


def unpaired(seeds, mine: pd.DataFrame, twin: pd.DataFrame, value: str, rule: str, whose: str,
             ran: tuple[pd.DataFrame, pd.DataFrame]) -> str:
    """The `seeds` that pairing a rule's finished runs (`mine`) with its finished true-batch `twin` on `value` left
    out, and why: 'the true batch has no run in seed 2; scaled did not finish in seeds 0 and 1'; '' where none was
    left out. `ran` holds the rule's runs and its twin's of every status, so that a seed with no run reads 'has no
    run', apart from one that ran and did not finish. `seeds` are those that ran at the rule's k and b or at its
    true batch: a seed the study ran only elsewhere leaves nothing out."""
    has = [set(rows.loc[rows[value].notna(), "seed"]) for rows in (mine, twin)]
    tried = [set(rows["seed"]) for rows in ran]
    why: dict[str, list[str]] = {}  # (what happened -> the seeds it happened in)
    for seed in sorted(set(seeds) - (has[0] & has[1])):
        said = [f"{name} " + (f"logged no {value}" if seed in set(rows["seed"]) else
                              "did not finish" if seed in run else "has no run")
                for name, rows, got, run in zip((rule, whose), (mine, twin), has, tried) if seed not in got]
        why.setdefault(" and ".join(said), []).append(str(int(seed)))
    return "; ".join(f"{said} in seed{'s' * (len(s) > 1)} {listed(s)}" for said, s in why.items())


def _absent(rows: pd.DataFrame) -> pd.DataFrame:
    """The (B, b, k, LR rule, seed) cells with no row: a (b, k) that ran at its B under some rule, under a rule and
    in a seed that ran at that B, with no run logged (an interrupted study, a run never recorded)."""
    keys = ["effective_batch", "physical_batch", "accum_steps", "lr_rule"]
    seeds = rows[["effective_batch", "seed"]].drop_duplicates()
    rules = rows[["effective_batch", "lr_rule"]].dropna().drop_duplicates()
    made = rows[["effective_batch", "physical_batch", "accum_steps"]].drop_duplicates()
    cells = made.merge(rules, on="effective_batch").merge(seeds, on="effective_batch")
    seen = rows[[*keys, "seed"]].drop_duplicates().assign(_seen=True)
    cells = cells.merge(seen, on=[*keys, "seed"], how="left")
    return cells[cells["_seen"].isna()].drop(columns="_seen").assign(_why=ABSENT)


def _halves_note(t: pd.DataFrame, trials: pd.DataFrame) -> list[str]:
    """Where a B is made by several (b, k), as an accumulated run and its true-batch twin make it, every one of
    them counts: a seed's runs at that B are averaged before they are paired; where one half is missing in a
    seed, that seed's value is the other half alone, and the sentence says where."""
    if not {"physical_batch", "accum_steps"} <= set(t):
        return []
    made = t.groupby("effective_batch")[["physical_batch", "accum_steps"]].apply(lambda g: len(g.drop_duplicates()))
    mixed = sorted(int(b) for b in made[made > 1].index)
    if not mixed:
        return []
    at = f"B = {mixed[0]}" if len(mixed) == 1 else f"B = {listed([str(b) for b in mixed])}"
    return [f"The LR rules are compared over every trial at a B: at {at}, each seed's runs at the (b, k) that "
            f"make that B (accumulated and true batch) are averaged, then paired by seed"
            + "".join(f"; where {x}, {_counts(n, every)} the {half} half alone"
                      for x, n, half, every in missing_halves(trials))
            + "; the sentence on accumulation compares the two."]


def _counts(n: int, every: bool) -> str:
    return "every seed counts" if every else "that seed counts" if n == 1 else "those seeds count"


def ended_worse(rows: pd.DataFrame) -> tuple[int, int, str] | None:
    """(seeds in which a trial of `rows` diverged or was pruned, seeds that ran, stopped()'s word), or None where
    none did. Such a trial was stopped for doing worse: a mean over the seeds that finished is a pick among
    survivors."""
    worse = rows[rows["reason"].isin(WORSE)]
    if worse.empty:
        return None
    return int(worse["seed"].nunique()), int(rows["seed"].nunique()), stopped(worse["reason"])


def diverged(trials: pd.DataFrame) -> dict[tuple[str, int], tuple[int, int, str]]:
    """(LR rule, B) -> ended_worse() there. A rule that diverged (or was pruned) in a seed is not compared over
    the seeds that survived (that is a pick among survivors): it did worse."""
    t = one_batch(trials)
    if not {"lr_rule", "reason", "seed", "effective_batch"} <= set(t):
        return {}
    out = {}
    for (rule, b), rows in t.groupby(["lr_rule", "effective_batch"]):
        if (found := ended_worse(rows)) is not None:
            out[(rule, int(b))] = found
    return out


def went(rule: str, counts: tuple[int, int, str]) -> str:
    """'linear diverged in 1 of 3 seeds', 'linear was pruned in 1 of 3 seeds'."""
    return f"{rule} {stopped_verb(counts[2])} in {counts[0]} of {counts[1]} seed{'s' * (counts[1] != 1)}"


def rule_comparisons(trials: pd.DataFrame, m: Measure = ACCURACY):
    """Each LR rule's B against its smallest B, every trial at a B counted (a seed's runs there averaged), judged
    as one family: (trials compared, [(rule, B, smallest B, difference)], verdicts); None where the study does
    not compare LR rules over B (or searched the LR). A rule's B where it diverged in a seed is no comparison
    (its difference None): see diverged()."""
    gone = diverged(trials)
    t = one_batch(finished(trials))
    if "lr_rule" not in t or "seed" not in t:  # (no seed: nothing to pair by)
        return None
    t = t[t["lr_rule"].notna()]  # (a trial that logged no rule is no rule's)
    if t["lr_rule"].nunique() < 2 or t["effective_batch"].nunique() < 2 or tuned(t):
        return None
    step = quantum(t[m.name])
    compared = []  # the family of the false-discovery control
    for rule in in_order("lr_rule", t["lr_rule"]):
        rows = t[t["lr_rule"] == rule]
        sizes = sorted(int(b) for b in rows["effective_batch"].unique())
        base = rows[rows["effective_batch"] == sizes[0]]
        compared += [(rule, b, sizes[0], None if (rule, b) in gone else
                      paired(rows[rows["effective_batch"] == b], base, m.name, step)) for b in sizes[1:]]
    return t, compared, judge([d for *_, d in compared], m.margin)


def lr_rules(trials: pd.DataFrame, m: Measure = ACCURACY) -> list[str]:
    """Per LR rule, each B against the smallest, every trial at a B counted; then the rules at the largest B."""
    found = rule_comparisons(trials, m)
    if found is None:
        return []
    t, compared, verdicts = found
    step, rules = quantum(t[m.name]), in_order("lr_rule", t["lr_rule"])
    out, gone = _halves_note(t, trials), diverged(trials)
    side = ("fell", "rose") if m.maximize else ("rose", "fell")  # (a loss that rose did worse)
    for rule in rules:
        mine = [(b, base, v) for (r, b, base, _), v in zip(compared, verdicts) if r == rule]
        if not any(v is not None or (rule, b) in gone for b, _, v in mine):
            if mine:  # (no seed in common with the smallest B)
                out.append(f"The {rule} LR rule ran no seed both at B = {mine[0][1]} and at a larger B: its Bs cannot "
                           f"be compared.")
            continue
        seeds = {v.d.n for *_, v in mine if v is not None}  # (a B where seeds failed has fewer: said per B)
        each = "" if len(seeds) == 1 else " over {} seeds"
        said, alike = [], []  # (Bs in a row that are equivalent are said once)
        for i, (b, base, v) in enumerate(mine):
            if v is None and (rule, b) not in gone:
                said.append(f"at B = {b} no seed ran both Bs, so it cannot be compared")
            elif v is None:
                said.append(f"at B = {b} {went(rule, gone[(rule, b)]).removeprefix(rule + ' ')}, not compared "
                            f"over the seeds that finished")
            elif v.equivalent and not v.d.separated:  # (inside the margin but off 0: stated() says both)
                alike.append(f"{b} ({plus_minus(v.d, m, m.places(v.d.mean, v.d.half))}{each.format(v.d.n)})")
                following = mine[i + 1][2] if i + 1 < len(mine) else None
                if following is not None and following.equivalent and not following.d.separated:
                    continue
                said.append(f"equivalent within ±{m.margin_text} at B = {listed(alike)}")
                alike = []
            elif v.resolved:
                said.append(f"at B = {b} {side[0] if (v.d.mean < 0) == m.maximize else side[1]} "
                            f"({stated(v.d, m=m, v=v)})")
            else:
                said.append(f"at B = {b} {stated(v.d, m=m, v=v)}")
        over = f" over {min(seeds)} seed{'s' * (min(seeds) != 1)}" if len(seeds) == 1 else ""  # (none: all diverged)
        out.append(f"The {rule} LR rule against B = {mine[0][1]}{over}: " + "; ".join(said) + ".")
    out += _at_largest(t, m, step, gone)
    return out + controlled([(where_at(b, rule=r), d) for r, b, _, d in compared],
                            "comparisons of a rule's B against its smallest B")


@dataclass
class AtB:
    """The LR rules at one B: each rule's mean over its own finished seeds there (the pick first), the others'
    verdicts against the pick (paired on the seeds the two share), those that cannot be told from it, and
    `overturned`: the rule of the best mean where a contrast resolved the pick above it (else None)."""
    means: pd.Series
    verdicts: list
    ties: list[str]
    best: str
    overturned: str | None
    diverged: dict[str, tuple[int, int]]  # the rules left out there: seeds diverged of seeds run (never the pick)


def _means(at: pd.DataFrame, m: Measure) -> pd.Series:
    """Each rule's mean over its own finished seeds (a seed's runs at B averaged first), best first: the mean the
    line prints. A mean over the seeds every rule shares would let one rule's missing seed reorder the others;
    what pairs by seed is each contrast with the pick."""
    seeds = at.groupby(["lr_rule", "seed"])[m.name].mean()
    means = seeds.groupby(level="lr_rule").mean().map(rounded)
    return means.reindex(in_order("lr_rule", means.index)).sort_values(ascending=not m.maximize, kind="stable")


def unshared(t: pd.DataFrame, b: int, gone: dict) -> str | None:
    """Why no rule is picked at B where the rules that did not diverge finished together in fewer than 2 seeds (one
    seed cannot tell them apart; a mean over one seed set against a mean over others is no comparison), or None."""
    at = t[(t["effective_batch"] == b) & ~t["lr_rule"].isin([r for r, x in gone if x == b])]
    seeds = at.groupby("lr_rule")["seed"].unique()
    if len(seeds) < 2 or len(set.intersection(*(set(s) for s in seeds))) >= 2:
        return None
    shared = len(set.intersection(*(set(s) for s in seeds)))
    if shared and all(len(s) == shared for s in seeds):  # (every rule's mean is over that one same seed)
        return ("no LR rule is picked: every rule finished in the same one seed there, and one seed cannot tell them "
                "apart")
    each = listed([f"{r} in {len(seeds[r])}" for r in in_order("lr_rule", seeds.index)])
    return (f"no LR rule is picked: the rules finished together in {shared} seed{'s' * (shared != 1)} there (each "
            f"finished in: {each}), and a mean over some seeds is not set against a mean over others")


def rules_at(t: pd.DataFrame, sizes: list[int], m: Measure, step: float,
             gone: dict[tuple[str, int], tuple[int, int]] | None = None,
             split: frozenset = frozenset()) -> dict:
    """The LR rules at each B of `sizes` against the one of the best mean there, paired by seed, under one
    Benjamini-Hochberg over every B's contrasts (a block that names a rule at each B is one family). Where a rule
    is resolved above the pick on the seeds the two share, it is the pick instead. A rule that diverged there in
    a seed (`gone`, diverged()) is neither picked nor compared. A B is left out where it is base_batch (every rule
    one configuration), one rule ran, the rules share fewer than 2 seeds (unshared()), or the picks go round in a
    circle. At a B of `split` (where accumulation and its true-batch twin were resolved apart, so that a pick over
    both halves would hold for neither) each half is picked on its own, keyed (B, 'accumulated' or 'true batch')."""
    tables, gone = {}, gone or {}
    for b in sizes:
        out_ = {r: x for (r, bb), x in gone.items() if bb == b}
        here = t[t["effective_batch"] == b]
        cells = ({(b, half): here[here["batch"] == half] for half in in_order("batch", here["batch"].unique())}
                 if b in split else {b: here})
        for key, rows in cells.items():
            at = rows[~rows["lr_rule"].isin(list(out_))]
            means = _means(at, m) if len(at) else pd.Series(dtype=float)
            if (len(means) >= 1 and len(means) + len(out_) >= 2 and unshared(rows, b, gone) is None
                    and not ("base_batch" in at and (at["effective_batch"] == at["base_batch"]).all())):
                tables[key] = (at, means, out_)
    order = {b: list(means.index) for b, (_, means, _) in tables.items()}
    moved: set[int] = set()
    for _ in range(1 + max((len(o) for o in order.values()), default=0)):
        diffs = {b: [paired(at[at["lr_rule"] == r], at[at["lr_rule"] == order[b][0]], m.name, step)
                     for r in order[b][1:]] for b, (at, _, _) in tables.items()}
        judged = iter(judge([d for b in order for d in diffs[b]], m.margin))
        verdicts = {b: [next(judged) for _ in diffs[b]] for b in order}
        moved = set()
        for b in order:
            above = [r for r, v in zip(order[b][1:], verdicts[b]) if v is not None and v.resolved and not m.worse(v.d)]
            if above:
                order[b], moved = [above[0], *(r for r in order[b] if r != above[0])], moved | {b}
        if not moved:
            break
    out = {}
    for b, (_, means, out_) in tables.items():
        if b in moved:  # (still moving: a circle)
            continue
        ties = [r for r, v in zip(order[b][1:], verdicts[b]) if v is None or not v.resolved]
        out[b] = AtB(means[order[b]], verdicts[b], ties, order[b][0],
                     means.index[0] if order[b][0] != means.index[0] else None, out_)
    return out


def decided(at: AtB, m: Measure) -> str:
    """What made the pick: the best mean, or a contrast resolved better than the rule of the best mean."""
    most = "highest" if m.maximize else "lowest"
    level = [r for r in at.means.index if r != at.best and at.means[r] == at.means[at.best]]
    if at.overturned is None:
        return f"was tied for the {most} mean with {listed(level)}" if level else f"had the {most} mean"
    return f"was resolved better than {at.overturned} on the seeds the two share ({at.overturned} had the {most} mean)"


def _at_largest(t: pd.DataFrame, m: Measure, step: float, gone: dict) -> list[str]:
    """The rules at the largest B against the one of the best mean: a contrast is said only where it is resolved,
    controlled with the rules' contrasts at every B, as the recommendation's per-B lines are (one family)."""
    largest = int(t["effective_batch"].max())
    why = unshared(t, largest, gone)
    if why:
        return [f"At the largest batch, B = {largest}, {why}."]
    at = rules_at(t, sorted(int(b) for b in t["effective_batch"].unique()), m, step, gone).get(largest)
    if at is None:  # (at B = base_batch the rules are one configuration: none is best there)
        return []
    others = list(at.means.index[1:])
    out_ = (f"; {listed([went(r, x) for r, x in at.diverged.items()])}, not compared over the seeds that finished"
            if at.diverged else "")
    if not others:
        return [f"At the largest batch, B = {largest}, {at.best} is the only rule that did not diverge in a seed "
                f"({m.level(at.means[at.best])}){out_}."]
    against = [f"{r} {stated(v.d, m=m, v=v)}" if v else f"{r} {m.level(at.means[r])}"
               for r, v in zip(others, at.verdicts)]
    verdict = (f"{at.best} is resolved as the best there" if not at.ties else
               f"the best there is one of {listed([at.best, *at.ties])}: no contrast between them is resolved")
    level = ", ".join(f"{r} {m.level(at.means[r])}" for r in others)
    return [f"At the largest batch, B = {largest}, the {at.best} rule {decided(at, m)} "
            f"({m.level(at.means[at.best])}; {level}); against it: " + "; ".join(against) + f"; {verdict}{out_}."]


def twin_pairs(trials: pd.DataFrame, m: Measure = ACCURACY) -> list[tuple[dict, Difference]]:
    """Accumulated against true batch at each B and rules, paired by seed: ({rule: value, effective_batch: B},
    difference) per pair, the family of the twins' sentence."""
    t = finished(trials)
    if "batch" not in t or t["batch"].nunique() < 2:
        return []
    step = quantum(t[m.name]) if m.name in t else None
    keys = _twin_keys(t)
    t = t[t["effective_batch"] > t["physical_batch"].min()]
    gone = {tuple(key.values()) for key, _ in twins_diverged(trials)}
    pairs = []
    for group, rows in t.groupby([*keys, "effective_batch"]):
        group = group if isinstance(group, tuple) else (group,)
        if (*group[:-1], int(group[-1])) in gone:  # (over the seeds that survived: a pick among survivors)
            continue
        d = paired(rows[rows["batch"] == "accumulated"], rows[rows["batch"] == "true batch"], m.name, step)
        if d is not None:
            pairs.append(({**dict(zip(keys, group[:-1])), "effective_batch": int(group[-1])}, d))
    return pairs


def _twin_keys(t: pd.DataFrame) -> list[str]:
    """The rules a twin pair is keyed by: a model without BatchNorm has no BN momentum rule to name a pair by."""
    return [c for c in ("lr_rule", "bn_momentum_rule") if c in t and t[c].nunique() > 1
            and not (c == "bn_momentum_rule" and no_batchnorm(t))]


def twins_diverged(trials: pd.DataFrame) -> list[tuple[dict, str]]:
    """The twin pairs in which a run diverged in a seed, not compared: ({rule: value, effective_batch: B}, 'the
    accumulated run diverged in 1 of 3 seeds')."""
    done = finished(trials)
    if not {"batch", "reason", "seed"} <= set(trials) or done.empty or done["batch"].nunique() < 2:
        return []
    keys = _twin_keys(done)
    out = []
    for group, rows in trials.groupby([*keys, "effective_batch"]):
        group = group if isinstance(group, tuple) else (group,)
        sides = [went(f"the {side} run", found) for side, r in rows.groupby("batch")
                 if (found := ended_worse(r)) is not None]
        if sides:
            out.append(({**dict(zip(keys, group[:-1])), "effective_batch": int(group[-1])}, " and ".join(sides)))
    return out


def twins(trials: pd.DataFrame, m: Measure = ACCURACY) -> list[str]:
    """Accumulated points against their true-batch twins at the same B and rules, paired by seed."""
    pairs = [(where_at(key.pop("effective_batch"), **key), d) for key, d in twin_pairs(trials, m)]
    gone = [f"{where_at(key.pop('effective_batch'), **key)}: {said}" for key, said in twins_diverged(trials)]
    how = stopped_verb(stopped(trials.loc[trials["reason"].isin(WORSE), "reason"])) if gone else ""
    left = f" Not compared where a run {how} in a seed: {'; '.join(gone)}." if gone else ""
    alone = one_half(trials)
    left += "".join(f" At B = {b} {said}." for b, said in alone.items())
    if not pairs:
        return [left.strip()] if left else []
    ahead = m.ranked("accumulated ahead", "true batch ahead")
    one = [(w, d) for w, d in pairs if d.n < 2]  # (said apart: a pair of one seed does not set the others' n)
    pairs = [(w, d) for w, d in pairs if d.n >= 2]
    if not pairs:
        median = float(np.median([abs(d.mean) for _, d in one]))
        return [f"Accumulation and the true batch at the same B differed by a median of {m.amount(median)} over "
                f"{len(one)} pairs, in one seed: no pair can be told from seed noise.{left}"]
    if one:
        left = f" Shared one seed only: {'; '.join(f'{w}: {stated(d, *ahead, m=m)}' for w, d in one)}.{left}"
    n = min(d.n for _, d in pairs)
    verdicts = judge([d for _, d in pairs], m.margin)
    resolved = [(w, v) for (w, _), v in zip(pairs, verdicts) if v.resolved]
    equivalent = [w for (w, _), v in zip(pairs, verdicts) if v.equivalent and not v.d.separated]
    off_zero = [(w, v) for (w, _), v in zip(pairs, verdicts) if v.equivalent and v.d.separated and not v.resolved]
    open_ = [(w, v) for (w, _), v in zip(pairs, verdicts) if not v.resolved and not v.equivalent]
    halves = [v.d.half for v in verdicts]
    named = f" ({'; '.join(equivalent)})" if equivalent else ""  # (each named, as the open pairs are)
    parts = [f"equivalent {m.within} in {len(equivalent)}{named}" if m.margin else f"none called equivalent {m.within}"]
    if off_zero:  # (inside the margin, but its interval excludes 0: not "equivalent" alone)
        parts.append(f"{m.within} but not equivalent alone in {len(off_zero)} (" + "; ".join(
            f"{w}: {stated(v.d, *ahead, m=m, v=v)}" for w, v in off_zero) + ")")
    if open_:
        parts.append(f"not resolved in {len(open_)} (" + "; ".join(
            f"{w}: {plus_minus(v.d, m, m.places(v.d.mean, v.d.half))}" for w, v in open_) + ")")
    parts.append(f"resolved in {len(resolved)}" + (": " + "; ".join(f"{w}: {stated(v.d, *ahead, m=m, v=v)}"
                                                                     for w, v in resolved) if resolved else ""))
    return [f"Accumulation and its true-batch twin at the same B were compared in {len(pairs)} "
            f"pair{'s' * (len(pairs) != 1)}, paired by seed "
            f"over {n} seeds (95% t-intervals, median half-width {m.amount(float(np.median(halves)))}): "
            + "; ".join(parts)
            + "." + left, *controlled(pairs, "twin pairs")]
