"""The block's lines per B: the LR rule to use at each B the study reached (each half on its own where
accumulation and its true-batch twin were resolved apart), what it costs against the smallest B, how to make B,
and the largest B shown to cost less than the margin. Made from the findings' comparisons (rules.py), with the
same statistics."""
from __future__ import annotations

import pandas as pd

from batchsweep.sweeps import commands

from .best import stopped_in
from .measures import Measure, finished, one_batch, stopped_verb
from .plotting import in_order
from .rules import (decided, diverged, missing_halves, one_half, rule_comparisons, rules_at, twin_pairs, unshared,
                    went)
from .runs import StudyRuns, paired, quantum
from .verdicts import judge
from .wording import listed, stated

MIB = 2 ** 20


def _memory(t: pd.DataFrame, b: int, k: int) -> str:
    rows = t[(t["physical_batch"] == b) & (t["accum_steps"] == k)] if "peak_memory_bytes" in t else t.iloc[0:0]
    if not len(rows):
        return ""
    peak = pd.to_numeric(rows["peak_memory_bytes"], errors="coerce").mean()  # (the runs that logged it)
    return f", {peak / MIB:,.2f} MiB" if pd.notna(peak) else ", memory not measured"


def _under(key: dict, every_rule: bool = False) -> str:
    """The other rules a twin pair ran under (BN momentum's; the LR rule's too where `every_rule`), as its verdict
    is prefixed."""
    named = [f"BN {key[f]}" if f == "bn_momentum_rule" else f"the {key[f]} LR rule" if f == "lr_rule" else
             f"{f} {key[f]}"
             for f in sorted(key, key=lambda f: (f != "lr_rule", f))
             if f != "effective_batch" and (every_rule or f != "lr_rule")]
    return f"under {', '.join(named)}: " if named else ""


def _batching(t: pd.DataFrame, rule: str | None, b: int, twins: list, m: Measure) -> str:
    """How to make B: accumulated or true batch, as the twins' verdicts under `rule` (None: every LR rule, each
    named) at B read (one per value of each other rule varied, BN momentum's named), at the (b, k) that ran there,
    and what each cost in memory. A b is advised only where accumulation was shown equivalent to the true batch,
    or resolved from it."""
    mine = [(key, v) for key, v in twins if (rule is None or key.get("lr_rule", rule) == rule)
            and key["effective_batch"] == b]
    if not mine:
        return ""
    ran = t[(t["effective_batch"] == b) & ((t["lr_rule"] == rule) if "lr_rule" in t and rule else True)]
    made = ran[["physical_batch", "accum_steps"]].drop_duplicates().sort_values("accum_steps", ascending=False)
    accumulated = [f"b = {bb:.0f}, k = {k:.0f}{_memory(t, bb, k)}" for bb, k in made.itertuples(index=False) if k > 1]
    averaged = " (each seed's runs averaged)" if len(accumulated) > 1 else ""
    said = "; ".join(_under(key, rule is None) + stated(v.d, 'higher', 'lower', m, v) for key, v in mine)
    # (the picked rule's twins: another rule's may read otherwise; 'under none' alone read as 'with no condition')
    whose = f" under the {rule} LR rule" if rule else ""
    made = (f"accumulating{whose} ({'; '.join(accumulated)}){averaged} against the true batch (b = {b}, k = 1"
            f"{_memory(t, b, 1)}): {said}")
    plan = f"`{commands.command('plan')} --target-batch {b} --memory-budget SIZE`"
    ahead = {_under(key, rule is None).removesuffix(": ") or "here": "accumulation" if (v.d.mean > 0) == m.maximize
             else "the true batch" for key, v in mine if v.resolved}
    if ahead:
        better = (f"{list(ahead.values())[0]} was resolved better" if len(set(ahead.values())) == 1 else
                  "; ".join(f"{w}, {x} was resolved better" for w, x in ahead.items()))
        use = ("the one resolved better under your rule" if len(set(ahead.values())) > 1 else
               "the true batch where it fits your memory" if "the true batch" in ahead.values() else "accumulation")
        return f"; {made}; they differ: {better}; use {use} ({plan})"
    if all(v.equivalent for _, v in mine):
        return f"; {made}; b: the largest that fits your memory ({plan})"
    n = min(v.d.n for _, v in mine)
    return (f"; {made}; accumulation{whose} was neither shown equivalent to the true batch nor resolved from it "
            f"with {n} seeds, so no b is advised")


def _pooled(study: StudyRuns, t: pd.DataFrame) -> str:
    """Where the study varies other fields beside the LR rule and B (BN momentum rules, a user's own), the per-B
    lines pool their runs: said so, of a field that takes several values under one LR rule at one B (one that
    moves with the LR rule is not averaged over)."""
    per, b = [c for c in ("lr_rule", "effective_batch") if c in t], ("physical_batch", "accum_steps", "effective_batch")
    other = [f for f in study.varied if f in t and f not in ("lr_rule", *b)
             and (t.groupby(per, dropna=False)[f].nunique() > 1 if per else t[f].nunique() > 1).any()]
    named = [f"the BN momentum rules {listed(in_order(f, t[f].unique()))}" if f == "bn_momentum_rule" else
             f"{f} {listed([str(v) for v in in_order(f, t[f].unique())])}" for f in other]
    return f" (over {'; '.join(named)}, each seed's runs averaged)" if named else ""


def _which(at, m: Measure) -> str:
    """The rule picked at a B (or at one half of it) with its ties and the rules resolved worse than it."""
    out_ = (f"; {listed([went(r, x) for r, x in at.diverged.items()])}, not compared over the seeds that "
            f"finished" if at.diverged else "")
    below = [f"{r} {stated(c.d, m=m, v=c)}" for r, c in zip(at.means.index[1:], at.verdicts) if r not in at.ties]
    # (a rule whose mean ties the pick's exactly is named once, in decided()'s "tied for the highest mean with")
    level = [r for r in at.ties if at.overturned is None and at.means[r] == at.means[at.best]]
    ties = [r for r in at.ties if r not in level]
    return (f"the {at.best} LR rule ({m.level(at.means[at.best])}; it {decided(at, m)}"
            + (f"; {listed(ties)} cannot be told from it" if ties else "")
            + (f"; resolved worse than it: {'; '.join(below)}" if below else "") + out_ + ")")


def _halves(t: pd.DataFrame, b: int, picks: dict, compared: list, m: Measure, pooled: str) -> str | None:
    """A B whose twins were resolved apart, each half picked on its own (a pick over both would hold for neither):
    each half's rule and that half's own cost against the smallest B, judged with the block's other costs."""
    halves = [(key[1], at) for key, at in picks.items() if isinstance(key, tuple) and key[0] == b]
    if not halves:
        return None
    said = []
    for half, at in halves:
        rows = t[(t["effective_batch"] == b) & (t["batch"] == half)]
        made = ", ".join(f"b = {bb:.0f}, k = {k:.0f}" for bb, k in
                         rows[["physical_batch", "accum_steps"]].drop_duplicates().itertuples(index=False))
        base, v = next(((base, v) for (r, bb, base), v in compared if r == at.best and bb == (b, half)),
                       (None, None))
        against = (f"against B = {base} (this half alone): {stated(v.d, m=m, v=v)}" if v is not None else
                   f"against the smallest B: cannot be compared: the {at.best} LR rule ran no seed at both Bs")
        said.append(f"{half} ({made}): {_which(at, m)}; {against}")
    return (f"At B = {b}{pooled}, accumulation and the true batch were resolved apart (below), so each half is "
            f"picked on its own: " + "; ".join(said) + ".")


def _costs(t: pd.DataFrame, compared: list, split: frozenset, m: Measure, step: float) -> list:
    """The block's costs against the smallest B, one family: the findings' comparisons, a B of `split` by each
    of its halves (its own runs against the smallest B's, paired by seed) in place of their average."""
    keyed = []
    for rule, b, base, d in compared:
        if b not in split or d is None:
            keyed.append(((rule, b, base), d))
            continue
        rows = t[t["lr_rule"] == rule]
        for half in in_order("batch", rows.loc[rows["effective_batch"] == b, "batch"].unique()):
            half_rows = rows[(rows["effective_batch"] == b) & (rows["batch"] == half)]
            keyed.append(((rule, (b, half), base), paired(half_rows, rows[rows["effective_batch"] == base],
                                                          m.name, step)))
    return list(zip([k for k, _ in keyed], judge([d for _, d in keyed], m.margin)))


def per_batch(study: StudyRuns, m: Measure) -> list[str]:
    """For each B the study reached above the smallest: the LR rule of the best mean there with those that cannot
    be told from it (one family over every B's contrasts), its cost against the smallest B (the findings'
    family), and how to make B. Where the twins at a B were resolved apart, each half is picked on its own."""
    found = rule_comparisons(study.trials, m)
    if found is None:
        return []
    t, compared, verdicts = found
    twins = _twins(study, m)
    split = _split(twins)
    step = quantum(t[m.name])
    costs = _costs(t, compared, split, m, step) if split else []  # (a split B's halves; the rest as the findings)
    cost = {(rule, b): (base, v) for (rule, b, base, _), v in zip(compared, verdicts)}
    sizes = sorted(int(b) for b in t["effective_batch"].unique())
    gone = diverged(study.trials)
    picks = rules_at(t, sizes, m, step, gone, split)
    pooled, out, alone = _pooled(study, t), [], one_half(study.trials)
    ran = one_batch(study.trials)
    for b in sorted({*sizes[1:], *(bb for _, bb in gone if bb > sizes[0])}):
        before, oom = len(out), _out_of_memory(study.trials, b) + (f"; {alone[b]}" if b in alone else "")
        _line(b, t, study, m, gone, picks, costs, cost, split, twins, pooled, ran, out)
        out[before:] = [line[:-1] + oom + "." for line in out[before:]]
    return out


def _line(b: int, t: pd.DataFrame, study: StudyRuns, m: Measure, gone: dict, picks: dict, costs: list, cost: dict,
          split: frozenset, twins: list, pooled: str, ran: pd.DataFrame, out: list[str]) -> None:
    """B's line (or lines), appended to `out`."""
    why, at = unshared(t, b, gone), picks.get(b)
    rules = in_order("lr_rule", ran.loc[ran["effective_batch"] == b, "lr_rule"].dropna().unique())
    if rules and all((r, b) in gone for r in rules):  # (no rule to pick: said, not left out)
        out.append(f"At B = {b}{pooled}: every LR rule {stopped_verb(stopped_in(study.trials))} in a seed "
                   f"({listed([went(r, gone[(r, b)]) for r in rules])}), so none is picked there.")
        return
    if why:
        out.append(f"At B = {b}{pooled}: {why}.")
    if (halves := _halves(t, b, picks, costs, m, pooled)) is not None:
        out.append(halves[:-1] + _batching(t, None, b, twins, m) + ".")
        return
    if b in split:  # (no half with rules to pick from: a pick over both would hold for neither)
        out.append(f"At B = {b}{pooled}: accumulation and the true batch were resolved apart, and neither half "
                   f"has 2 LR rules finished in 2 shared seeds to pick from{_batching(t, None, b, twins, m)}.")
        return
    if at is None:
        return
    if (at.best, b) not in cost:  # (the pick's own smallest B: nothing below it to cost against)
        out.append(f"At B = {b}{pooled}: {_which(at, m)}; B = {b} is the smallest B the {at.best} LR rule ran, "
                   f"so what it costs against a smaller B is not measured{_batching(t, at.best, b, twins, m)}.")
        return
    base, v = cost[(at.best, b)]
    against = (stated(v.d, m=m, v=v) if v is not None else
               f"cannot be compared: the {at.best} LR rule ran no seed at both Bs")
    out.append(f"At B = {b}{pooled}: {_which(at, m)}; against B = {base}: {against}"
               f"{_batching(t, at.best, b, twins, m)}.")


THAT_SEED, THOSE_SEEDS = "that seed's value", "those seeds' values"


def _out_of_memory(trials: pd.DataFrame, b: int) -> str:
    """Where the true batch at B ran out of memory in every seed: that accumulation is how B is reached; where a
    half at B is missing in some seeds only (out of memory, an error), that those seeds' values at B are the other
    half alone (each seed's runs at B are averaged)."""
    if not {"reason", "seed", "accum_steps"} <= set(trials):
        return ""
    true = one_batch(trials)
    true = true[(true["effective_batch"] == b) & (true["accum_steps"] == 1)]
    oom = sorted(int(s) for s in true.loc[true["reason"] == "oom", "seed"].unique())
    if oom and set(oom) >= set(true["seed"]):
        return (f"; the true batch (b = {b}, k = 1) ran out of memory here in every seed: accumulation is how B is "
                f"reached")
    return "".join(f"; {x}, so every seed's value at B is the {half} half alone" if every else
                   f"; {x}, so {THAT_SEED if n == 1 else THOSE_SEEDS} at B "
                   f"{'is' if n == 1 else 'are'} the {half} half alone, the other seeds' the mean of both halves"
                   for x, n, half, every in missing_halves(trials, b))


def _gap(trials: pd.DataFrame, rule: str, b: int, gone: dict) -> str:
    """Why a rule's B is not compared with its smallest B: it diverged in a seed, finished in one seed, or none."""
    if (rule, b) in gone:
        return f"at B = {b} {went(rule, gone[(rule, b)])}"
    ran = one_batch(trials)
    ran = ran[(ran["lr_rule"] == rule) & (ran["effective_batch"] == b)]
    done = finished(ran)["seed"].nunique() if "seed" in ran else 0
    of = f" of the {ran['seed'].nunique()} it ran" if "seed" in ran and ran["seed"].nunique() > done else ""
    if done == 1:
        return f"B = {b} finished in only 1 seed{of}, which cannot be told from seed noise"
    return f"B = {b} finished no trial to compare" if not done else f"B = {b} shares fewer than 2 seeds with the smallest B"


def largest_free(study: StudyRuns, m: Measure) -> list[str]:
    """The largest B shown to cost less than the margin against the smallest B (equivalent within it, or resolved
    better, there and at every B the rule ran below it: a B none of whose trials finished breaks the run), or that
    none was, and which came nearest. Equivalence shows a cost below the margin, never none: an interval that
    excludes 0 is not 0."""
    found = rule_comparisons(study.trials, m)
    if found is None:
        return []
    t, compared, verdicts = found
    judged = _worse_half(t, [(r, b, base, v) for (r, b, base, _), v in zip(compared, verdicts)], study, m)
    judged = [x for x in judged if x[3] is not None and x[3].d.n >= 2]
    tried = one_batch(study.trials)
    ends, broken, runs = [], {}, []  # each rule's largest B shown free, and every B in such a run
    for rule in dict.fromkeys(r for r, *_ in judged):
        mine = {x[1]: x for x in judged if x[0] == rule}
        ran = pd.to_numeric(tried.loc[tried["lr_rule"] == rule, "effective_batch"], errors="coerce").dropna()
        free = []
        for b in sorted(int(b) for b in ran.unique() if b > next(iter(mine.values()))[2]):
            x = mine.get(b)
            if x is None or not _costs_little(x[3], m):
                broken[rule] = b if x is None else None
                break
            free.append(x)
        if free:
            ends.append(free[-1])
        runs += free
    # (a B shown to cost little above one that was not is no run from the smallest B: named, not picked)
    above = [f"B = {x[1]} under the {x[0]} LR rule ({stated(x[3].d, m=m, v=x[3])}{_half(x)})" for x in judged
             if _costs_little(x[3], m) and x not in runs]
    above = f"; shown to {m.costs_little}, but above a B of its rule that was not: {'; '.join(above)}" \
        if above else ""
    top = max((x[1] for x in ends), default=None)
    if top is not None:  # (rules that reach the same largest B are each named: the one listed first is no pick)
        said = []
        for shown_free in [x for x in ends if x[1] == top]:
            rule, b, base, v = shown_free
            between = ", and every B between them too" if any(x[0] == rule and x[1] < b for x in judged) else ""
            gap = f"; {_gap(study.trials, rule, broken[rule], diverged(study.trials))}" if broken.get(rule) else ""
            said.append(f"under the {rule} LR rule, {stated(v.d, m=m, v=v)} against B = {base}{_half(shown_free)}"
                        f"{between}{gap}")
        # ("together with every B below it": a B shown to cost little above one that was not is named after it)
        return [f"The largest B shown to {m.costs_little} together with every B below it: B = {top} "
                + "; and ".join(said) + above + "."]
    costly = [x for x in judged if not _costs_little(x[3], m)]
    if not costly:  # (each rule's run broken by a B with no comparison below those shown to cost little)
        gaps = "; ".join(f"{r} {_gap(study.trials, r, b, diverged(study.trials))}" for r, b in broken.items() if b)
        return [f"No B above the smallest was shown to {m.costs_little} together with every B below it: "
                f"{gaps or 'no B was compared'}."]
    nearest = min(costly, key=lambda x: abs(x[3].d.mean) + x[3].d.half)
    rule, b, base, v = nearest
    how = f" (its whole 95% interval {m.within}, or better than the smallest B's)" if m.margin else ""
    return [f"No B above the smallest was shown to {m.costs_little}{how} together with every B below it; the nearest "
            f"was B = {b} "
            f"under the {rule} LR rule against B = {base}: {stated(v.d, m=m, v=v)}{_half(nearest)}{above}."]


class _Cost(tuple):
    """(rule, B, smallest B, verdict), with the half of B it speaks of where the twins there were resolved apart."""
    half: str = ""


def _half(x) -> str:
    return f" (in its {x.half} half: accumulation and the true batch were resolved apart there)" if \
        getattr(x, "half", "") else ""


def _worse_half(t: pd.DataFrame, judged: list, study: StudyRuns, m: Measure) -> list:
    """Where accumulation and its twin were resolved apart at a B, a cost pooled over both halves holds for
    neither: that B costs what its worse half costs (the block's per-half family, as its per-B line says)."""
    split = _split(_twins(study, m))
    if not split:
        return judged
    halves = {}
    for (rule, key, base), v in _costs(t, [(r, b, base, v.d if v else None) for r, b, base, v in judged], split, m,
                                       quantum(t[m.name])):
        if isinstance(key, tuple):
            halves.setdefault((rule, key[0]), []).append((key[1], base, v))
    out = []
    for rule, b, base, v in judged:
        found = halves.get((rule, b))
        if not found or any(x is None for *_, x in found):
            out.append(_Cost((rule, b, base, v)))
            continue
        half, base, v = min(found, key=lambda x: (_costs_little(x[2], m), -abs(x[2].d.mean) - x[2].d.half))
        cost = _Cost((rule, b, base, v))
        cost.half = half
        out.append(cost)
    return out


def _twins(study: StudyRuns, m: Measure) -> list:
    """Each twin pair's key and verdict, keyed by every rule varied (one verdict per BN rule, none overwritten)."""
    pairs = twin_pairs(study.trials, m)
    return [(key, v) for (key, _), v in zip(pairs, judge([d for _, d in pairs], m.margin))]


def _split(twins: list) -> frozenset:
    """The Bs where accumulation and its true-batch twin were resolved apart (under any rule)."""
    return frozenset(key["effective_batch"] for key, v in twins if v is not None and v.resolved)


def _costs_little(v, m: Measure) -> bool:
    """Shown to cost less than the margin: the whole interval inside it, or resolved better than the smallest B."""
    return v.equivalent or (v.resolved and not m.worse(v.d))
