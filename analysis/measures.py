"""What the report compares trials in, and which trials it compares: a Measure (accuracy in points, or a
study's own metric in its units), the finished trials, the trials at one B, and the noise scales that can be
read."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .runs import DERIVED, METRICS, TAGS, Difference

WORSE = ("diverged", "pruned")  # a trial that ended so was stopped for doing worse: evidence, not a missing seed


SEARCHED = ("physical_batch", "accum_steps", "lr_rule", "base_lr")  # (checked where the study's list lacks them)
NOT_SETTINGS = ("run_id", "status", "seed", "batch", "bn_momentum_rule", *DERIVED, *TAGS, *METRICS)


def stopped(reasons) -> str:
    """How the trials of `reasons` that ended worse ended: 'diverged', 'pruned' or 'diverged or pruned'."""
    seen = set(reasons)
    return " or ".join(r for r in WORSE if r in seen) or "diverged"


def stopped_verb(word: str) -> str:
    """'diverged', 'was pruned', 'diverged or was pruned' (stopped()'s word as a verb)."""
    return word.replace("pruned", "was pruned")


def rounded(x: float) -> float:
    """A mean to 9 significant digits, where means rank: the same per-seed values summed in another order differ
    in their last bits (2.914 and 2.9139999999999997), and an exact tie is a tie, not a win."""
    return float(f"{x:.9g}") if math.isfinite(x) else x


def finished(trials: pd.DataFrame) -> pd.DataFrame:
    """The trials that finished as they were asked to: a script that did not (config_mismatch) compares nothing."""
    done = trials["status"] == "FINISHED"
    if "config_mismatch" in trials:
        done &= trials["config_mismatch"].isna()
    return trials[done]


def has_accuracy(trials: pd.DataFrame) -> bool:
    """Whether any trial has a validation accuracy (float targets, as a regression has, give none)."""
    return "val_acc" in trials and bool(np.isfinite(trials["val_acc"].astype(float)).any())


NO_BN_LAYER = "has no BatchNorm layer"  # the trainer's note where a BN momentum rule found no layer to act on
NORM_ACTS_ON = ("", "cnn1d")  # the one model `norm` acts on, or a frame that names no model


def _text(t: pd.DataFrame, column: str) -> pd.Series:
    return t[column].astype(object).fillna("").astype(str) if column in t else pd.Series("", index=t.index)


def no_batchnorm(t: pd.DataFrame) -> str:
    """How the trials show a model without BatchNorm ('mlp, in whose runs the trainer found no BatchNorm layer',
    'norm = none'), '' where they do not, decided per model and norm (every trial must be of one without) from what
    was measured. The trainer logs bn_mean_error exactly where the model has BatchNorm layers and the run finished,
    so where the trials hold that column, a model's finished runs (of the trainer, not a [program]'s script) decide;
    where a model has no finished run (or no run logged the column), the trainer's note that a BN momentum rule or
    ghost batch found no BatchNorm layer; where neither is there, `norm` none or group of cnn1d, the one model it
    acts on (a user's model ignores it, and may hold BatchNorm)."""
    model, norm, program = _text(t, "model"), _text(t, "norm"), _text(t, "batchsweep.program") != ""
    kind = model + "\0" + norm
    ran = pd.Series(t.index.isin(finished(t).index) if "status" in t else False, index=t.index) & ~program
    measured = set(kind[ran]) if "bn_mean_error" in t else set()
    with_bn = set(kind[ran & t["bn_mean_error"].notna()]) if measured else set()
    noted = set(kind[_text(t, "warnings").str.contains(NO_BN_LAYER, regex=False)]) - measured
    by_norm = set(kind[model.isin(NORM_ACTS_ON) & norm.isin(("none", "group")) & ~program]) - measured - noted
    found = (measured - with_bn) | noted
    if t.empty or not kind.isin(found | by_norm).all():
        return ""
    said = [_kinds(sorted(found), ", in whose runs the trainer found no BatchNorm layer")] if found else []
    return "; ".join([*said, *([_kinds(sorted(by_norm), "")] if by_norm else [])])


def _kinds(kinds: list[str], why: str) -> str:
    """'mlp and cnn1d with norm = none' + why, or where no model is named, 'norm = none' (its runs)."""
    names = []
    for k in kinds:
        model, norm = k.split("\0")
        set_to = f"norm = {norm}" if norm not in ("", "batch") else ""
        names.append(f"{model} with {set_to}" if model and set_to else model or set_to)
    named = " and ".join(n for n in dict.fromkeys(names) if n)
    return f"{named}{why}" if named else ("the trainer found no BatchNorm layer in its runs" if why else "")


def bn_rules_apart(t: pd.DataFrame) -> bool:
    """Whether the BN momentum rule keeps the trials apart (a figure's split, a series to the target): where it
    varies, and for a model without BatchNorm only where it varies among the runs at k > 1, as it does where the
    findings keep every run (findings.one_bn_rule: rules that moved with another field, or fields not known); where
    they count as one configuration, the runs at k > 1 hold one rule and those at k = 1 may hold another."""
    if "bn_momentum_rule" not in t or t["bn_momentum_rule"].nunique() < 2:
        return False
    accumulated = t[t["accum_steps"] > 1] if "accum_steps" in t else t
    return not no_batchnorm(t) or accumulated["bn_momentum_rule"].nunique() > 1


def not_rounded_away(x: float, places: int, sign: str = "") -> str:
    """`places` decimals, or two significant digits where those would show a non-zero x as zero."""
    return f"{x:{sign}.{places}f}" if round(abs(x), places) or not x else f"{x:{sign}.2g}"


@dataclass(frozen=True)
class Measure:
    """What the report compares configurations in: accuracy in points, or a study's own metric (a regression's
    val_loss) in its own units, two significant digits, where lower may be better."""

    name: str = "val_acc"
    maximize: bool = True
    margin: float = 0.01  # equivalence margin: 1 accuracy point; for a metric of its own, own_margin()
    full: float = 1.0  # an accuracy's value at 100%: 1, or 100 where a script logs it in percent
    reference: str = ""  # for a metric of its own: what its margin was read from ("B = 32's mean 0.13 ...")

    @property
    def margin_why(self) -> str:
        """What the margin δ of a metric of its own is, and why (accuracy's 1 point goes without saying)."""
        if self.points:
            return ""
        if not self.margin:
            return (f"no equivalence margin δ is set for {self.name}: {self.reference}, so nothing is called "
                    f"equivalent")
        return (f"±{self.margin_text} is the equivalence margin δ: {REFERENCE_SHARE:.0%} of {self.reference}, a "
                f"share of the metric's level as accuracy's 1 point is; not the seeds' spread, which one bad seed can "
                f"widen until every B reads equivalent")

    @property
    def margin_text(self) -> str:
        points = self.scaled(self.margin)
        return f"{points:g} point{'s' * (points != 1)}" if self.points else f"{_two_digits(self.margin)} in {self.name}"

    @property
    def within(self) -> str:
        """'within ±δ', or where no margin is set, that none is."""
        return f"within ±{self.margin_text}" if self.margin else "(no equivalence margin δ is set)"

    @property
    def costs_little(self) -> str:
        """What a B shown to cost little against the smallest B was shown to do (at_batch.largest_free())."""
        return (f"cost less than {self.margin_text}" if self.margin else
                "do better than the smallest B (no equivalence margin δ is set)")

    @property
    def points(self) -> bool:
        return self.name == "val_acc"

    def scaled(self, x: float) -> float:
        return 100 * x / self.full if self.points else x

    def places(self, *xs: float) -> int:
        """Decimals that give the largest of xs two significant digits, at most 4 (accuracy points: one)."""
        largest = max((abs(x) for x in xs if math.isfinite(x)), default=0.0)
        return 1 if self.points else (min(4, max(0, 1 - math.floor(math.log10(largest)))) if largest else 2)

    def interval_places(self, half: float) -> int:
        """Decimals that give an interval's half-width two significant digits (accuracy points: one, and at least
        one decimal), so that its ends read apart: neither '+14 to +14' nor 'val_loss 0.31 ± 0.0'."""
        h = abs(self.scaled(half))
        if not math.isfinite(h) or h == 0:
            return 1 if self.points else 2
        need = -math.floor(math.log10(h))
        return max(1, min(need, 3)) if self.points else max(0, min(need + 1, 6))

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
            margin, reference = own_margin(t, name)
            return Measure(name, direction == "maximize", margin, reference=reference)
    return None


REFERENCE_SHARE = 0.01  # δ for a metric of its own, as a share of the magnitude of the reference's mean
CONFIGURATION = ("physical_batch", "accum_steps", "lr", "lr_rule", "bn_momentum_rule", "base_lr")


def own_margin(trials: pd.DataFrame, name: str) -> tuple[float, str]:
    """The equivalence margin of a metric with no point of its own, and what it was read from: 1% of the magnitude
    of its mean at the reference, the finished trials at the smallest B (each configuration's seeds averaged, the
    configurations' means averaged). Not from the seeds' spread there: one bad seed at B = 32 made twice their sd
    0.17, above B = 32's own mean loss (0.13), and every twin pair and every B read equivalent. 0, said, where the
    reference ran fewer than 2 seeds, has a mean of 0, or no B was logged (then nothing is called equivalent)."""
    t = finished(trials)
    t = t[np.isfinite(pd.to_numeric(t[name], errors="coerce"))]
    if "effective_batch" not in t or not t["effective_batch"].notna().any():
        return 0.0, "no B was logged, so there is no reference (the smallest B) to read it from"
    t = t[t["effective_batch"] == t["effective_batch"].min()]
    where = f"B = {t['effective_batch'].iloc[0]:.0f}"
    keys = [c for c in CONFIGURATION if c in t and t[c].notna().any()]
    seeds = t.groupby([*keys, "seed"], dropna=False)[name].mean() if "seed" in t else pd.Series(dtype=float)
    by = seeds.groupby(level=list(range(len(keys))), dropna=False) if keys else seeds.groupby(lambda _: 0)
    if (by.count() - 1).clip(lower=0).sum() < 1:
        return 0.0, f"the reference, the smallest B ({where}), ran fewer than 2 seeds"
    mean = float(by.mean().mean())
    n = int(seeds.index.get_level_values("seed").nunique())
    if not mean:
        return 0.0, f"the mean of {name} at the reference, the smallest B ({where}), is 0, and 1% of it is none"
    return REFERENCE_SHARE * abs(mean), f"{where}'s mean {mean:.2g} (the smallest B, its configurations over {n} seeds)"


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


def unmoved(trials: pd.DataFrame, m: Measure) -> str | None:
    """Where every finished trial ended at one value of `m` (a model that learned nothing, a metric that does not
    move): the sentence that says so, in place of comparisons whose intervals would have no width."""
    values = pd.to_numeric(finished(trials)[m.name], errors="coerce") if m.name in trials else pd.Series(dtype=float)
    values = values[np.isfinite(values)]
    if len(values) < 2 or values.nunique() > 1:
        return None
    return (f"Every finished trial ended at the same {'accuracy' if m.points else m.name} ({m.level(values.iloc[0])}): "
            f"no configuration differed from another in it (a model that learned nothing, or a metric that does not "
            f"move), so none is compared or recommended.")


def group_keys(trials: pd.DataFrame) -> list[str]:
    """What findings are grouped by: the model, the dataset and the norm where the study varied them (a BN rule's
    effect pooled with runs without BatchNorm is diluted)."""
    return [c for c in ("model", "dataset", "norm") if c in trials and trials[c].nunique() > 1]


def group_label(keys: list[str], group) -> str:
    values = dict(zip(keys, group if isinstance(group, tuple) else (group,)))
    norm = f", norm = {values.pop('norm')}" if "norm" in values else ""
    return " on ".join(map(str, values.values())) + norm if values else norm.removeprefix(", ")
