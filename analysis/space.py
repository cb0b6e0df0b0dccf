"""How the trials spread over what the study varied: which field mattered (fANOVA importance), every trial
over every field (parallel coordinates), and the best configurations for a memory or time budget (Pareto
fronts). Each figure comes with one sentence, its finding.

Importance is fANOVA's (Optuna's FanovaImportanceEvaluator, Hutter et al. 2014): a random forest fitted to
the objective, whose variance it splits among the fields. It uses every finished trial, which suits grids
where every combination is present, and needs no choice of what counts as a good trial; PED-ANOVA compares
the top 10% of trials with the rest, a handful of trials in a study of 27 to 81.
"""
from __future__ import annotations

import math
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from batchsweep.sweeps import commands

from . import targets
from .best import (EVERY_BN, EVERY_RULE, SHORT, accounted, below_per_b, choices, diverged_in_a_seed, highest, label,
                   naming, not_compared, of, one_at_base, per_configuration, per_seed, picked, settled_by, shown_value,
                   stopped_in, ties, without)
from .findings import one_bn_rule
from .measures import Measure, finished, group_keys, group_label, measure, stopped_verb
from .plotting import Draw, Figure, context, in_order, log_scale
from .runs import TARGET_SHARE, StudyRuns, ci95

MIN_IMPORTANCE_TRIALS = 10  # fewer finished trials say nothing about which field mattered
MIB = 2 ** 20


def objective_trials(study: StudyRuns) -> pd.DataFrame:
    """Finished trials whose objective values are all finite."""
    t = finished(study.trials)
    metrics = [m for m, _ in study.objectives]
    if not set(metrics) <= set(t):
        return t.iloc[0:0]
    return t[np.isfinite(t[metrics].astype(float)).all(axis=1)]


def counted(study: StudyRuns, t: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """`t`'s runs as the findings count them (findings.one_bn_rule, per group as they group the study): a model
    without BatchNorm has its runs under the BN momentum rules, identical, once (one per seed), not as a
    configuration per rule; with the words that say so ('' where no run was left out). Which fields are choices is
    read before (best.choices): a rule left out for one model is no design that tied it to the model."""
    keys = group_keys(study.trials)
    groups = study.trials.groupby(keys) if keys else [((), study.trials)]
    varied = tuple(f for f in study.varied if f not in keys) if study.varied else study.varied
    kept, without = [], []
    for group, rows in groups:
        one = one_bn_rule(rows, varied)[0]
        kept += list(one.index)
        if len(one) < len(rows):
            without.append(group_label(keys, group) if keys else "the model")
    if not without:
        return t, ""
    one = len(without) == 1
    return t[t.index.isin(kept)], (f"{' and '.join(without)} {'has' if one else 'have'} no BatchNorm, so "
                                       f"{'its' if one else 'their'} runs under the BN momentum rules count as one "
                                       f"configuration, one run per configuration and seed")


def _fields(study: StudyRuns, t: pd.DataFrame) -> list[str]:
    return [f for f in study.varied if f in t and t[f].nunique() > 1]


def _is_number(column: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)


def _choices(column: pd.Series) -> list[str]:
    """A categorical field's values in a fixed order: the known rules' own order, else sorted."""
    return in_order(str(column.name), map(str, column.dropna().unique()))


def _log(values: pd.Series) -> bool:
    return bool((values > 0).all() and values.max() / values.min() >= 4)


def as_percent(metric: str, values: pd.Series) -> bool:
    """An accuracy logged as a fraction of 1, shown in percent (one logged in percent is shown as it is)."""
    return "acc" in metric and bool(values.between(0, 1).all())


def shown(mean: float, half: float = math.nan, percent: bool = False) -> str:
    scale, unit = (100, "%") if percent else (1, "")
    text = f"{scale * mean:.1f}" if percent else f"{mean:.4g}"
    if math.isfinite(half):
        text += f" ± {scale * half:.1f}" if percent else f" ± {half:.2g}"
    return text + unit


def importance(study: StudyRuns) -> Figure | None:
    """fANOVA importance of each varied field for each objective."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    from optuna.importance import FanovaImportanceEvaluator, get_param_importances

    t = objective_trials(study)
    fields, note = choices(study, t)
    t, once = counted(study, t)
    note += f"; {once}" if once else ""
    if len(t) < MIN_IMPORTANCE_TRIALS or len(fields) < 2:  # (one field takes all the variance: nothing to rank)
        return None
    distributions = {}
    for f in fields:
        column = t[f]
        if _is_number(column) and (column % 1 == 0).all():
            distributions[f] = IntDistribution(int(column.min()), int(column.max()), log=_log(column))
        elif _is_number(column):
            distributions[f] = FloatDistribution(float(column.min()), float(column.max()), log=_log(column))
        else:
            distributions[f] = CategoricalDistribution(_choices(column))
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rebuilt = optuna.create_study(directions=[d for _, d in study.objectives])
    trials = []
    for _, row in t.iterrows():
        params = {f: (int(row[f]) if isinstance(d, IntDistribution) else float(row[f])
                      if isinstance(d, FloatDistribution) else str(row[f])) for f, d in distributions.items()}
        trials.append((params, [float(row[m]) for m, _ in study.objectives]))
    # In one order, whatever order the workers finished them in: the seeded forest's bootstrap follows it.
    for params, values in sorted(trials, key=lambda trial: ([str(v) for v in trial[0].values()], trial[1])):
        rebuilt.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, values=values))
    metrics = [m for m, _ in study.objectives]
    shares = {m: get_param_importances(rebuilt, evaluator=FanovaImportanceEvaluator(seed=0),
                                       target=lambda trial, i=i: trial.values[i], normalize=True)
              for i, m in enumerate(metrics)}
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 0.5 + 0.45 * len(fields)), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        order = sorted(fields, key=lambda f: shares[m].get(f, 0.0))
        ax.barh(order, [shares[m].get(f, 0.0) for f in order], color="C0")
        ax.set(xlabel=f"share of the variance of {m} (fANOVA)", xlim=(0, 1))
    first = sorted(shares[metrics[0]].items(), key=lambda kv: -kv[1])
    ranked = "; then ".join(f"{f} ({share:.0%})" for f, share in first[1:3])
    finding = (f"Of the varied fields, {first[0][0]} mattered most for {metrics[0]}: {first[0][1]:.0%} of the "
               f"variance fANOVA attributes to single fields" + (f"; then {ranked}" if ranked else "")
               + f" (from {len(t)} finished trials{note}).")
    return Figure("importance", f"Which field mattered: fANOVA importance, from {len(t)} finished trials", fig,
                  context(t), finding)


def parallel_coordinates(study: StudyRuns) -> Figure | None:
    """Every finished trial as a line over the varied fields and the objectives, coloured by the first one."""
    t = objective_trials(study)
    fields, _ = choices(study, t)
    t = counted(study, t)[0]
    metrics = [m for m, _ in study.objectives]
    if len(t) < 2 or not fields:
        return None
    axes_names = fields + metrics
    positions, ticks = {}, {}
    for name in axes_names:
        column = t[name]
        if _is_number(column):
            values = column.astype(float)
            scaled = np.log(values) if _log(values) else values
            low, high = float(scaled.min()), float(scaled.max())
            positions[name] = (scaled - low) / (high - low) if high > low else scaled * 0 + 0.5
            shown_values = sorted(values.unique())
            if len(shown_values) > 6 or name in metrics:
                shown_values = [values.min(), values.max()]
            ticks[name] = [(float(((np.log(v) if _log(values) else v) - low) / (high - low)) if high > low else 0.5,
                            shown_value(v) if name not in metrics else f"{v:.4g}") for v in shown_values]
        else:
            names = _choices(column)
            step = 1 / (len(names) - 1) if len(names) > 1 else 0
            positions[name] = column.astype(str).map({c: i * step for i, c in enumerate(names)}).astype(float)
            ticks[name] = [(i * step if step else 0.5, c) for i, c in enumerate(names)]
    first, direction = study.objectives[0]
    colour = t[first].astype(float)
    cmap = plt.get_cmap("viridis" if direction == "maximize" else "viridis_r")
    norm = plt.Normalize(colour.min(), colour.max())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(axes_names)), 4.5))
    xs = np.arange(len(axes_names))
    best_last = colour.sort_values(ascending=direction == "maximize").index  # the best drawn on top
    jitter = np.random.default_rng(0)
    for i in best_last:
        ys = [positions[n][i] for n in axes_names]
        ys = np.array(ys) + jitter.uniform(-0.01, 0.01, len(ys))  # trials on the same values stay apart
        ax.plot(xs, ys, color=cmap(norm(colour[i])), alpha=0.6, linewidth=1)
    for x, name in zip(xs, axes_names):
        ax.axvline(x, color="#888", linewidth=0.8)
        for y, text in ticks[name]:
            ax.text(x + 0.03, y, text, fontsize=7, va="center")
    ax.set_xticks(xs, [SHORT.get(n, n) for n in axes_names])
    ax.set_yticks([])
    ax.set_ylim(-0.05, 1.05)
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=first)
    return Figure("parallel_coordinates", "Every finished trial over the varied fields and the objective", fig,
                  context(t))


def front(points: pd.DataFrame, cost: str, value: str, maximize: bool = True) -> pd.Series:
    """Whether each point is on the Pareto front: no other point is as cheap and as good, and cheaper or
    better."""
    c, v = points[cost].to_numpy(float), points[value].to_numpy(float)
    sign = 1 if maximize else -1
    on = []
    for i in range(len(points)):
        dominated = (c <= c[i]) & (sign * v >= sign * v[i]) & ((c < c[i]) | (sign * v > sign * v[i]))
        on.append(not dominated.any())
    return pd.Series(on, index=points.index)


def _front_figure(points: pd.DataFrame, fields: list[str], cost: str, value: str, cost_label: str,
                  percent: bool, maximize: bool, name: str, title: str, trials: pd.DataFrame,
                  finding: str) -> Figure:
    on = front(points, cost, value, maximize)
    scale = 100 if percent else 1
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter(points.loc[~on, cost], scale * points.loc[~on, value], color="C0", alpha=0.25, label="dominated")
    best = points[on].sort_values(cost).drop_duplicates([cost, value])  # equal configurations, one label
    # The front as the best value reachable within each cost: a staircase (the intervals are in the sentence).
    ax.step(best[cost], scale * best[value], where="post", color="C3")
    ax.scatter(best[cost], scale * best[value], color="C3", zorder=3, label="Pareto front")
    for _, row in best.iterrows():
        ax.annotate(label(row, fields), (row[cost], scale * row[value]), fontsize=7, xytext=(4, -10),
                    textcoords="offset points")
    ax.set(xlabel=cost_label, ylabel=f"{value}{', %' if percent else ''} (mean over seeds)")
    log_scale(ax, "x", points[cost])
    ax.legend(fontsize=8)
    return Figure(name, title, fig, context(trials), finding)


def _budget_sentence(study: StudyRuns, seeds: pd.DataFrame, points: pd.DataFrame, fields: list[str], cost: str,
                     value: str, percent: bool, maximize: bool, unit, against: str, gone: list[str], as_: str) -> str:
    """The configuration of the best mean (an exact tie of it settled by the cost), the set that cannot be told from
    it, and the cheapest of that set; every other configuration counted where it went (set apart by the per-B lines,
    resolved from it, not compared). `against` names the cost, so that the memory and time sentences read apart in
    the findings; `gone`, the configurations left out as `as_` ('diverged', 'pruned', 'diverged or pruned') in a
    seed."""
    points = points.sort_values(cost, kind="stable")  # (of an exact tie of the best mean, the cheapest first)
    tied, apart, resolved = ties(seeds, points, fields, value, maximize)
    top = tied.iloc[0]
    m = measure(study.trials, study.objectives[0])
    lower = below_per_b(study, m if m is not None and m.name == value else Measure(value, maximize), tied, fields)
    kept = tied[[label(row, fields) not in lower for _, row in tied.iterrows()]]
    cheap = kept.sort_values([cost, value], ascending=[True, not maximize]).iloc[0]
    compared = len(points) - 1 - len(apart)
    # (the seeds each comparison with the best paired: a configuration that lost a seed pairs fewer than the rest)
    paired = [int(n) for n in pd.concat([tied["shared"].iloc[1:], resolved["shared"]])] or [0]
    over = f"{min(paired)}" + (f" to {max(paired)}" if max(paired) > min(paired) else "")
    control = (f"paired by seed over {over} seeds, Benjamini-Hochberg at 5% over {compared} "
               f"comparison{'s' * (compared != 1)}")
    first = highest(seeds, points, fields, value, maximize)
    pick = picked(top, first, fields, len(points), maximize, label(first, fields))
    plain = not pick.startswith("resolved")  # (no contrast overturned the best mean)
    level = [x for x in first.get("level", []) if x not in lower] if plain else []
    what = against.removeprefix("peak ")
    named = settled_by(points, first, fields, cost, f"for the least {against} of them",
                       f"first in the order of {', then '.join(SHORT.get(f, f) for f in fields)}")
    even = (f"tied for the {'highest' if maximize else 'lowest'} mean with {'; '.join(level)}, and named {named}; "
            f"{'both' if len(level) == 1 else 'all'} " if level else "")
    why = (f"{even}picked as the {'highest, so biased upward' if maximize else 'lowest, so biased downward'}" if plain
           else pick)
    said = (f"Against {against}, the best{' mean' * plain} of the {len(points)} configurations"
            f"{f' that {stopped_verb(as_)} in no seed' * bool(gone)} was "
            f"{label(top, fields)} "
            f"({shown(top[value], percent=percent)}, at {unit(top[cost])}; {why}"
            f"{f'; left out as {as_} in a seed: ' + '; '.join(gone) if gone else ''})")
    said += not_compared(apart, fields)
    if compared and len(resolved) == compared and not resolved["better"].any():
        return said + (f"; every other configuration{' compared' * (not apart.empty)} was resolved "
                       f"{'below' if maximize else 'above'} it ({control}).")
    others = [label(row, fields) for _, row in kept.iloc[1:].iterrows() if label(row, fields) not in level]
    parts = accounted(others, lower, resolved, fields)
    said += "".join(f"; {p}" for p in parts if p) + (f"; {control}" if compared else "")
    if cheap[cost] < top[cost]:
        return said + (f"; the least {against} among it and its ties: {label(cheap, fields)} "
                       f"({shown(cheap[value], percent=percent)}) at {unit(cheap[cost])}.")
    return said + (f"; none of its ties needed less {what}." if len(kept) > 1 else ".")


def memory_front(study: StudyRuns) -> Figure | None:
    """The first objective against peak memory, per configuration."""
    t = objective_trials(study)
    fields = naming(study, t)
    t, once = counted(study, t)
    value, direction = study.objectives[0]
    if "peak_memory_bytes" not in t or not fields or len(t) < 2 or t["peak_memory_bytes"].isna().all():
        return None
    # Every finished trial ranks, as for the best line; a configuration's memory is the mean over the seeds that
    # measured it (dropping a trial with no memory ranked the rest on other seeds, and named another best).
    seeds = per_seed(one_at_base(t.assign(memory_mib=t["peak_memory_bytes"] / MIB), fields), fields,
                      [value, "memory_mib"])
    gone = diverged_in_a_seed(study.trials, fields)  # (their means are over the seeds that survived)
    seeds = without(seeds, fields, gone)
    points = per_configuration(seeds, fields, value, "memory_mib")
    unmeasured = points[points["memory_mib"].isna()]
    points, seeds = points[points["memory_mib"].notna()], without(seeds, fields, unmeasured)
    if len(points) < 2:
        return None
    percent, maximize = as_percent(value, t[value]), direction == "maximize"
    finding = _budget_sentence(study, seeds, points, fields, "memory_mib", value, percent, maximize,
                               lambda mib: f"{mib:,.1f} MiB of peak memory", "peak memory",
                               [label(row, fields) for _, row in gone.iterrows()], stopped_in(study.trials))
    if len(unmeasured):
        finding += (f" Left out, no peak memory measured in any seed: "
                    f"{'; '.join(label(row, fields) for _, row in unmeasured.iterrows())}.")
    finding += f" Of the runs counted: {once}." if once else ""
    return _front_figure(points, fields, "memory_mib", value, "peak memory, MiB", percent, maximize, "memory_front",
                         f"Pareto front: {value} against peak memory", t, finding)


def time_to_target(trials: pd.DataFrame, history: pd.DataFrame, metric: str, target: float) -> pd.Series | None:
    """Seconds of training and evaluation until each trial first reached `target`, NaN where it never did."""
    if history.empty or not {"epoch_time_s", metric} <= set(history):
        return None
    h = history[history["run_id"].isin(trials["run_id"])].sort_values(["run_id", "epoch"])
    h = h.assign(elapsed=h.groupby("run_id")["epoch_time_s"].cumsum())
    reached = h[h[metric] >= target].groupby("run_id")["elapsed"].min()
    return trials["run_id"].map(reached)


def identical_spread(t: pd.DataFrame, fields: list[str]) -> float | None:
    """How far apart the times of identical runs (one_at_base's copies: B = base_batch under each LR rule, k = 1
    under each BN momentum rule; one seed) came: what two measurements of one configuration differ by. None where
    the study holds no such runs."""
    if "seed" not in t:
        return None
    copy = pd.Series(False, index=t.index)
    for f, name in (("lr_rule", EVERY_RULE), ("bn_momentum_rule", EVERY_BN)):
        if f in fields:
            copy |= t[f] == name
    copies = t[copy & t["seconds"].notna()].groupby([*fields, "seed"], dropna=False)["seconds"]
    spread = (copies.max() - copies.min())[copies.size() > 1]
    return float(spread.max()) if len(spread) else None


def _timing_note(t: pd.DataFrame, fields: list[str], saving: float) -> str:
    """Times are one wall-clock measurement per run; identical runs show how far two measurements of one
    configuration lie apart, against which a saving is read."""
    said = " Each time is one wall-clock measurement of one run (a configuration's: the median over its seeds)"
    spread = identical_spread(t, fields)
    if spread is not None:
        which = [said for f, name, said in (("lr_rule", EVERY_RULE, "B = base_batch under each LR rule"),
                                            ("bn_momentum_rule", EVERY_BN, "k = 1 under each BN momentum rule"))
                 if f in fields and (t[f] == name).any()]
        said += f"; identical runs ({', or '.join(which)}, one seed) took times up to {spread:,.1f} s apart"
        if 0 < saving <= spread:
            said += f", more than the {saving:,.1f} s saved, so that saving is not resolved"
    return said + "."


def times(study: StudyRuns):
    """timed(), where at least two configurations have a median time to compare; else None."""
    found = timed(study)
    return None if found is None or len(found[2]) < 2 else found


def timed(study: StudyRuns):
    """Each configuration's median seconds to the target over its seeds, where most of them reached it: (trials
    with their seconds, per-seed rows, per-configuration points, fields, target, the configurations left out as
    diverged in a seed, those left out as not timed alone (each with whether its trials trained fused), those left
    out as never reaching the target in at least half their timed seeds, each with its count); None where the study
    has no accuracy to maximize or no epoch times. A seed that never reached the target counts in the median as
    slower than every seed that did (where such seeds are half or more, the median is one of them: no time); a trial
    with no epoch time of its own (fused: it logged its group's time; or none logged) is not timed, and a
    configuration with no seed timed is left out by label."""
    t = objective_trials(study)
    fields = naming(study, t)
    t = counted(study, t)[0]  # (the recommendation's time line passes runs already counted so: kept as they are)
    value, direction = study.objectives[0]
    if direction != "maximize" or not fields or len(t) < 2:
        return None
    # The target: the steps to the target's (targets.py) on the objective's own scale (a [program]'s score = 100 x
    # val_acc counts to 100 times the steps' accuracy), else, with no B to take it over, a share of the best
    # configuration's mean final value.
    one = targets.target(study.trials, value)
    target = one[0] if one else TARGET_SHARE * float(t.groupby(fields, dropna=False)[value].mean().max())
    seconds = time_to_target(t, study.history, value, target)
    if seconds is None:
        return None
    h = study.history
    alone = t["run_id"].map(h.groupby("run_id")["epoch_time_s"].count()).fillna(0).gt(0).to_numpy()
    # (a trial that logged its group's time trained fused; one that logged neither, no time at all)
    fused = t["run_id"].isin(h.loc[h["group_epoch_time_s"].notna(), "run_id"] if "group_epoch_time_s" in h else [])
    # (never reached: beyond every time, so the median is not moved by a seed that failed; not timed: NaN)
    censored = np.where(alone, seconds.fillna(np.inf).to_numpy(), np.nan)
    t = one_at_base(t.assign(seconds=seconds.values, _censored=censored, _fused=fused.astype(float).values), fields)
    # A configuration counts when most of its timed seeds reached the target; its time is their median.
    gone = diverged_in_a_seed(study.trials, fields)  # (a diverged seed never reached it: no median over the rest)
    seeds = per_seed(t, fields, [value, "seconds", "_censored", "_fused"])
    untimed_gone = without(gone, fields, seeds[seeds["_censored"].notna()])  # (one never timed is said untimed)
    gone = gone.drop(untimed_gone.index)
    seeds = without(seeds, fields, gone)
    rows, untimed, late = [], [], []
    for key, g in seeds.groupby(fields, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        clock = g["_censored"].dropna()
        if clock.empty:
            untimed.append((label(dict(zip(fields, key)), fields), bool(g["_fused"].max() > 0)))
        elif np.isfinite(clock).sum() * 2 > len(clock):
            rows.append({**dict(zip(fields, key)), value: g[value].mean(), "half": ci95(g[value]),
                         "seconds": float(clock.median())})
        else:
            late.append(f"{label(dict(zip(fields, key)), fields)} (in {int(np.isinf(clock).sum())} of {len(clock)} "
                        f"seeds{' timed' * (len(clock) < len(g))})")
    points = pd.DataFrame(rows)
    gone = [label(row, fields) for _, row in gone.iterrows()]
    return t, seeds, points, fields, target, gone, untimed, late


def never_reached(late: list[str]) -> str:
    """'; N configurations have no median time, …', for times()'s configurations that never reached the target
    in at least half their timed seeds; '' where none."""
    if not late:
        return ""
    one = len(late) == 1
    return (f"; {len(late)} configuration{'s' * (not one)} {'has' if one else 'have'} no median time, having never "
            f"reached the target in at least half {'its' if one else 'their'} timed seeds: {'; '.join(late)}")


def not_timed(study: StudyRuns, untimed: list[tuple[str, bool]], shown: int = 5) -> str:
    """'; N configurations not timed, …', for times()'s configurations with no time of their own: those whose
    trials trained fused (each logged its group's time, not its own), with the command that times them, and those
    that logged no epoch time at all (--no-fuse would not time them); '' where every configuration was timed."""
    said = ""
    for fused, why in ((True, "{its} trials trained fused (several at once in one process, each logging its "
                               "group's time, not its own)"),
                       (False, "no epoch time logged for {its} trials")):
        names = [name for name, f in untimed if f == fused]
        if not names:
            continue
        one = len(names) == 1
        said += (f"; {len(names)} configuration{'s' * (not one)} not timed, {why.format(its='its' if one else 'their')}"
                 f": {'; '.join(names[:shown])}{'; …' * (len(names) > shown)}")
        if fused:
            said += (f"; `{commands.command('run')} {study.run_as or '--study ' + study.name} --no-fuse` in a new "
                     f"folder times each trial alone")
    return said


def time_front(study: StudyRuns) -> Figure | None:
    """The first objective (an accuracy to maximize) against the time to reach the target."""
    found = times(study)
    if found is None:
        return None
    t, seeds, points, fields, target, gone, untimed, late = found
    value = study.objectives[0][0]
    kept = pd.Series(False, index=seeds.index)
    for _, row in points.iterrows():
        kept |= of(seeds, fields, row)
    percent = as_percent(value, t[value])
    target_text = shown(target, percent=percent)
    finding = _budget_sentence(study, seeds[kept], points, fields, "seconds", value, percent, True,
                               lambda s: f"{s:,.1f} s to reach {value} {target_text}", "time to the target", gone,
                               stopped_in(study.trials))
    tied, _, _ = ties(seeds[kept], points.sort_values("seconds", kind="stable"), fields, value, True)
    saving = float(tied["seconds"].iloc[0] - tied["seconds"].min())
    finding = finding[:-1] + never_reached(late) + not_timed(study, untimed) + "." + _timing_note(t, fields, saving)
    once = counted(study, objective_trials(study))[1]
    finding += f" Of the runs counted: {once}." if once else ""
    return _front_figure(points, fields, "seconds", value, f"seconds to reach {value} {target_text} (median over seeds)",
                         percent, True, "time_front", f"Pareto front: {value} against time to the target", t, finding)


def pareto_trials(study: StudyRuns) -> pd.Index:
    """The finished trials on Optuna's Pareto front of the study's objectives (its `best_trials`)."""
    import optuna

    t = counted(study, objective_trials(study))[0]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rebuilt = optuna.create_study(directions=[d for _, d in study.objectives])
    for i, (_, row) in enumerate(t.iterrows()):
        rebuilt.add_trial(optuna.trial.create_trial(values=[float(row[m]) for m, _ in study.objectives],
                                                    user_attrs={"row": i}))
    return t.index[[trial.user_attrs["row"] for trial in rebuilt.best_trials]]


def objectives_front(study: StudyRuns) -> Figure | None:
    """A study of two objectives: every finished trial, and Optuna's Pareto front of them."""
    if len(study.objectives) != 2:
        return None
    t = counted(study, objective_trials(study))[0]
    if len(t) < 2:
        return None
    (m1, d1), (m2, d2) = study.objectives
    on = pareto_trials(study)
    fields = _fields(study, t)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    rest = t.drop(on)
    ax.scatter(rest[m1], rest[m2], color="C0", alpha=0.25, label="dominated")
    best = t.loc[on].sort_values(m1)
    ax.plot(best[m1], best[m2], "o-", color="C3", label="Pareto front (Optuna's best_trials)")
    ax.set(xlabel=f"{m1} ({d1})", ylabel=f"{m2} ({d2})")
    ax.legend(fontsize=8)
    listed = "; ".join(f"{label(row, fields) or 'trial'}: {m1} {row[m1]:.4g}, {m2} {row[m2]:.4g}"
                       for _, row in best.head(4).iterrows())
    finding = (f"Optuna's Pareto front of {m1} ({d1}) and {m2} ({d2}) holds {len(on)} of {len(t)} finished trials: "
               f"{listed}{'; …' if len(on) > 4 else ''}.")
    return Figure("objectives_front", f"Pareto front of the study's objectives: {m1} and {m2}", fig, context(t),
                  finding)


def space_candidates(study: StudyRuns) -> list[Draw]:
    """Each figure over the search space the report may draw (figures.candidates)."""
    return [partial(make, study) for make in (importance, parallel_coordinates, memory_front, time_front,
                                              objectives_front)]
