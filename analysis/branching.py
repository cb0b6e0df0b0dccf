"""The critical batch measured by branching (Merrill et al. 2025), beside the noise scale over training.

A branch is a trial whose batch_warmup repeats the reference's B₀ for its first t epochs and then trains on
at a larger B (a larger k at the same b): with the same seed and a constant schedule after the warmup, its
first t epochs are the reference run's, bitwise, so it continues the reference from epoch t. It keeps up when,
after the same further epochs (the same samples), its validation loss is within KEEPS_UP_WITHIN of the reference's
at that epoch. The critical batch at t is the largest B that kept up: below it a larger batch trains as well
per sample, in fewer steps."""
from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .measures import WORSE, finished
from .plotting import Figure, context

KEEPS_UP_WITHIN = 0.02  # a branch keeps up when its validation loss is at most 2% above the reference's


@dataclass
class Branches:
    b0: int  # the reference's B
    table: pd.DataFrame  # per (t, B): the mean over seeds of branch loss / reference loss, the seeds, and how
    # many of them kept up on their own
    critical: pd.DataFrame  # per t: the largest B that kept up (b0 where none did)
    noise: pd.DataFrame  # per epoch of the reference: the median reliable noise scale over its seeds


def _prefix(warmup) -> list[int]:
    text = "" if warmup is None or (isinstance(warmup, float) and np.isnan(warmup)) else str(warmup)
    return [int(part) for part in text.split(",") if part.strip()]


def branches(trials: pd.DataFrame, history: pd.DataFrame) -> Branches | None:
    """The study's branches against its reference runs, or None when it has none. A branch that diverged or was
    pruned in a seed did not keep up in that seed (its ratio is infinite), never left out."""
    worse = trials["reason"].isin(WORSE) if "reason" in trials else pd.Series(False, index=trials.index)
    t = pd.concat([finished(trials), trials[worse]])
    if "batch_warmup" not in t or history.empty or "val_loss" not in history:
        return None
    prefix = t["batch_warmup"].map(_prefix)
    branch = prefix.map(lambda p: len(set(p)) == 1) & (t["effective_batch"] > prefix.map(lambda p: p[0] if p else 0))
    if not branch.any():
        return None
    b0 = int(prefix[branch].map(lambda p: p[0]).mode().iloc[0])
    refs = finished(t[(prefix.map(len) == 0) & (t["effective_batch"] == b0)])
    if refs.empty:
        return None
    loss = history.set_index(["run_id", "epoch"])["val_loss"]
    ref_of = dict(zip(refs["seed"], refs["run_id"]))
    rows = []
    for row, p in zip(t[branch].itertuples(), prefix[branch]):
        ref, end = ref_of.get(row.seed), int(row.epochs)
        if p[0] != b0 or ref is None or (ref, end) not in loss:
            continue
        if worse[row.Index]:
            rows.append({"t": len(p), "B": int(row.effective_batch), "ratio": math.inf})
        elif (row.run_id, end) in loss:
            ratio = loss[(row.run_id, end)] / loss[(ref, end)]
            rows.append({"t": len(p), "B": int(row.effective_batch), "ratio": ratio})
    if not rows:
        return None
    rows = pd.DataFrame(rows).assign(kept=lambda r: r["ratio"] <= 1 + KEEPS_UP_WITHIN)
    table = rows.groupby(["t", "B"]).agg(ratio=("ratio", "mean"), seeds=("ratio", "count"),
                                         kept=("kept", "sum")).reset_index()
    kept = table[table["ratio"] <= 1 + KEEPS_UP_WITHIN]
    critical = pd.DataFrame({"t": sorted(table["t"].unique())})
    critical["B"] = critical["t"].map(lambda at: int(kept.loc[kept["t"] == at, "B"].max()) if (kept["t"] == at).any()
                                      else b0)
    return Branches(b0, table, critical, _noise(refs, history))


def _noise(refs: pd.DataFrame, history: pd.DataFrame) -> pd.DataFrame:
    h = history[history["run_id"].isin(refs["run_id"])]
    if "noise_scale" not in h:
        return pd.DataFrame(columns=["epoch", "noise_scale"])
    if "noise_scale_reliable" in h:
        h = h[h["noise_scale_reliable"].fillna(1.0) > 0]
    return h.dropna(subset=["noise_scale"]).groupby("epoch")["noise_scale"].median().reset_index()


def _crossed(table: pd.DataFrame, t: int) -> str:
    """Where a smaller B did not keep up after epoch t while a larger did: no bracket ('' where there is one)."""
    at = table[table["t"] == t].sort_values("B")
    kept = list(at["ratio"] <= 1 + KEEPS_UP_WITHIN)
    pairs = [(a, b) for i, a in enumerate(at["B"]) for j, b in enumerate(at["B"]) if i < j and not kept[i] and kept[j]]
    return f"B = {pairs[0][0]} did not keep up while B = {pairs[0][1]} did" if pairs else ""


def finding(trials: pd.DataFrame, history: pd.DataFrame) -> list[str]:
    found = branches(trials, history)
    if found is None:
        return []
    c, noise = found.critical, found.noise.set_index("epoch")["noise_scale"]

    def bracket(t: int, b: int) -> tuple[float, float]:  # the Bs branched to bound it: kept up at b, not above
        above = found.table.loc[(found.table["t"] == t) & (found.table["B"] > b), "B"]
        return (0 if b == found.b0 else b), (float(above.min()) if len(above) else math.inf)

    def bound(lo: float, hi: float) -> str:
        return f"at least {lo:.0f}" if hi == math.inf else f"below {hi:.0f}" if not lo else \
            f"between {lo:.0f} and {hi:.0f}"

    def crossed(t: int) -> str:
        return _crossed(found.table, t)

    def seeds() -> str:  # how many seeds stand behind it, and where they part
        n = int(found.table["seeds"].min())
        if n == 1:
            return " Each branch ran in one seed: how far its verdict moves with the seed is not measured."
        split = [f"B = {b} after epoch {t}, {k} of {s}" for t, b, k, s in
                 found.table[["t", "B", "kept", "seeds"]].itertuples(index=False) if 0 < k < s]
        return (f" Each verdict is over {n} seeds" + (f"; the seeds part where a mean kept up or not ({'; '.join(split)} "
                f"seeds kept up on their own)." if split else ", each of which agrees with it."))

    brackets = {t: bracket(t, b) for t, b in zip(c["t"], c["B"])}
    said = ", ".join(f"not bracketed after epoch {t} ({crossed(t)})" if crossed(t) else
                     f"{bound(*brackets[t])} after epoch {t}" for t in c["t"])
    out = (f"Branched from the reference at B = {found.b0} into larger batches (the same samples after the branch; "
           f"a branch kept up when its validation loss, the mean over the seeds, came within "
           f"{100 * KEEPS_UP_WITHIN:.0f}% of the reference's), the critical batch was {said} (Merrill et al. 2025; "
           f"bounded by the Bs branched to: the largest that kept up, the next that did not).")
    at = [(t, noise[t]) for t in c["t"] if t in noise.index and not crossed(t)]
    if at:
        where = [f"{'inside' if lo <= n < hi else 'below' if n < lo else 'above'} it at epoch {t}"
                 for t, n in at for lo, hi in [brackets[t]]]
        left = [str(t) for t in c["t"] if t not in dict(at)]  # (not bracketed, or no noise scale measured)
        out += (f" The reference's noise scale was {', '.join(f'{n:.0f} at epoch {t}' for t, n in at)} "
                f"(McCandlish et al. 2018{'; none set against it after epoch ' + ', '.join(left) if left else ''}): "
                f"{', '.join(where)}; the branches bound the critical batch only to the Bs branched to, so no closer "
                f"ratio is said.")
    return [out + seeds()]


def figure(trials: pd.DataFrame, history: pd.DataFrame) -> Figure | None:
    """The critical batch by branching, and the reference's noise scale, against the epoch of training."""
    found = branches(trials, history)
    if found is None:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    c, tops = found.critical, found.table["B"].max()
    # An epoch where a smaller B failed and a larger kept up brackets nothing: no point, a mark at the axis.
    open_ = c["t"].map(lambda t: bool(_crossed(found.table, t)))
    c = c[~open_]
    ax.plot(c["t"], c["B"], "o-", label=f"critical batch by branching (loss within {100 * KEEPS_UP_WITHIN:.0f}% of the "
            f"reference's)")
    for t in found.critical.loc[open_, "t"]:
        ax.axvline(t, color="C3", linewidth=1, linestyle="--")
    if open_.any():
        ax.plot([], [], color="C3", linestyle="--", label="not bracketed (a smaller B failed where a larger kept up)")
    for bound, marker, what in ((c["B"] == tops, "^", "at least (the largest B branched to kept up)"),
                                (c["B"] == found.b0, "v", "below the smallest B branched to")):
        if bound.any():
            ax.plot(c.loc[bound, "t"], c.loc[bound, "B"], marker, markersize=11, color="C0", label=what)
    if not found.noise.empty:
        ax.plot(found.noise["epoch"], found.noise["noise_scale"], "s--", label="noise scale of the reference "
                "(median over seeds)")
    ax.axhline(found.b0, color="gray", linewidth=1, linestyle=":", label=f"reference B = {found.b0}")
    ax.set_yscale("log", base=2)
    sizes = sorted({found.b0, *found.table["B"]})
    ax.set_yticks(sizes, [str(s) for s in sizes])
    ax.set(xlabel="epoch of training (the branch point)", ylabel="batch size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return Figure("critical_batch", "The critical batch over training, measured by branching, beside the noise scale",
                  fig, context(trials))
