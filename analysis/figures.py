"""The report's figures. Each takes the trial (and history) frames and returns a Figure, or None when the
study has no data for it."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Iterator
from functools import partial

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .best_lr import BestLR, best_lr_against_b, draw as best_lr_figure  # noqa: E402
from .measures import (Measure, finished, full_scale, last_noise, measure, no_batchnorm, one_batch,  # noqa: E402
                       reliable_noise, tuned)
from .plotting import MEMORY_LABELS, Draw, Figure, colors, context, log2_axis, log_scale, split, varies  # noqa: E402
from .runs import aggregate, ci95  # noqa: E402
from .targets import to_target, true_batch_arm  # noqa: E402
from .wording import percent  # noqa: E402

def accuracy_vs_batch(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Figure | None:
    """Accuracy against B, or for a study without one its objective (measure())."""
    t = one_batch(finished(trials))
    m = measure(t, objective)
    if not varies(t, "effective_batch") or m is None or tuned(t):
        return None
    hue, palette = split(trials)
    hue = hue if varies(t, hue) else None
    keys = [k for k in (hue, "batch") if k]
    stats = aggregate(t, [*keys, "effective_batch"], m.name)
    noise = last_noise(t)
    if noise is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    else:  # the measured noise scale beside the accuracy curve
        fig, (ax, noise_ax) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
        measured = t.loc[reliable_noise(t).index]
        sns.scatterplot(data=measured, x="effective_batch", y="noise_scale", hue=hue, palette=palette if hue else None,
                        ax=noise_ax, legend=False)
        noise_ax.axhline(noise, color="gray", linestyle="--", linewidth=1)
        log2_axis(noise_ax, measured["effective_batch"])
        log_scale(noise_ax, "y", [*measured["noise_scale"], noise])
        noise_ax.set(xlabel="effective batch B (trials with k ≥ 2)",
                     ylabel="gradient noise scale at the last epoch", title=f"median {noise:.0f}")
    groups = list(stats.groupby(keys)) if keys else [((), stats)]
    if hue:  # the split's own order
        groups.sort(key=lambda g: list(palette).index(g[0][0]))
    for group, rows in groups:
        label = dict(zip(keys, group))
        rows = rows.sort_values("effective_batch")
        half = rows["ci95"].fillna(0)  # accuracy's cut at 0 and 100%: with 2 seeds the t-interval may pass them
        below, above = (half.clip(upper=rows["mean"]), half.clip(upper=m.full - rows["mean"])) if m.points else \
            (half, half)
        ax.errorbar(rows["effective_batch"], m.scaled(rows["mean"]), yerr=[m.scaled(below), m.scaled(above)],
                    color=palette[label[hue]] if hue else "C0",
                    marker="o" if label.get("batch") != "true batch" else "s",
                    linestyle="-" if label.get("batch") != "true batch" else "--", capsize=3,
                    label=" / ".join(str(v) for v in group))
    low, high = stats["effective_batch"].min(), stats["effective_batch"].max()
    said = f"noise scale at the last epoch ≈ {noise:.0f} (median)" if noise is not None else ""
    if noise is not None and low / 2 <= noise <= 2 * high:
        ax.axvline(noise, color="gray", linestyle="--", linewidth=1, label=said)
    elif noise is not None:  # a line far off the Bs run would squeeze them to one side: the legend says it
        ax.plot([], [], " ", label=f"{said}, {'below' if noise < low else 'above'} every B run")
    log2_axis(ax, stats["effective_batch"])
    ax.set(xlabel="effective batch B = b·k", ylabel=m.axis)
    ax.legend(title=" / ".join(keys), fontsize=8)
    fig.tight_layout()
    name, title = ("accuracy_vs_batch", "Validation accuracy") if m.points else ("objective_vs_batch", m.name)
    return Figure(name, f"{title} against effective batch{m.better}"
                  + (", beside the measured gradient noise scale" if noise is not None else ""), fig, context(t))


def memory_vs_batch(trials: pd.DataFrame) -> Figure | None:
    t = finished(trials)
    if "peak_memory_bytes" not in t or not varies(t, "effective_batch"):
        return None
    t = t.assign(peak_mib=t["peak_memory_bytes"] / 2 ** 20)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(data=t, x="effective_batch", y="peak_mib", hue="physical_batch",
                 style="model" if varies(t, "model") else "batch", markers=True,
                 palette="viridis", hue_norm=matplotlib.colors.LogNorm(), errorbar=None, ax=ax)
    log2_axis(ax, t["effective_batch"])
    sources = t["memory_source"].dropna().unique()
    ax.set(xlabel="effective batch B = b·k",
           ylabel=MEMORY_LABELS.get(sources[0], "peak memory, MiB") if len(sources) == 1 else "peak memory, MiB "
           "(mixed sources: compare within one)")
    log_scale(ax, "y", t["peak_mib"])
    return Figure("memory_vs_batch", "Peak memory against effective batch (hue: physical batch b)", fig, context(t))


def throughput(trials: pd.DataFrame) -> Figure | None:
    """Samples/s against b, over the trials that measured their own (a fused trial logs its group's instead)."""
    done = finished(trials)
    t = done[done["samples_per_s"].notna()] if "samples_per_s" in done else done.iloc[0:0]
    if not varies(t, "physical_batch"):
        return None
    alone = (f" ({len(t)} of {len(done)} finished trials timed alone; fused trials have only their group's time)"
             if len(t) < len(done) else "")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(data=t, x="physical_batch", y="samples_per_s", hue="accum_steps", marker="o", palette="crest",
                 errorbar=None, ax=ax)
    log2_axis(ax, t["physical_batch"])
    ax.set(xlabel="physical batch b", ylabel="training samples / s")
    return Figure("throughput", f"Training throughput against physical batch (hue: accumulation steps k){alone}",
                  fig, context(t))


def learning_curves(trials: pd.DataFrame, history: pd.DataFrame,
                    objective: tuple[str, str] | None = None) -> Figure | None:
    """Validation accuracy (or, without one, the objective: measure()) against epochs."""
    t = one_batch(finished(trials))  # a curve by B holds trials that trained at that B throughout
    m = measure(t, objective)
    if history.empty or m is None or m.name not in history:
        return None
    facet, palette = split(trials)  # its values in reading order
    best = tuned(t)
    if best:  # a mean over the searched LRs means little: the curve of the best of them at each B
        t = t.dropna(subset=[m.name])
        by = t.groupby(["effective_batch", *([facet] if facet else [])])[m.name]
        t = t.loc[by.idxmax() if m.maximize else by.idxmin()]
    cols = [c for c in ("run_id", "effective_batch", "batch", facet) if c and c in t]
    h = history.merge(t[cols], on="run_id")
    if h.empty:
        return None
    grid = sns.relplot(data=h, x="epoch", y=m.name, hue="effective_batch", style="batch" if "batch" in h else None,
                       col=facet, col_order=[v for v in palette if v in set(h[facet])] if facet else None, kind="line",
                       palette="flare", hue_norm=matplotlib.colors.LogNorm(), errorbar=None, height=3.2, aspect=1.1,
                       facet_kws={"sharey": True})
    # A script's MLflow step is its own: the epoch of a JSON row, the global step of a Lightning logger.
    grid.set_axis_labels("epoch" if "model" in trials else "epoch, or the step the script logged at",
                         "validation accuracy" if m.points else m.name)
    for ax in grid.axes.flat:  # epochs and steps are whole: no tick at 2.5 of a 3-epoch run
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    title = f"Learning curves{' of the best trial at each B' if best else ''}{f' by {facet}' if facet else ''}"
    return Figure("learning_curves", title, grid.figure, context(t))


def trained_lr(trials: pd.DataFrame) -> str:
    """The column of the LR each trial trained at: `lr`, after its LR rule. Under a rule other than `none` the
    base LR is not it, and its exponent against B would leave out the rule's own."""
    return "lr" if "lr" in trials else "base_lr"


def best_lr(trials: pd.DataFrame, m: Measure | None = None) -> tuple[pd.DataFrame, float] | None:
    """The best LR (as trained at) per effective batch, by the measure (measure()), and the fitted exponent alpha
    of lr_opt ~ B^alpha, in a frame of effective_batch, lr and the measure's column."""
    t = finished(trials)
    m = m or measure(t)
    if not varies(t, "effective_batch") or not tuned(t) or m is None:
        return None
    t = t.dropna(subset=[m.name])
    by = t.groupby("effective_batch")[m.name]
    best = t.loc[by.idxmax() if m.maximize else by.idxmin(), ["effective_batch", trained_lr(t), m.name]]
    best = best.set_axis(["effective_batch", "lr", m.name], axis=1).sort_values("effective_batch")
    alpha = float(np.polyfit(np.log(best["effective_batch"]), np.log(best["lr"]), 1)[0]) if len(best) > 1 \
        else float("nan")
    return best, alpha


def best_lr_of_seeds(trials: pd.DataFrame, m: Measure) -> BestLR | None:
    """best_lr.py's reading of a search of the LR at each B, in the LR trained at; None where its trials do not
    allow it (a B without the seeds of the others, or trials that differ in more than the LR at a B)."""
    try:
        return best_lr_against_b(trials.assign(lr=trials[trained_lr(trials)]), m.name,
                                 "maximize" if m.maximize else "minimize")
    except ValueError:
        return None


def lr_scaling(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Figure | None:
    m = measure(trials, objective)
    found = best_lr(trials, m)
    if found is None:
        return None
    per_seed = best_lr_of_seeds(trials, m)
    if per_seed is not None:
        return Figure("lr_scaling", "Best learning rate against effective batch, each seed's and their mean",
                      best_lr_figure(per_seed), context(trials))
    best, alpha = found
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.scatter(best["effective_batch"], best["lr"], zorder=3, label=f"best LR (fit: α = {alpha:.2f})")
    b0, lr0 = best["effective_batch"].iloc[0], best["lr"].iloc[0]
    xs = np.array([best["effective_batch"].min(), best["effective_batch"].max()])
    intercept = np.mean(np.log(best["lr"]) - alpha * np.log(best["effective_batch"]))
    ax.plot(xs, np.exp(intercept) * xs ** alpha, color="C0")
    ax.plot(xs, lr0 * xs / b0, "--", color="gray", label="linear (α = 1)")
    ax.plot(xs, lr0 * np.sqrt(xs / b0), ":", color="gray", label="square root (α = 0.5)")
    ax.plot(xs, [lr0, lr0], "-.", color="gray", label="LR unchanged (α = 0)")
    ax.set_yscale("log")
    log2_axis(ax, best["effective_batch"])
    ax.set(xlabel="effective batch B", ylabel="best learning rate")
    ax.legend(fontsize=8)
    return Figure("lr_scaling", "Best learning rate against effective batch (log–log)", fig, context(trials))


def _t_interval(values) -> tuple[float, float]:
    """The 95% t-interval over the seeds, as the findings and the accuracy figure state it (seaborn's own 95%
    bootstrap over 3 seeds is about their range)."""
    mean, half = float(np.mean(values)), ci95(pd.Series(values))
    return (mean, mean) if math.isnan(half) else (mean - half, mean + half)


def bn_rules(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Figure | None:
    """The final accuracy (or, without one, the objective: measure()) by BN momentum rule at each B; none for a
    model without BatchNorm, whose rules set a momentum no layer uses."""
    t = finished(trials)
    m = measure(t, objective)
    if not varies(t, "bn_momentum_rule") or "accum_steps" not in t or m is None or no_batchnorm(t):
        return None
    t = t.assign(rule=np.where(t["accum_steps"] > 1, t["bn_momentum_rule"], "true batch"),
                 B=t["effective_batch"])
    t.loc[t["B"] == t["physical_batch"].min(), "rule"] = "k = 1"  # the smallest B has no accumulation at all
    fig, ax = plt.subplots(figsize=(7, 4.5))
    palette = {"k = 1": "0.8", "true batch": "0.45", **colors(trials, "bn_momentum_rule")}
    order = [r for r in palette if r in set(t["rule"])]
    sns.barplot(data=t.assign(shown=m.scaled(t[m.name])), x="B", y="shown", hue="rule", hue_order=order,
                palette=palette, errorbar=_t_interval, ax=ax)
    if m.points:
        ax.set_ylim(max(0, m.scaled(t["val_acc"].min()) - 5), 100)
    ax.set(xlabel="effective batch B (accumulated: b = 32, k = B/32; true batch: b = B, k = 1)",
           ylabel=m.axis)
    return Figure("bn_rules", f"{'Accuracy' if m.points else m.name} by BatchNorm momentum rule, beside the "
                  f"true-batch twin", fig, context(t))


def equivalence(trials: pd.DataFrame) -> Figure | None:
    t = finished(trials)
    if "param_rel_diff" not in t:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    hue, palette = split(trials)
    hue = hue if hue == "model" else None
    bars = dict(hue=hue, hue_order=list(palette), palette=palette) if hue else {}
    dots = dict(hue=hue, hue_order=list(palette), palette="dark:black", dodge=True) if hue else dict(color="black")
    t = t.assign(gap=100 * t["acc_gap"])
    # Bars: the median over seeds (one seed that parts in float32 would carry a mean on a log axis); dots: each seed.
    for ax, column in ((left, "param_rel_diff"), (right, "gap")):
        sns.barplot(data=t, x="accum_steps", y=column, estimator="median", errorbar=None, alpha=0.7, ax=ax, **bars)
        sns.stripplot(data=t, x="accum_steps", y=column, size=3, legend=False, ax=ax, **dots)
    left.set_yscale("log")
    left.set(xlabel="accumulation steps k (b = 32)", ylabel="largest relative parameter difference")
    if left.get_legend():  # one legend, on the side with room for it
        left.get_legend().remove()
    right.axhline(0, color="black", linewidth=0.8)
    right.set(xlabel="accumulation steps k (b = 32)", ylabel="accuracy, accumulated − true batch, points")
    fig.suptitle("bars: the median over seeds; dots: each seed", fontsize=9)
    fig.tight_layout()
    return Figure("equivalence", "Accumulated against true batch from the same weights: BN against no BN", fig,
                  context(t))


def health(trials: pd.DataFrame, history: pd.DataFrame, compared: pd.DataFrame | None = None) -> Figure | None:
    """grad_norm and update_ratio over epochs for every trial: an LR scaled too far stands out. Coloured by the
    field that splits `compared` (candidates())."""
    if history.empty or "grad_norm" not in history or "update_ratio" not in history:
        return None
    hue = split(trials if compared is None else compared)[0]
    palette = colors(trials, hue) if hue else {}
    h = history.merge(trials[["run_id", *([hue] if hue else [])]], on="run_id")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((left, "grad_norm", "gradient norm |G_B| (mean over steps)"),
                           (right, "update_ratio", "update ratio |Δθ| / |θ| (mean over steps)")):
        sns.lineplot(data=h, x="epoch", y=key, hue=hue, hue_order=list(palette) or None, palette=palette or None,
                     units="run_id", estimator=None, alpha=0.7, ax=ax)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set(xlabel="epoch", ylabel=label)
    right.axhline(1e-3, color="gray", linestyle=":", linewidth=1)  # the usual healthy order of magnitude
    fig.tight_layout()
    return Figure("health", "Training health: gradient norm and update ratio of every trial", fig, context(trials))


def steps_vs_batch(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None) -> Figure | None:
    """Steps and samples to the target accuracy against B on log-log axes, with perfect scaling (Shallue et al.):
    the runs, medians and fit the findings' sentence reads (targets.to_target)."""
    t = one_batch(finished(trials))
    if tuned(t):
        return None
    found = to_target(trials, history, evals)
    if found is None or sum(len(s.kept) for s in found.series) < 2:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    field, palette = split(trials)
    lines = sns.color_palette()
    if found.keys == [field]:  # the split's own order and colours
        # (beside the BN rules, the true batches (targets.true_batch_arm): squares, in their arm's colour or dark gray)
        lines = [palette.get(s.group[0], palette.get(true_batch_arm(s), "0.2")) for s in found.series]
    firsts = []
    for i, (color, series) in enumerate(zip(lines, found.series)):
        label = " / ".join(map(str, series.group)) if found.keys else "all"
        true = true_batch_arm(series) is not None
        for ax, column in ((left, "steps"), (right, "samples")):
            medians = series.medians(column)
            # (each series a size smaller than the one before: identical medians, BN rules that share their k = 1
            # runs and train alike, show nested instead of the last drawn hiding the others)
            ax.plot(medians.index, medians.values, "s-." if true else "o-", color=color, label=label,
                    markersize=max(9 - 1.5 * i, 2), linewidth=max(3 - 0.5 * i, 0.6))
        if len(series.kept):
            firsts.append(series.medians("steps").sort_index().iloc[:1])
        # The findings' fit, drawn where the seeds' interval of B_crit lies within the Bs fitted (critical.py).
        fitted = series.fit()
        if fitted and min(fitted.sizes) <= fitted.lo < fitted.hi <= max(fitted.sizes):
            xs = np.geomspace(min(fitted.sizes), max(fitted.sizes), 50)
            left.plot(xs, fitted.s_min * (1 + fitted.b_crit / xs), ":", color=color, linewidth=1)
    got = pd.concat(firsts)
    b0 = got.index.min()
    first = got[got.index == b0].min()
    xs = np.array(sorted(t["effective_batch"].unique()), float)
    left.plot(xs, first * b0 / xs, "--", color="gray", label="perfect scaling (steps ∝ 1/B)")
    right.plot(xs, np.full_like(xs, first * b0), "--", color="gray", label="perfect scaling (samples constant)")
    for ax, label in ((left, "optimizer steps to target"), (right, "training samples to target")):
        log2_axis(ax, xs)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set(xlabel="effective batch B", ylabel=label)
    left.legend(title=" / ".join(found.keys) or None, fontsize=8)
    every = "once an epoch" if evals is None else "every eval_every_steps"
    # (wrapped to the figure's width: one line of it made the saved image 3,457 px wide, its panels a third of it)
    fig.suptitle(textwrap.fill(
        f"target: {percent(found.goal, full_scale(t['val_acc']))} validation accuracy ({found.of}), evaluated "
        f"{every}; lines: medians over every run at a B (one that never reached the target counted slowest, one "
        f"that diverged left out); dotted: S = S_min (1 + B_crit / B) fitted as the findings fit it, where the seeds' "
        f"95% interval of B_crit lies within the Bs fitted; no point: half or more of the runs never reached the "
        f"target or diverged", 150), fontsize=9)
    fig.tight_layout()
    return Figure("steps_to_target", "Steps and samples to the target accuracy against effective batch (log–log)",
                  fig, context(t))


def warmup_curves(trials: pd.DataFrame, evals: pd.DataFrame | None) -> Figure | None:
    """Validation accuracy against training samples, each batch-size warmup beside the fixed B (one line per
    seed), at the evaluations within epochs."""
    t = finished(trials)
    if evals is None or "batch_warmup" not in t or not {"step_samples", "step_val_acc"} <= set(evals):
        return None
    arms = t.assign(batch_warmup=t["batch_warmup"].fillna("").astype(str))
    if arms["batch_warmup"].nunique() < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for color, ((arm, b), rows) in zip(sns.color_palette(), arms.groupby(["batch_warmup", "effective_batch"])):
        label = f"warmup B = {arm.replace(',', ', ')}, then {b}" if arm else f"fixed B = {b}"
        for i, run_id in enumerate(rows["run_id"]):
            curve = evals[evals["run_id"] == run_id].sort_values("step_samples")
            ax.plot(curve["step_samples"], curve["step_val_acc"], color=color, linewidth=1, alpha=0.8,
                    label=label if i == 0 else None)
    ax.set(xlabel="training samples", ylabel="validation accuracy", ylim=(max(0.0, evals["step_val_acc"].min()), 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Figure("batch_warmup", "Batch-size warmup against a fixed batch: accuracy against samples (one line a seed)",
                  fig, context(t))


def candidates(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None,
               objective: tuple[str, str] | None = None, compared: pd.DataFrame | None = None) -> list[Draw]:
    """Each figure the report may draw, as a call that draws it, or gives None where the data does not support it
    (the report counts them on its bar). `objective` is the study's first (metric, direction). `compared`: the
    trials the findings compare (findings.one_bn_rule: a model without BatchNorm's BN momentum rules as one
    configuration), which the figures of means, intervals, series, memory and throughput draw, so that identical
    runs under rules no layer uses are not counted as more seeds or trials; training health draws every trial,
    split as `compared` is."""
    compared = trials if compared is None else compared
    return [partial(make, frame, *args) for make, frame, args in (
        (accuracy_vs_batch, compared, (objective,)), (steps_vs_batch, compared, (history, evals)),
        (warmup_curves, trials, (evals,)), (memory_vs_batch, compared, ()), (throughput, compared, ()),
        (learning_curves, compared, (history, objective)), (lr_scaling, compared, (objective,)),
        (bn_rules, trials, (objective,)), (equivalence, trials, ()), (health, trials, (history, compared)))]


def all_figures(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None,
                objective: tuple[str, str] | None = None, compared: pd.DataFrame | None = None) -> Iterator[Figure]:
    """Each figure the data supports, drawn as it is asked for."""
    return (figure for figure in (draw() for draw in candidates(trials, history, evals, objective, compared))
            if figure is not None)
