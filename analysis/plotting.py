"""How the report's figures look and say what stands behind them: the Figure, the order and colour of each
split field's values (the same in every report), log axes, and the caption of trials and protocol."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .measures import bn_rules_apart  # noqa: E402


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
    group: str = ""  # the runs it draws where the findings group a study's runs ('cnn1d', 'norm = none'), else ''


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


def varies(trials: pd.DataFrame, column: str) -> bool:
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
    """The field that splits the trials (the first of SPLITS that varies; the BN momentum rule of a model without
    BatchNorm only where it keeps its runs apart, bn_rules_apart()), and colors() of it."""
    column = next((c for c in SPLITS if varies(trials, c) and (c != "bn_momentum_rule" or bn_rules_apart(trials))),
                  None)
    return (column, colors(trials, column)) if column else (None, {})


def log2_axis(ax, values) -> None:
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
