"""Steps and samples to a target accuracy: against B, fitted for the critical batch beside the noise scale at the
target (critical.py), and each batch-size warmup against a fixed B, paired by seed. The target
(target(), which the times to the target count to as well) is TARGET_SHARE of the highest mean final accuracy of an
LR rule at a B, on the accuracy's own scale."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from . import critical
from .measures import NOT_SETTINGS, WORSE, bn_rules_apart, finished, full_scale, one_batch, tuned
from .plotting import in_order
from .runs import TARGET_SHARE, aggregate, paired, reached, resolution
from .verdicts import Verdict, control, judge
from .wording import listed, percent, signed_end, stated


@dataclass
class Series:
    """One series' runs to the target (an LR rule's, a BN momentum rule's, or every run), as the findings and the
    figure both count them."""
    group: tuple
    rows: pd.DataFrame  # every run counted at each B: steps (samples) NaN where it never reached the target
    kept: pd.DataFrame  # the runs that reached it at the Bs where more than half did
    lost: dict[int, tuple[int, int, int]]  # per B where half or more did not: (never reached it, diverged, runs)
    out_of_fit: list[int]  # the B of each run that did not reach it at a B where most did: in the medians only
    dropped: dict[int, int]  # runs pruned before they reached it, left out where they would move a B's median
    diverged: dict[int, tuple[int, int]]  # per B where most reached it: (runs that diverged, runs), in neither

    def medians(self, column: str) -> pd.Series:
        """Per B where most runs reached the target, the median `column`, a run that did not counted as slower
        than every one that did (as critical.reading's doublings count it) and one that diverged left out."""
        at = self.rows[self.rows["effective_batch"].isin(self.kept["effective_batch"]) & ~self.rows["diverged"]]
        return at[column].fillna(math.inf).groupby(at["effective_batch"]).median()

    def fit(self) -> critical.Fit | None:
        return critical.critical(self.kept[~self.kept["effective_batch"].isin(self.out_of_fit)])


@dataclass
class ToTarget:
    goal: float
    of: str  # what the target is of, in words
    tuned: str  # how the LR was picked per B where base_lr was searched, in words ("" where not)
    keys: list[str]
    series: list[Series]


def to_target(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None) -> ToTarget | None:
    """Every run's steps to the target (target()) by series and B; None where the study has fewer than 3 Bs or no
    history of steps and accuracy."""
    t = one_batch(finished(trials))
    if "effective_batch" not in t or t["effective_batch"].nunique() < 3:
        return None
    if history.empty or not {"steps", "val_acc"} <= set(history) or "seed" not in t:
        return None
    found = target(trials)
    if found is None:
        return None
    keys = [c for c in ("lr_rule", "bn_momentum_rule") if c in t and t[c].nunique() > 1
            and (c != "bn_momentum_rule" or bn_rules_apart(t))]  # (a model without BatchNorm: its series as kept)
    searched = ["base_lr"] if tuned(t) else []
    worse = one_batch(trials[trials["reason"].isin(WORSE)]) if "reason" in trials else t.iloc[0:0].assign(reason="")
    tied = _tied(t, keys)
    at = ["accum_steps"] if "accum_steps" in t else []
    runs = _every_run(t, worse, ["run_id", "seed", *keys, "effective_batch", *searched, *at, *tied], history, found[0],
                      evals)
    runs = _shared_at_one(runs, keys, tied)
    note = ""
    if searched:  # Shallue et al.: at each B, the LR that reached the target in the fewest steps
        runs, note = _tuned_per_b(runs, keys, t["base_lr"].nunique())
    groups = list(runs.groupby(keys)) if keys else [(("",), runs)]
    if len(keys) == 1:  # the rules in their own order, as the figures draw them
        order = in_order(keys[0], runs[keys[0]])
        groups.sort(key=lambda g: order.index(g[0][0]))
    return ToTarget(*found, note, keys, [_series(g if isinstance(g, tuple) else (g,), rows) for g, rows in groups])


def _tied(t: pd.DataFrame, keys: list[str]) -> list[str]:
    """The fields that moved with the BN momentum rule (a study that zips it with the weight decay): at k > 1 each
    rule's runs hold one value of it, not every rule the same, and every run at k = 1 holds one of those values."""
    if "bn_momentum_rule" not in keys or "accum_steps" not in t:
        return []
    up, one = t[(t["accum_steps"] > 1) & t["bn_momentum_rule"].notna()], t[t["accum_steps"] == 1]
    skip = {*NOT_SETTINGS, *keys, "physical_batch", "accum_steps"}
    return [c for c in t if c not in skip and up[c].nunique() > 1 and one[c].isin(set(up[c])).all()
            and (up.groupby("bn_momentum_rule")[c].nunique(dropna=False) == 1).all()]


TRUE_BATCH = "true batch"  # the series of the true batches at each B beside the BN rules' (_shared_at_one)


def true_batch_arm(series: Series) -> str | None:
    """Where `series` is the true batches' (_shared_at_one), the BN rule whose settings it holds ('' where every
    rule's); None for any other series."""
    name = str(series.group[-1])
    if not name.startswith(TRUE_BATCH):
        return None
    return name.removeprefix(f"{TRUE_BATCH} at ").removesuffix("'s settings") if name != TRUE_BATCH else ""


def _shared_at_one(runs: pd.DataFrame, keys: list[str], tied: list[str]) -> pd.DataFrame:
    """At k = 1 every BN momentum rule sets the default momentum (the grid runs k = 1 under default alone, or under
    each rule alike: one run, counted once). The runs at k = 1 at the b a rule accumulates from (B = b, where its
    series starts) count in the series of each rule whose runs at k > 1 hold their values of the other keys and of
    the `tied` fields (a rule zipped with the weight decay: its own). Every run at k = 1, those at B = b and the true
    batches at a larger B that no rule accumulated, is also a series of its own (TRUE_BATCH; one per arm where
    fields are tied), so that a rule's point at a B is its own accumulated runs, not a blend with the true batch's.
    A run at k = 1 that matches no rule stays under its label."""
    if "bn_momentum_rule" not in keys or "accum_steps" not in runs:
        return runs
    one = runs["accum_steps"] == 1
    up = runs[~one & runs["bn_momentum_rule"].notna()]
    match = [c for c in (*keys, *tied) if c != "bn_momentum_rule"]
    arms = up[[*match, "bn_momentum_rule"]].drop_duplicates()
    if arms.empty or not one.any():
        return runs
    # A run at k = 1 filed under each rule's label is one run, counted once: in each (seed, B, other keys) cell the
    # runs under its first label are kept, every one of them (runs apart in a field not here: models, weight decays).
    cell = ["seed", *match, "effective_batch"]
    order = {r: i for i, r in enumerate(in_order("bn_momentum_rule", runs["bn_momentum_rule"].dropna()))}
    ones = runs[one].assign(_first=runs.loc[one, "bn_momentum_rule"].map(order))
    ones = ones[ones["_first"].isna() | (ones["_first"] == ones.groupby(cell, dropna=False)["_first"].transform("min"))]
    ones = ones.drop(columns=["bn_momentum_rule", "_first"])
    joined = ones.merge(arms, on=match) if match else ones.merge(arms, how="cross")
    # (each rule's own b: a rule that accumulates from b = 128 does not start at B = 32)
    starts = set(zip(*(up[c] for c in (*match, "bn_momentum_rule")), up["effective_batch"] // up["accum_steps"]))
    base = [key in starts for key in zip(*(joined[c] for c in (*match, "bn_momentum_rule")), joined["effective_batch"])]
    true = joined.assign(bn_momentum_rule=joined["bn_momentum_rule"].map(
        lambda rule: f"{TRUE_BATCH} at {rule}'s settings" if tied else TRUE_BATCH)).drop_duplicates(
        ["run_id", "bn_momentum_rule"])
    # (a true batch at one B alone has no steps against B to read: no series)
    true = true[true.groupby("bn_momentum_rule")["effective_batch"].transform("nunique") > 1]
    alone = runs[one & ~runs[cell].apply(tuple, axis=1).isin(set(joined[cell].apply(tuple, axis=1)))]
    return pd.concat([runs[~one], joined[base], true, alone], ignore_index=True)


def _series(group: tuple, rows: pd.DataFrame) -> Series:
    rows, dropped = _censored(rows)
    runs_at = rows.groupby("effective_batch")
    counted = runs_at["steps"].apply(lambda s: s.notna().sum() * 2 > len(s))
    kept = rows[rows["effective_batch"].isin(counted[counted].index) & rows["steps"].notna()]
    lost = {int(b): (int((g["steps"].isna() & ~g["diverged"]).sum()), int(g["diverged"].sum()), len(g))
            for b, g in runs_at if not counted[b]}
    # (a run that never reached the target at a B whose others did keeps that B out of the fit; one that diverged
    # took no steps to it at all, so it is counted apart and its B stays in)
    at = rows[rows["effective_batch"].isin(counted[counted].index) & rows["steps"].isna()]
    diverged = {int(b): (int(g["diverged"].sum()), len(g)) for b, g in runs_at
                if counted[b] and g["diverged"].any()}
    return Series(group, rows, kept, lost, at.loc[~at["diverged"], "effective_batch"].astype(int).tolist(), dropped,
                  diverged)


def steps(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None) -> list[str]:
    """Steps to the target accuracy against B, every run at a B one point, fitted for the critical batch beside
    the noise scale at the target (critical.py)."""
    found = to_target(trials, history, evals)
    if found is None:
        return []
    t = one_batch(finished(trials))
    noise = critical.noise_at_target(t, history, found.goal)
    both = "accum_steps" in t and (t["accum_steps"] > 1).any() and (t["accum_steps"] == 1).any()
    alike = ", accumulated and true batch alike" if both else ""
    if any(true_batch_arm(s) is not None for s in found.series):  # (BN rules: _shared_at_one)
        rules = [s for s in found.series if true_batch_arm(s) is None]
        bare = [" / ".join(map(str, s.group)) for s in rules if not (s.rows["accum_steps"] == 1).any()]
        beside = ("alone (no run at k = 1 at the b they accumulate from)" if len(bare) == len(rules) else
                  "beside the runs at k = 1 where they start" + (
                      f" ({listed(bare)}: none at {'its' if len(bare) == 1 else 'their'} b)" if bare else ""))
        alike = f", each BN momentum rule's accumulated runs {beside}, the true batches (k = 1) a series of their own"
    out = [f"Steps to reach {percent(found.goal, full_scale(t['val_acc']))} validation accuracy "
           f"({found.of}; {resolution(t, evals)}{found.tuned}), each "
           f"run that reached it one point{alike}, fitted by S = S_min (1 + B_crit / B) "
           f"(McCandlish et al. 2018; least squares on log steps), beside the gradient noise scale at the end of the "
           f"epoch in which each run reached it."]
    for s in found.series:
        name = f"For {listed([str(g) for g in s.group])}" if found.keys else "Over every run"
        if found.keys and len(s.group) > 1 and true_batch_arm(s) is not None:  # ('linear and true batch')
            name = f"For the {s.group[-1]} under {listed([str(g) for g in s.group[:-1]])}"
        pruned = (s.rows["pruned_at"].notna() & s.rows["effective_batch"].isin(s.lost)).any()
        left = [f"{_lost(s.lost, pruned)}: half or more, left out of the fit"] if s.lost else []
        if s.diverged:
            left.append(listed([f"{d} of {runs} at B = {b}" for b, (d, runs) in sorted(s.diverged.items())]) +
                        " diverged, left out of the median and the fit: a divergence says nothing of the steps to the "
                        "target")
        left = f" ({'; '.join(left)})" if left else ""
        if s.kept.empty:
            out.append(f"{name}, no B had most of its runs reach it{left}.")
            continue
        fitted = noise[noise["run_id"].isin(s.kept.loc[~s.kept["effective_batch"].isin(s.out_of_fit), "run_id"])]
        out.append(f"{name}{left}, {critical.reading(s.kept, fitted, s.lost, s.out_of_fit, s.diverged)}"
                   f"{_open(s.dropped, 'median steps')}.")
    return out


def _lost(lost: dict[int, tuple[int, int, int]], pruned: bool) -> str:
    """Per B left out, how many runs never reached the target and how many diverged, counted apart (a divergence
    says nothing of the steps a run would have taken)."""
    how = " or pruned first" if pruned else ""  # (';' between the Bs: an item may hold 'and' itself)
    return "; ".join([f"at B = {b}, " + " and ".join(
        ([f"{never} of {runs} runs never reached it{how}"] if never else []) +
        ([f"{diverged} diverged" if never else f"{diverged} of {runs} runs diverged"] if diverged else []))
        for b, (never, diverged, runs) in lost.items()])


def target(trials: pd.DataFrame, metric: str = "val_acc") -> tuple[float, str] | None:
    """The value of `metric` (validation accuracy, or a study's own objective to maximize) that steps and times to
    the target count to, and what it is of in words: TARGET_SHARE of the highest mean final value over the seeds of
    an LR rule (BN momentum rule, base_lr searched) at a B, every run there counted, accumulated and true batch
    alike. None without a finished run at one B."""
    t = one_batch(finished(trials))
    if "effective_batch" not in t or metric not in t:
        return None
    keys = [c for c in ("lr_rule", "bn_momentum_rule", "base_lr") if c in t and t[c].nunique() > 1
            and (c != "base_lr" or tuned(t)) and (c != "bn_momentum_rule" or bn_rules_apart(t))]
    finals = aggregate(t, [*keys, "effective_batch"], metric)
    if finals.empty:
        return None
    names = {"lr_rule": "an LR rule", "bn_momentum_rule": "a BN momentum rule", "base_lr": "a base_lr"}
    of = f"{listed([names[k] for k in keys])} at a B" if keys else "a B"
    return (TARGET_SHARE * float(finals["mean"].max()),
            f"{100 * TARGET_SHARE:.0f}% of the highest mean final {'accuracy' if metric == 'val_acc' else metric} of "
            f"{of}, over the seeds, every run there counted")


def _every_run(t: pd.DataFrame, worse: pd.DataFrame, columns: list[str], history: pd.DataFrame, target: float,
               evals: pd.DataFrame | None) -> pd.DataFrame:
    """The finished runs (`t`) and those that ended worse, each with the steps it reached the target at (NaN where
    it did not; `diverged` marks a run that diverged, which took no steps to it at all). A run pruned before it
    reached it is censored at its last evaluation (`pruned_at`): slower than the runs that reached it by then, and
    where it stands against the rest is not known."""
    runs = t[columns].merge(reached(t, history, target, evals), on="run_id")
    pruned = worse[worse["reason"] == "pruned"]
    cut = pruned[columns].merge(reached(pruned, history, target, evals), on="run_id")
    cut["pruned_at"] = cut["run_id"].map(_last_step(history, evals)).fillna(0.0).where(cut["steps"].isna())
    runs = pd.concat([runs.assign(diverged=False), cut.assign(diverged=False),
                      worse.loc[worse["reason"] != "pruned", columns].assign(steps=math.nan, diverged=True)])
    return runs.assign(pruned_at=pd.to_numeric(runs["pruned_at"], errors="coerce"))  # (a column of no run is text)


def _tuned_per_b(runs: pd.DataFrame, keys: list[str], searched: int) -> tuple[pd.DataFrame, str]:
    """At each B (of each series of `keys`) the runs of the base_lr that reached the target in the fewest steps, a
    run that never did counted as slower than every one that did (a median over those that reached it would pick
    an LR that reached it in one seed of three), and the note that says so."""
    picked, open_at = [], {}
    for at, g in runs.groupby([*keys, "effective_batch"]):
        fastest, known = _fastest(g)
        if not known:  # (the pruned runs could rank anywhere the pick turns on: ranked without them)
            open_at[int(at[-1] if isinstance(at, tuple) else at)] = int(g["pruned_at"].notna().sum())
            g = g[g["pruned_at"].isna()]
            if g.empty:
                continue
            fastest, _ = _fastest(g)
        picked.append(g[g["base_lr"] == fastest])
    cut_short = (", and one pruned before it did as slower only than those that reached it before it was pruned"
                 if runs["pruned_at"].notna().any() else "")
    runs = pd.concat(picked)
    return runs, (f"; at each B the base_lr whose runs reached it in the fewest steps (median), a run that never "
                  f"did counted as slower than every one that did{cut_short} (Shallue et al. 2018: the LR tuned "
                  f"per B, {runs['base_lr'].nunique()} of the {searched} searched)" + _open(open_at))


def _last_step(history: pd.DataFrame, evals: pd.DataFrame | None) -> pd.Series:
    """Per run_id, the steps at its last evaluation: where a pruned run was last seen short of the target."""
    seen = [history[["run_id", "steps"]]]
    if evals is not None and {"run_id", "step"} <= set(evals):
        seen.append(evals[["run_id", "step"]].rename(columns={"step": "steps"}))
    return pd.concat(seen).groupby("run_id")["steps"].max()


def _medians(g: pd.DataFrame) -> tuple[float, float]:
    """The median steps of `g`'s runs with each pruned run at the step it was pruned and with it never reaching the
    target: the least and the most its median can be."""
    never = g["steps"].fillna(math.inf)
    return float(g["steps"].fillna(g["pruned_at"]).fillna(math.inf).median()), float(never.median())


def _fastest(g: pd.DataFrame) -> tuple[float, bool]:
    """The base_lr of `g` (one B's runs) whose median steps is the least, and whether that holds wherever its pruned
    runs would have reached the target: its most is no more than every other base_lr's least."""
    bounds = {lr: _medians(runs) for lr, runs in g.groupby("base_lr")}
    best = min(bounds, key=lambda lr: bounds[lr][1])
    return best, all(bounds[best][1] <= least for lr, (least, _) in bounds.items() if lr != best)


def _censored(rows: pd.DataFrame) -> tuple[pd.DataFrame, dict[int, int]]:
    """A series' runs with those pruned before they reached the target kept as runs that never did where that
    leaves their B's median as it is, wherever they would have reached it, and otherwise left out (counted by B)."""
    dropped, kept = {}, []
    for b, g in rows.groupby("effective_batch"):
        least, most = _medians(g[~g["diverged"]])  # (a diverged run is in no median)
        if least != most and g["pruned_at"].notna().any():
            dropped[int(b)] = int(g["pruned_at"].notna().sum())
            g = g[g["pruned_at"].isna()]
        kept.append(g)
    return pd.concat(kept), dropped


def _open(counts: dict[int, int], what: str = "base_lr ranking") -> str:
    """The runs pruned before they reached the target that were left out, where where they would stand is not
    known."""
    if not counts:
        return ""
    n = sum(counts.values())
    at = listed([f"{c} at B = {b}" for b, c in sorted(counts.items())])
    return (f"; {n} run{'s' * (n > 1)} pruned before {'it' if n == 1 else 'they'} reached it left out of the {what} "
            f"({at}): where {'it' if n == 1 else 'they'} would stand against the runs that reached it later is not "
            f"known")


def _counted(v: Verdict | None, unit: str) -> str:
    """A paired difference of counts (steps, samples), stated only where it is resolved (verdicts.py)."""
    if v is None:
        return f"no seed reached the target in both, so no {unit} to compare"
    d = v.d
    if not v.resolved:
        why = f"; its own interval excludes 0, but it is {control(v)}" if d.separated else ""
        return f"not resolved ({d.mean:+,.0f} ± {d.half:,.0f} {unit} over {d.n} seed{'s' * (d.n > 1)}{why})"
    return (f"{d.mean:+,.0f} {unit}, 95% CI {signed_end(d.mean - d.half, 0)} to {signed_end(d.mean + d.half, 0)} "
            f"over {d.n} seeds")


def warmup(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None) -> list[str]:
    """Each batch-size warmup against a fixed B, paired by seed: the B it grows to and, when the study has it,
    the B it starts from; steps and samples to the target accuracy (one family for the false-discovery
    control, named once), and the final accuracy."""
    t = finished(trials)
    if "batch_warmup" not in t or history.empty:
        return []
    t = t.assign(batch_warmup=t["batch_warmup"].fillna("").astype(str))
    if not (t["batch_warmup"] == "").any() or t["batch_warmup"].nunique() < 2:
        return []
    target = TARGET_SHARE * float(aggregate(t, ["batch_warmup", "effective_batch"], "val_acc")["mean"].max())
    t = t.drop(columns=["steps", "samples"], errors="ignore").merge(reached(t, history, target, evals), on="run_id")
    fixed = {int(b): rows for b, rows in t[t["batch_warmup"] == ""].groupby("effective_batch")}
    growing = t["batch_warmup"].map(lambda w: len(set(w.split(","))) > 1)  # (a repeated B is a branch)
    arms = [(arm, rows, int(rows["effective_batch"].iloc[0]),
             [b for b in dict.fromkeys((int(rows["effective_batch"].iloc[0]), int(arm.split(",")[0]))) if b in fixed])
            for arm, rows in t[growing].groupby("batch_warmup")]
    counts = [paired(rows, fixed[b], unit) for _, rows, _, against in arms for b in against
              for unit in ("steps", "samples")]
    verdicts = iter(judge(counts, 0.0))
    kept = (f" (steps and samples stated where Benjamini-Hochberg at 5% over their {len(counts)} comparisons "
            f"keeps them)") if len(counts) > 1 else ""
    out = []
    for arm, rows, end, against in arms:
        said = [f"against a fixed B = {b}: {_counted(next(verdicts), 'steps')}; {_counted(next(verdicts), 'samples')}; "
                f"final accuracy {stated(paired(rows, fixed[b], 'val_acc'), 'higher with warmup', 'lower with warmup')}"
                for b in against]
        if said:
            out.append(f"Batch-size warmup (B = {arm.replace(',', ', ')} in the first epochs, then {end}), to "
                       f"{percent(target, full_scale(t['val_acc']))} validation accuracy ({100 * TARGET_SHARE:.0f}% of "
                       f"the best mean; {resolution(t, evals)}){kept}, " + "; and ".join(said) + ".")
    return out
