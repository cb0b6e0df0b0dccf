"""Which norm did better at each B, where a study varied the norm: the norms paired by seed over the
configurations that finished under every norm there, those left out said with why."""
from __future__ import annotations

import pandas as pd

from .best import CONTINUOUS, label
from .measures import (NOT_SETTINGS, SEARCHED, WORSE, Measure, finished, group_keys, group_label, no_batchnorm,
                       stopped_verb)
from .plotting import in_order
from .rules import ended_how
from .runs import paired, quantum
from .verdicts import judge
from .wording import listed, lowered, stated

SHOWN = 5  # configurations a 'left out' list names before it counts the rest


def _norms_at(t: pd.DataFrame, m: Measure, fields: list[str], inner: list[str]) -> str:
    """The norms at each B of `t` (one model and dataset, every run): each against the norm of the best mean there,
    paired by seed over the configurations (`fields`' values) that finished under every norm in that seed (_matched:
    a norm that lost a configuration to divergence or memory is not averaged over others than the rest), under
    Benjamini-Hochberg over every B's contrasts; a norm is said to do better only where every contrast with it is
    resolved its way, else that none was shown to; once that none is compared where one field leaves the norms no
    configuration in common (_unshared). '' where no B ran two norms."""
    step, at = quantum(finished(t)[m.name]), []
    if not any(rows["norm"].nunique() > 1 for _, rows in t.groupby("effective_batch")):
        return ""
    if unshared := _unshared(t, fields):
        return unshared
    for b, rows in t.groupby("effective_batch"):
        if rows["norm"].nunique() < 2:
            continue
        kept, left = _matched(rows, fields, inner, m.name)
        cells = kept.groupby(["norm", "seed", *fields], dropna=False)[m.name].mean().reset_index()  # (once each)
        means = (cells.groupby(["norm", "seed"])[m.name].mean().groupby("norm").mean()
                 .sort_values(ascending=not m.maximize, kind="stable"))
        mine = [(other, paired(cells[cells["norm"] == means.index[0]], cells[cells["norm"] == other], m.name, step),
                 round(means.iloc[0], 9) == round(means[other], 9)) for other in means.index[1:]]
        at.append((int(b), means.index[0] if mine else None, mine, left, rows["norm"].nunique()))
    verdicts = iter(judge([d for _, _, mine, _, _ in at for _, d, _ in mine], m.margin))
    parts = []
    for b, best, mine, left, ran in at:
        if not mine:
            parts.append(f"at B = {b}, not compared: no configuration finished under {'both' if ran == 2 else 'every'}"
                         f" norm{'s' * (ran == 2)} in one seed ({left})")
            continue
        mine = [(other, d, level, next(verdicts)) for other, d, level in mine]
        against = "; ".join(f"{best} against {other}: {stated(d, m=m, v=v)}" for other, d, _, v in mine)
        against += f"; left out: {left}" if left else ""
        if all(v is not None and v.resolved and (d.mean > 0) == m.maximize for _, d, _, v in mine):
            parts.append(f"at B = {b}, norm = {best} did better ({against})")
            continue
        tied = [other for other, _, level, _ in mine if level]
        mean = (f"{listed([best, *tied])} had the same mean" if tied else
                f"{best} had the {'highest' if m.maximize else 'lowest'} mean")
        parts.append(f"at B = {b}, no norm was shown to do better ({mean}; {against})")
    return (f"The norms at each B, each over the configurations that finished under every norm in the same seed (a "
            f"seed's configurations averaged), paired by seed: {'; '.join(parts)}." if parts else "")


def _unshared(t: pd.DataFrame, fields: list[str]) -> str:
    """That the norms are not compared, said once, where one field alone leaves them no configuration in common: at
    no B did one value of it run under every norm that ran there (a searched learning rate, each trial its own
    value), so each B's list of the configurations left out would name every trial; '' where at some B each field
    has a value that every norm there ran."""
    names = in_order("norm", t["norm"].unique())
    at = [rows for _, rows in t.groupby("effective_batch") if rows["norm"].nunique() > 1]
    for f in fields:
        if any(set.intersection(*(set(rows.loc[rows["norm"] == n, f].astype(str)) for n in rows["norm"].unique()))
               for rows in at):
            continue
        n = t[f].nunique()
        took = ""
        if pd.api.types.is_numeric_dtype(t[f]) and (n == len(t) or n > CONTINUOUS):
            took = (f"{f} took a value of its own in each of the {n} trials, and " if n == len(t) else
                    f"{f} took {n} values over {len(t)} trials, and ")
        it = "it" if took else f
        if len(names) == 2:
            return (f"The norms at each B are not compared: {took}no value of {it} ran under both {names[0]} and "
                    f"{names[1]} at one B, so no configuration ran under both.")
        return (f"The norms at each B are not compared: {took}at no B did one value of {it} run under every norm that "
                f"ran there ({listed(names)} in all), so no configuration ran under every norm at one B.")
    return ""


def _matched(rows: pd.DataFrame, fields: list[str], inner: list[str], value: str) -> tuple[pd.DataFrame, str]:
    """The runs at one B in the (seed, configuration) cells where every norm there finished with `value`, and the
    cells left out and why ('b = 512, k = 1, where batch ran out of memory in seeds 0, 1 and 2'; '' where none), the
    first SHOWN configurations named and the rest counted."""
    names = in_order("norm", rows["norm"].unique())
    kept, why = [], {}  # (configuration -> what happened -> the seeds it happened in)
    for key, cell in rows.groupby(["seed", *fields], dropna=False):
        said = [s for n in names for s in _why_not(cell[cell["norm"] == n], value, n, inner)]
        if not said:
            kept += list(cell.index)
            continue
        config = label(dict(zip(fields, key[1:])), fields) or "the runs"
        for s in said:
            why.setdefault(config, {}).setdefault(s, []).append(str(int(key[0])))
    told = [f"{config}, where " + listed([f"{s} in seed{'s' * (len(seeds) > 1)} {listed(seeds)}"
                                         for s, seeds in whys.items()]) for config, whys in why.items()]
    if len(told) > SHOWN + 1:  # (one more is named rather than counted)
        told = [*told[:SHOWN], f"and {len(told) - SHOWN} more configurations"]
    return rows.loc[kept], "; ".join(told)


def _why_not(runs: pd.DataFrame, value: str, norm: str, inner: list[str]) -> list[str]:
    """How a norm's runs of one configuration in one seed gave no `value`, each way once ('batch diverged', 'batch
    (BN scaled) diverged', 'group did not run'); [] where each finished with one."""
    if runs.empty:
        return [f"{norm} did not run"]
    done, how = finished(runs), {}
    for i, run in runs.iterrows():
        if i not in done.index:
            reason = run.get("reason")
            said = (stopped_verb(reason) if reason in WORSE else
                    ended_how(reason, run["status"], run.get("config_mismatch")))
        elif pd.isna(run[value]):
            said = f"logged no {value}"
        else:
            continue
        how.setdefault(said, []).append(i)
    return [f"{_whose(runs, ids, norm, inner)} {said}" for said, ids in how.items()]


def _whose(runs: pd.DataFrame, ids: list, norm: str, inner: list[str]) -> str:
    """The runs `ids` of a norm's `runs` in one cell, as a sentence names them: the norm where they are all its runs
    there; else with the fields that tell its runs apart ('batch (BN scaled)': a BN rule is no field of the
    configuration where another norm has no BatchNorm), or as one of so many where none does (a run repeated)."""
    if len(ids) == len(runs):
        return norm
    apart = [f for f in inner if f in runs and runs[f].nunique(dropna=False) > 1]
    if apart:  # (a run repeated under one label: counted, not named twice)
        names = pd.Series([label(runs.loc[i], apart) for i in ids]).value_counts(sort=False)
        return f"{norm} ({listed([name if n == 1 else f'{name} ×{n}' for name, n in names.items()])})"
    return f"{'one' if len(ids) == 1 else len(ids)} of {norm}'s {len(runs)} runs"


def _norm_fields(t: pd.DataFrame, varied: tuple[str, ...] | None) -> tuple[list[str], list[str]]:
    """The fields besides the norm that make a configuration at a B (b, k, the LR rule, the BN momentum rule, any
    other varied field), where they took several values; and all of those, which tell a norm's runs in one
    configuration apart. Where a norm has no BatchNorm its BN rule sets nothing (one_bn_rule() may have kept one
    rule's runs), so the BN rule is no field of the configuration there."""
    every = [f for f in dict.fromkeys([*SEARCHED, *(varied or ()), "bn_momentum_rule"]) if f in t and f != "norm"
             and (f == "bn_momentum_rule" or f not in NOT_SETTINGS) and t[f].nunique(dropna=False) > 1]
    without = any(no_batchnorm(rows) for _, rows in t.groupby("norm"))
    return [f for f in every if f != "bn_momentum_rule" or not without], every


def norms(trials: pd.DataFrame, m: Measure | None, varied: tuple[str, ...] | None = None) -> list[str]:
    """Where the study varied the norm, which did better at each B (_norms_at), per model and dataset, over the
    configurations of the study's `varied` fields that finished under every norm."""
    t = finished(trials)
    if m is None or "norm" not in t or t["norm"].nunique() < 2 or not {m.name, "effective_batch", "seed"} <= set(t):
        return []
    keys = [k for k in group_keys(trials) if k != "norm"]
    groups = trials.groupby(keys) if keys else [((), trials)]
    said = [(group_label(keys, group), _norms_at(rows, m, *_norm_fields(rows, varied))) for group, rows in groups]
    return [f"{name}: {lowered(s)}" if name else s for name, s in said if s]
