"""The report's summary: plain sentences computed from the trials frame."""
from __future__ import annotations

import pandas as pd

from .figures import best_lr, critical_batch, finished, tuned
from .runs import aggregate

WITHIN_POINTS = 0.5  # a difference smaller than this, in accuracy points, counts as "the same"
EXACT = 1e-4  # relative parameter difference below which accumulation is float rounding, not a change


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _points(diff: float) -> str:
    return f"{abs(100 * diff):.1f} points"


def lr_rules(trials: pd.DataFrame) -> list[str]:
    """Per LR rule: how far accuracy held up as B grew, against the smallest B."""
    t = finished(trials)
    # The question is how the LR should follow B: it needs several rules, each at one LR per B.
    if "lr_rule" not in t or t["lr_rule"].nunique() < 2 or t["effective_batch"].nunique() < 2 or tuned(t):
        return []
    accumulated = t[t["accum_steps"] > 1] if "accum_steps" in t else t.iloc[:0]
    if not accumulated.empty:  # follow the accumulated series (one b, growing k); the twins are compared apart
        t = t[t["physical_batch"] == accumulated["physical_batch"].mode().iloc[0]]
    out = []
    means = aggregate(t, ["lr_rule", "effective_batch"], "val_acc")
    for rule, rows in means.groupby("lr_rule"):
        rows = rows.sort_values("effective_batch")
        sizes, accs = list(rows["effective_batch"]), list(rows["mean"])
        if len(sizes) < 2:
            continue
        b0, base = sizes[0], accs[0]
        fell = next((i for i, acc in enumerate(accs) if base - acc > WITHIN_POINTS / 100), None)
        if fell is None:
            sentence = f"The {rule} LR rule stayed within {WITHIN_POINTS} points of B = {b0} up to B = {sizes[-1]}"
        elif fell == 1:
            sentence = f"The {rule} LR rule fell more than {WITHIN_POINTS} points below B = {b0} already at B = {sizes[1]}"
        else:
            sentence = f"The {rule} LR rule stayed within {WITHIN_POINTS} points of B = {b0} up to B = {sizes[fell - 1]}"
        if fell is not None or accs[-1] - base > WITHIN_POINTS / 100:
            change = "lost" if accs[-1] < base else "gained"
            sentence += f"; at B = {sizes[-1]} it {change} {_points(accs[-1] - base)} ({_pct(accs[-1])} against {_pct(base)})"
        out.append(sentence + ".")
    largest = means[means["effective_batch"] == means["effective_batch"].max()].sort_values("mean", ascending=False)
    if len(largest) > 1:
        ranked = ", then ".join(f"{r} ({_pct(m)})" for r, m in zip(largest["lr_rule"], largest["mean"]))
        out.append(f"At the largest batch, B = {largest['effective_batch'].iloc[0]}, the best rule was {ranked}.")
    return out


def twins(trials: pd.DataFrame) -> list[str]:
    """Accumulated points against their true-batch twins at the same B and rules."""
    t = finished(trials)
    if "batch" not in t or t["batch"].nunique() < 2:
        return []
    keys = [c for c in ("lr_rule", "effective_batch") if c in t]
    means = aggregate(t[t["effective_batch"] > t["physical_batch"].min()], [*keys, "batch"], "val_acc")
    wide = means.pivot_table(index=keys, columns="batch", values="mean")
    if not {"accumulated", "true batch"} <= set(wide.columns):  # a partial study: no pair yet
        return []
    wide = wide.dropna()
    if wide.empty:
        return []
    gap = wide["accumulated"] - wide["true batch"]
    worst = gap.abs().idxmax()
    where = ", ".join(f"{k} = {v}" for k, v in zip(keys, worst if isinstance(worst, tuple) else (worst,)))
    return [f"Accumulation and the true batch at the same B differed by {_points(gap.abs().mean())} on average "
            f"over {len(gap)} pairs; the largest gap was {_points(gap[worst])} "
            f"({'accumulated ahead' if gap[worst] > 0 else 'true batch ahead'}) at {where}."]


def memory(trials: pd.DataFrame) -> list[str]:
    t = finished(trials)
    if "peak_memory_bytes" not in t or "batch" not in t or t.get("model", pd.Series()).nunique() > 1:
        return []  # memory of different models is not one series
    acc = t[t["batch"] == "accumulated"]
    if acc.empty:
        return []
    b = acc["physical_batch"].mode().iloc[0]
    same_b = t[t["physical_batch"] == b]
    k_max = same_b["accum_steps"].max()
    low, high = same_b["peak_memory_bytes"].min(), same_b["peak_memory_bytes"].max()
    big_b = b * k_max
    true = t[(t["physical_batch"] == big_b) & (t["accum_steps"] == 1)]
    source = ", ".join(t["memory_source"].dropna().unique())
    span = f"at {high / 2 ** 20:.2f} MiB" if high - low < 0.01 * high else \
        f"between {low / 2 ** 20:.2f} and {high / 2 ** 20:.2f} MiB"
    sentence = f"At b = {b}, peak memory ({source}) stayed {span} from k = 1 to k = {k_max}"
    if not true.empty:
        need = true["peak_memory_bytes"].mean()
        sentence += f", while the true batch of {big_b} needed {need / 2 ** 20:.2f} MiB ({need / high:.1f}x)"
    return [sentence + "."]


def bn(trials: pd.DataFrame) -> list[str]:
    t = finished(trials)
    if "bn_momentum_rule" not in t or t["bn_momentum_rule"].nunique() < 2:
        return []
    k = t["accum_steps"].max()
    at_k = aggregate(t[t["accum_steps"] == k], ["bn_momentum_rule"], "val_acc").sort_values("mean", ascending=False)
    ranked = ", ".join(f"{r} {_pct(m)}" for r, m in zip(at_k["bn_momentum_rule"], at_k["mean"]))
    sentence = f"At k = {k} (B = {k * t['physical_batch'].min()}), BN momentum rules reached {ranked}"
    true = t[(t["accum_steps"] == 1) & (t["effective_batch"] == k * t["physical_batch"].min())]
    if not true.empty:
        sentence += f"; the true batch reached {_pct(true['val_acc'].mean())}"
    spread = at_k["mean"].max() - at_k["mean"].min()
    verdict = "the rules made no difference there" if spread < WITHIN_POINTS / 100 else \
        f"the spread between rules was {_points(spread)}"
    return [f"{sentence}: {verdict}."]


def exactness(trials: pd.DataFrame) -> list[str]:
    """Per model: is accumulation exactly the true batch, and if not, why."""
    t = finished(trials)
    if "param_rel_diff" not in t:
        return []
    out = []
    for model, rows in t.groupby("model"):
        worst = rows["param_rel_diff"].max()
        gaps = f"accuracy gap {100 * rows['acc_gap'].min():+.1f} to {100 * rows['acc_gap'].max():+.1f} points"
        has_bn = model == "resnet18" or (model == "cnn1d" and (rows.get("norm") == "batch").all())
        if worst < EXACT:
            out.append(f"{model}: accumulation is exactly the true batch, up to float rounding (largest relative "
                       f"parameter difference {worst:.1e}; {gaps}).")
        else:
            why = ("BatchNorm normalizes each micro-batch of b samples, so accumulated training is Ghost "
                   "BatchNorm with ghost size b (Hoffer et al. 2017), not the true batch" if has_bn else
                   "something in the model depends on the micro-batch (BatchNorm or another batch statistic)")
            ghost = ""
            if "ghost_rel_diff" in rows and rows["ghost_rel_diff"].notna().any():
                ghost = (f" The true batch with ghost_batch = b came within {rows['ghost_rel_diff'].max():.1e} of "
                         f"accumulation, against {worst:.2g} without it: what remains is float rounding.")
            out.append(f"{model}: accumulation is not the true batch (largest relative parameter difference "
                       f"{worst:.2g}; {gaps}): {why}.{ghost}")
    return out


def lr_exponent(trials: pd.DataFrame) -> list[str]:
    found = best_lr(trials)
    if found is None:
        return []
    best, alpha = found
    nearer = "square-root" if abs(alpha - 0.5) < abs(alpha - 1) else "linear"
    return [f"The best learning rate grew as B^{alpha:.2f} (linear scaling predicts 1, square root 0.5; "
            f"nearer the {nearer} rule), from {best['base_lr'].iloc[0]:.3g} at B = {best['effective_batch'].iloc[0]} "
            f"to {best['base_lr'].iloc[-1]:.3g} at B = {best['effective_batch'].iloc[-1]}."]


def noise_scale(trials: pd.DataFrame) -> list[str]:
    """The predicted critical batch, and whether accuracy started to fall near it."""
    b_crit = critical_batch(trials)
    if b_crit is None:
        return []
    t = finished(trials)
    measured = t["noise_scale"].dropna()
    sentence = (f"The gradient noise scale at the last epoch was {b_crit:.0f} (median of {len(measured)} trials "
                f"with k ≥ 2, range {measured.min():.0f}–{measured.max():.0f}): McCandlish et al. (2018) predict "
                f"that batches beyond about {b_crit:.0f} buy little speed-up per sample")
    if "effective_batch" in t and t["effective_batch"].nunique() > 1 and not tuned(t):
        keys = [c for c in ("lr_rule", "bn_momentum_rule", "batch") if c in t and t[c].nunique() > 1]
        means = aggregate(t, [*keys, "effective_batch"], "val_acc")
        best = means.groupby("effective_batch")["mean"].max().sort_index()  # the best configuration at each B
        base = best.iloc[0]
        fell = best[best < base - WITHIN_POINTS / 100]
        if fell.empty:
            sentence += (f"; the best configuration at each B stayed within {WITHIN_POINTS} points of "
                         f"B = {best.index[0]} up to B = {best.index[-1]}")
        else:
            first = int(fell.index[0])
            where = "below" if first < b_crit / 1.5 else "above" if first > b_crit * 1.5 else "near"
            sentence += (f"; the best configuration at each B first fell more than {WITHIN_POINTS} points below "
                         f"B = {best.index[0]} at B = {first} ({100 * fell.iloc[0]:.1f}% against "
                         f"{100 * base:.1f}%), {where} that prediction")
    return [sentence + "."]


def failures(trials: pd.DataFrame) -> list[str]:
    bad = trials[trials["status"] != "FINISHED"]
    if bad.empty:
        return []
    reasons = bad["reason"].fillna("unknown").value_counts()
    listing = ", ".join(f"{n} {reason}" for reason, n in reasons.items())
    return [f"{len(bad)} of {len(trials)} trials did not finish ({listing}); they are left out of the figures."]


def health(trials: pd.DataFrame) -> list[str]:
    if "health" not in trials:
        return []
    broken = trials[trials["health"].notna() & (trials["health"] != "ok")]
    if broken.empty:
        return [f"All {trials['health'].notna().sum()} trials with a health verdict were healthy."]
    counts = ", ".join(f"{n} {verdict}" for verdict, n in broken["health"].value_counts().items())
    return [f"{len(broken)} trials were not healthy ({counts}): see the training health table."]


def summarize(trials: pd.DataFrame) -> list[str]:
    return [*exactness(trials), *lr_rules(trials), *twins(trials), *bn(trials), *lr_exponent(trials),
            *noise_scale(trials), *memory(trials), *failures(trials), *health(trials)]
