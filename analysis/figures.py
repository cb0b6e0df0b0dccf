"""The report's figures. Each takes the trial (and history) frames and returns a Figure, or None when the
study has no data for it."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .best_lr import BestLR, best_lr_against_b, draw as best_lr_figure  # noqa: E402
from .critical import fit  # noqa: E402
from .runs import Difference, aggregate, ci95, reached, steps_to_target  # noqa: E402

# The fields a figure splits its trials by, the first that varies, with their values in the order they read (the
# LR rules by their exponent of B, then Adam's whole rule; not the alphabet's). Each value keeps one colour in
# every figure, and in every report.
SPLITS = {"lr_rule": ("none", "sqrt", "linear", "adam_sqrt", "adam_halflife"),
          "bn_momentum_rule": ("default", "scaled", "matched"), "model": ()}
MEMORY_LABELS = {"saved_tensors": "peak memory, MiB (saved-for-backward tensors + state, CPU)",
                 "cuda_allocator": "peak memory, MiB (CUDA allocator)"}


@dataclass
class Figure:
    name: str  # file stem
    title: str
    figure: plt.Figure
    context: str  # which device, dataset, model, seeds and epochs stand behind it
    finding: str = ""  # the sentence it answers with, for the findings


Draw = Callable[[], "Figure | None"]  # a figure of the report, drawn when called; None where the data has none


def _values(trials: pd.DataFrame, column: str) -> str:
    """A column's distinct values, numbers in their order ('3, 4, 6, 10 epochs', not '10, 3, 4, 6')."""
    if column not in trials:
        return "?"
    values = set(map(str, trials[column].dropna().unique()))
    return ", ".join(sorted(values, key=lambda v: (0, float(v), v) if _is_number(v) else (1, 0.0, v)))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _epochs(values: str) -> str:
    return f"{values} epoch{'' if values in ('1', '1.0') else 's'}"


def protocol(trials: pd.DataFrame) -> str:
    """The training protocol behind the trials: optimizer, schedule, warmup, weight decay, epochs, seeds."""
    seeds = trials["seed"].nunique() if "seed" in trials else 1
    parts = []
    if "optimizer" in trials:
        parts.append(_values(trials, "optimizer") + (f" (momentum {_values(trials, 'momentum')})"
                                                      if "momentum" in trials and "sgd" in set(trials["optimizer"]) else ""))
    if "schedule" in trials:
        warmup = _values(trials, "warmup_epochs") if "warmup_epochs" in trials else "0"
        parts.append(f"{'no warmup' if warmup in ('0', '0.0') else f'linear warmup {_epochs(warmup)}'}, then "
                     f"{_values(trials, 'schedule')}")
    if "weight_decay" in trials:
        parts.append(f"weight decay {_values(trials, 'weight_decay')}")
    parts += [_epochs(_values(trials, "epochs")), f"{seeds} seed{'s' * (seeds != 1)}"]
    return "; ".join(parts)


def context(trials: pd.DataFrame) -> str:
    what = (f"{_values(trials, 'model')} on {_values(trials, 'dataset')}" if "model" in trials
            else f"program {_values(trials, 'batchsweep.program')}")
    count = f"{len(trials)} trial{'s' * (len(trials) != 1)}"
    return f"{what}; device {_values(trials, 'device_name')}; {protocol(trials)}; {count}"


def _varies(trials: pd.DataFrame, column: str) -> bool:
    return column in trials and trials[column].nunique() > 1


def in_order(column: str, values) -> list:
    """The distinct values of a split field in reading order: the rules' own first, any others after them."""
    known, present = SPLITS.get(column, ()), set(values)
    return [v for v in known if v in present] + sorted(present - set(known), key=str)


def colors(trials: pd.DataFrame, column: str) -> dict:
    """The values of a split field that the trials hold, in reading order, each mapped to its colour: a rule's
    colour is its place among all the rules, so that it is the same in every report."""
    present = set(trials[column].dropna()) if column in trials else set()
    values = in_order(column, [*SPLITS.get(column, ()), *present])
    palette = sns.color_palette(n_colors=max(10, len(values)))
    return {v: palette[i] for i, v in enumerate(values) if v in present}


def split(trials: pd.DataFrame) -> tuple[str | None, dict]:
    """The field that splits the trials (the first of SPLITS that varies), and colors() of it."""
    column = next((c for c in SPLITS if _varies(trials, c)), None)
    return (column, colors(trials, column)) if column else (None, {})


def _log2_axis(ax, values) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(int(v) for v in values))
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()


def log_scale(ax, axis: str, values) -> None:
    """A log scale where the values span a factor of 3 or more, ticked in plain numbers at 1, 2 and 5 times the
    powers of ten (a factor of 3 always holds one of them); else the linear scale stays, whose ticks are named
    (a log scale inside 2 to 5, say, would show no number at all)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values) & (values > 0)]
    if not len(values) or values.max() < 3 * values.min():
        return
    getattr(ax, f"set_{axis}scale")("log")
    ticks = getattr(ax, f"{axis}axis")
    ticks.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ticks.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ticks.set_minor_formatter(matplotlib.ticker.NullFormatter())


def finished(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials that finished as they were asked to: a script that did not (config_mismatch) compares nothing."""
    done = trials["status"] == "FINISHED"
    if "config_mismatch" in trials:
        done &= trials["config_mismatch"].isna()
    return trials[done]


def has_accuracy(trials: pd.DataFrame) -> bool:
    """Whether any trial has a validation accuracy (float targets, as a regression has, give none)."""
    return "val_acc" in trials and bool(np.isfinite(trials["val_acc"].astype(float)).any())


def not_rounded_away(x: float, places: int, sign: str = "") -> str:
    """`places` decimals, or two significant digits where those would show a non-zero x as zero."""
    return f"{x:{sign}.{places}f}" if round(abs(x), places) or not x else f"{x:{sign}.2g}"


@dataclass(frozen=True)
class Measure:
    """What the report compares configurations in: accuracy in points, or a study's own metric (a regression's
    val_loss) in its own units, two significant digits, where lower may be better."""

    name: str = "val_acc"
    maximize: bool = True
    margin: float = 0.01  # equivalence margin: 1 accuracy point; for a metric of its own, 1% of its median
    full: float = 1.0  # an accuracy's value at 100%: 1, or 100 where a script logs it in percent

    @property
    def margin_text(self) -> str:
        points = self.scaled(self.margin)
        return f"{points:g} point{'s' * (points != 1)}" if self.points else f"{_two_digits(self.margin)} in {self.name}"

    @property
    def points(self) -> bool:
        return self.name == "val_acc"

    def scaled(self, x: float) -> float:
        return 100 * x / self.full if self.points else x

    def places(self, *xs: float) -> int:
        """Decimals that give the largest of xs two significant digits, at most 4 (accuracy points: one)."""
        largest = max((abs(x) for x in xs if math.isfinite(x)), default=0.0)
        return 1 if self.points else (min(4, max(0, 1 - math.floor(math.log10(largest)))) if largest else 2)

    def shown(self, x: float, places: int, sign: str = "") -> str:
        """`places` decimals, or for a metric of its own two significant digits where those would round x to zero
        (an exact twin's loss differs by 3e-08, not by 0.0000)."""
        return f"{x:{sign}.{places}f}" if self.points else not_rounded_away(x, places, sign)

    def amount(self, x: float, places: int | None = None) -> str:
        """An unsigned difference: '3.4 points', or 'val_loss 0.031'."""
        places = self.places(x) if places is None else places
        shown = self.shown(abs(self.scaled(x)), places)
        return f"{shown} points" if self.points else f"{self.name} {shown}"

    def level(self, x: float) -> str:
        return f"{self.scaled(x):.1f}%" if self.points else f"{self.name} {x:.3g}"

    @property
    def better(self) -> str:
        """' (lower is better)' for a metric of its own; accuracy goes without saying."""
        return "" if self.points else f" ({'higher' if self.maximize else 'lower'} is better)"

    @property
    def axis(self) -> str:
        return "final validation accuracy, %" if self.points else f"final {self.name}{self.better}"

    def worse(self, d: Difference) -> bool:
        """Whether a separated difference a - b says that a did worse than b."""
        return d.separated and (d.mean < 0) == self.maximize

    def ranked(self, better: str, worse: str) -> tuple[str, str]:
        """The words for a positive and a negative difference, from the words for a better and a worse one."""
        return (better, worse) if self.maximize else (worse, better)


def _two_digits(x: float) -> str:
    return f"{x:.2g}"


ACCURACY = Measure()


def full_scale(values) -> float:
    """An accuracy's value at 100%: 100 where any value is above 1 (a script that logs val_acc in percent), else 1."""
    v = pd.to_numeric(pd.Series(values), errors="coerce")
    return 100.0 if (v[np.isfinite(v)] > 1).any() else 1.0


def measure(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Measure | None:
    """The study's first objective where it names one other than val_acc and trials logged it (a study that
    minimizes val_loss is ranked by val_loss, even where val_acc is logged too); else accuracy where trials have
    one; else val_loss (to minimize)."""
    t = finished(trials)
    named = [objective] if objective and objective[0] != "val_acc" else []
    for name, direction in (*named, ("val_acc", "maximize"), ("val_loss", "minimize")):
        if name == "val_acc":  # (in points, with its own margin; float targets give no accuracy)
            if has_accuracy(t):  # (in percent where a script logged it so: its margin is still 1 point)
                full = full_scale(t["val_acc"])
                return ACCURACY if full == 1 else Measure(full=full, margin=0.01 * full)
            continue
        values = pd.to_numeric(t[name], errors="coerce") if name in t else pd.Series(dtype=float)
        if np.isfinite(values).any():
            return Measure(name, direction == "maximize", 0.01 * float(values[np.isfinite(values)].abs().median()))
    return None


def one_batch(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials that trained at one B throughout (no batch_warmup, no branch): what a curve against B holds."""
    if "batch_warmup" not in trials:
        return trials
    return trials[trials["batch_warmup"].fillna("").astype(str) == ""]


def tuned(trials: pd.DataFrame) -> bool:
    """Whether base_lr was searched (several values at one B): then a mean over trials means little."""
    return "base_lr" in trials and "effective_batch" in trials and \
        trials.groupby("effective_batch")["base_lr"].nunique().max() > 1


def reliable_noise(trials: pd.DataFrame) -> pd.Series:
    """The last-epoch noise scales that can be read: runs that marked theirs unreliable are left out."""
    if "noise_scale" not in trials:
        return pd.Series(dtype=float)
    ok = trials["noise_scale"].notna()
    if "noise_scale_reliable" in trials:
        ok &= trials["noise_scale_reliable"].fillna(1.0) > 0
    return trials.loc[ok, "noise_scale"]


def last_noise(trials: pd.DataFrame) -> float | None:
    """The median of the reliable noise scales at the end of the finished trials (not the critical batch at the
    target: the noise scale grows as training goes; critical.py reads it where the target was reached)."""
    values = reliable_noise(finished(trials))
    return float(values.median()) if len(values) else None


def accuracy_vs_batch(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Figure | None:
    """Accuracy against B, or for a study without one its objective (measure())."""
    t = one_batch(finished(trials))
    m = measure(t, objective)
    if not _varies(t, "effective_batch") or m is None or tuned(t):
        return None
    hue, palette = split(trials)
    hue = hue if _varies(t, hue) else None
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
        _log2_axis(noise_ax, measured["effective_batch"])
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
    _log2_axis(ax, stats["effective_batch"])
    ax.set(xlabel="effective batch B = b·k", ylabel=m.axis)
    ax.legend(title=" / ".join(keys), fontsize=8)
    fig.tight_layout()
    name, title = ("accuracy_vs_batch", "Validation accuracy") if m.points else ("objective_vs_batch", m.name)
    return Figure(name, f"{title} against effective batch{m.better}"
                  + (", beside the measured gradient noise scale" if noise is not None else ""), fig, context(t))


def memory_vs_batch(trials: pd.DataFrame) -> Figure | None:
    t = finished(trials)
    if "peak_memory_bytes" not in t or not _varies(t, "effective_batch"):
        return None
    t = t.assign(peak_mib=t["peak_memory_bytes"] / 2 ** 20)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(data=t, x="effective_batch", y="peak_mib", hue="physical_batch",
                 style="model" if _varies(t, "model") else "batch", markers=True,
                 palette="viridis", hue_norm=matplotlib.colors.LogNorm(), errorbar=None, ax=ax)
    _log2_axis(ax, t["effective_batch"])
    sources = t["memory_source"].dropna().unique()
    ax.set(xlabel="effective batch B = b·k",
           ylabel=MEMORY_LABELS.get(sources[0], "peak memory, MiB") if len(sources) == 1 else "peak memory, MiB "
           "(mixed sources: compare within one)")
    log_scale(ax, "y", t["peak_mib"])
    return Figure("memory_vs_batch", "Peak memory against effective batch (hue: physical batch b)", fig, context(t))


def throughput(trials: pd.DataFrame) -> Figure | None:
    t = finished(trials)
    if "samples_per_s" not in t or not _varies(t, "physical_batch"):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(data=t, x="physical_batch", y="samples_per_s", hue="accum_steps", marker="o", palette="crest",
                 errorbar=None, ax=ax)
    _log2_axis(ax, t["physical_batch"])
    ax.set(xlabel="physical batch b", ylabel="training samples / s")
    return Figure("throughput", "Training throughput against physical batch (hue: accumulation steps k)", fig,
                  context(t))


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
    if not _varies(t, "effective_batch") or not tuned(t) or m is None:
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
    _log2_axis(ax, best["effective_batch"])
    ax.set(xlabel="effective batch B", ylabel="best learning rate")
    ax.legend(fontsize=8)
    return Figure("lr_scaling", "Best learning rate against effective batch (log–log)", fig, context(trials))


def _t_interval(values) -> tuple[float, float]:
    """The 95% t-interval over the seeds, as the findings and the accuracy figure state it (seaborn's own 95%
    bootstrap over 3 seeds is about their range)."""
    mean, half = float(np.mean(values)), ci95(pd.Series(values))
    return (mean, mean) if math.isnan(half) else (mean - half, mean + half)


def bn_rules(trials: pd.DataFrame, objective: tuple[str, str] | None = None) -> Figure | None:
    """The final accuracy (or, without one, the objective: measure()) by BN momentum rule at each B."""
    t = finished(trials)
    m = measure(t, objective)
    if not _varies(t, "bn_momentum_rule") or "accum_steps" not in t or m is None:
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


def health(trials: pd.DataFrame, history: pd.DataFrame) -> Figure | None:
    """grad_norm and update_ratio over epochs for every trial: an LR scaled too far stands out."""
    if history.empty or "grad_norm" not in history or "update_ratio" not in history:
        return None
    hue, palette = split(trials)
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
    """Steps and samples to the target accuracy against B on log-log axes, with perfect scaling (Shallue et al.)."""
    t = one_batch(finished(trials))
    if tuned(t) or "effective_batch" not in t or t["effective_batch"].nunique() < 3:
        return None
    keys = [c for c in ("lr_rule", "bn_momentum_rule") if c in t and t[c].nunique() > 1]
    found = steps_to_target(t, history, keys, evals)  # every run at a B: accumulated and true batch alike
    if found is None or found[0]["steps"].notna().sum() < 2:
        return None
    table, target = found
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    field, palette = split(trials)
    groups = list(table.groupby(keys)) if keys else [(("all",), table)]
    lines = sns.color_palette()
    if keys == [field]:  # the split's own order and colours
        groups.sort(key=lambda g: list(palette).index(g[0][0]))
        lines = [palette[g[0]] for g, _ in groups]
    runs = t[["run_id", *keys, "effective_batch"]].merge(reached(t, history, target, evals), on="run_id")
    for color, (group, rows) in zip(lines, groups):
        rows = rows.dropna(subset=["steps"]).sort_values("effective_batch")
        for ax, column in ((left, "steps"), (right, "samples")):
            ax.plot(rows["effective_batch"], rows[column], "o-", color=color, label=" / ".join(map(str, group)))
        mine = runs[runs["effective_batch"].isin(rows["effective_batch"]) & runs["steps"].notna()]
        for key, value in zip(keys, group if isinstance(group, tuple) else (group,)):
            mine = mine[mine[key] == value]
        fitted = fit(mine["effective_batch"], mine["steps"])  # the findings' fit, over every run that reached it
        if fitted and rows["effective_batch"].min() <= fitted[0] <= rows["effective_batch"].max():
            xs = np.geomspace(rows["effective_batch"].min(), rows["effective_batch"].max(), 50)
            left.plot(xs, fitted[1] * (1 + fitted[0] / xs), ":", color=color, linewidth=1)
    got = table.dropna(subset=["steps"]).sort_values("effective_batch")
    b0 = got["effective_batch"].iloc[0]
    first = got[got["effective_batch"] == b0]["steps"].min()
    xs = np.array(sorted(table["effective_batch"].unique()), float)
    left.plot(xs, first * b0 / xs, "--", color="gray", label="perfect scaling (steps ∝ 1/B)")
    right.plot(xs, np.full_like(xs, first * b0), "--", color="gray", label="perfect scaling (samples constant)")
    for ax, label in ((left, "optimizer steps to target"), (right, "training samples to target")):
        _log2_axis(ax, xs)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set(xlabel="effective batch B", ylabel=label)
    left.legend(title=" / ".join(keys) or None, fontsize=8)
    every = "once an epoch" if evals is None else "every eval_every_steps"
    fig.suptitle(f"target: {100 * target:.1f}% validation accuracy (95% of the best mean), evaluated {every}; "
                 f"lines: medians over every run at a B; dotted: S = S_min (1 + B_crit / B) fitted to the runs, where B_crit "
                 f"lies within the Bs run; no point: most runs never reached the target", fontsize=9)
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
               objective: tuple[str, str] | None = None) -> list[Draw]:
    """Each figure the report may draw, as a call that draws it, or gives None where the data does not support it
    (the report counts them on its bar). `objective` is the study's first (metric, direction)."""
    return [partial(make, trials, *args) for make, args in (
        (accuracy_vs_batch, (objective,)), (steps_vs_batch, (history, evals)), (warmup_curves, (evals,)),
        (memory_vs_batch, ()), (throughput, ()), (learning_curves, (history, objective)),
        (lr_scaling, (objective,)), (bn_rules, (objective,)), (equivalence, ()),
        (health, (history,)))]


def all_figures(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None = None,
                objective: tuple[str, str] | None = None) -> Iterator[Figure]:
    """Each figure the data supports, drawn as it is asked for."""
    return (figure for figure in (draw() for draw in candidates(trials, history, evals, objective))
            if figure is not None)
