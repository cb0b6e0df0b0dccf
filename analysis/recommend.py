"""What to use: the block at the top of a report. It is made from the comparisons the findings state (rules.py:
each LR rule's B against the smallest B, the rules at one B, the twins; best.py: the best configuration and its
ties; space.py: the times to the target), with the same statistics, never from a second computation. Each line
says how sure it is; where the study cannot support a pick (one seed, nothing separable), the block says so and
gives the command that would.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd

from batchsweep.sweeps import commands

from .at_batch import largest_free, per_batch
from .best import (LENGTHS, Best, accounted, below_per_b, best_set, choices, diverged_in_a_seed, label, members,
                   not_compared, picked, stopped_in, unnamed)
from .findings import bn_against_true, exact_by_model, lr_exponent, one_bn_rule
from .measures import Measure, finished, full_scale, group_keys, group_label, measure, stopped_verb, tuned, unmoved
from .runs import StudyRuns
from .space import identical_spread, never_reached, not_timed, objective_trials, shown, timed, times
from .wording import listed, lowered, stated
from .wording import percent as full_percent


def _one_seed(study: StudyRuns, t: pd.DataFrame) -> str:
    """What to run after a study of one seed: the same study over 3 seeds from its own seed (which it keeps), or
    for batch_memory, whose measurements of memory do not vary with the seed, the planner that fits them."""
    if study.name == "batch_memory":  # (the planner reads the study of this name)
        model = "".join(f" --{f} {t[f].iloc[0]}" for f in ("model", "dataset") if f in t and t[f].nunique() == 1)
        return (f"This study measures peak memory and speed at each b, not a choice of accuracy: plan b and k for your "
                f"target from it with `{commands.command('plan')} --target-batch B --memory-budget SIZE{model}` "
                f"(--tracking-uri as here), which fits peak memory against b from these trials.")
    seed = int(t["seed"].iloc[0]) if "seed" in t else 0
    run = (f"`{commands.command('run')} {study.run_as or '--study ' + study.name}{f' --seed {seed}' if seed else ''} "
           f"--seeds 3` (it keeps these trials and adds seeds {seed + 1} and {seed + 2}), then the report again")
    if not choices(study, t)[0]:
        return (f"Nothing here is a choice to recommend: the study varies no field as an independent choice (its "
                f"findings below answer its own question); with one seed they have no intervals: run {run}.")
    return f"With one seed no configuration can be told from another, so nothing is recommended: run {run}."


@dataclass
class Named:
    """The best configuration as the report names it: its recommendation and the trials table's ★ alike."""

    found: Best
    tied: pd.DataFrame  # the best first, then the configurations that cannot be told from it
    trials: pd.Index  # the finished trials of `tied`
    diverged: list[str]  # ties left out: they diverged in a seed
    lower: list[str]  # ties left out: the per-B lines resolve them below the best
    refused: bool  # the best mean's configuration diverged in a seed: no best is named


def named_best(study: StudyRuns, m: Measure | None = None) -> Named | None:
    """best.py's best and ties, less the ties that diverged in a seed or that the per-B lines resolve lower; none
    named where the best mean is one that diverged in a seed (its mean is over the seeds that survived)."""
    value, direction = study.objectives[0]
    m = m or measure(study.trials, study.objectives[0])  # (the report's, where it is that metric)
    m = m if m is not None and m.name == value else Measure(value, direction == "maximize")
    t = finished(study.trials)
    t = t[pd.to_numeric(t[value], errors="coerce").notna()] if value in t else t.iloc[0:0]
    found = best_set(study, t)
    if found is None:
        return None
    fields, tied = found.fields, found.tied
    gone = {label(row, fields) for _, row in diverged_in_a_seed(study.trials, fields).iterrows()}
    out_ = [label(row, fields) for _, row in tied.iterrows() if label(row, fields) in gone]
    refused = bool(out_) and label(tied.iloc[0], fields) in gone
    tied = tied[[label(row, fields) not in gone for _, row in tied.iterrows()]]
    lower = [] if refused else below_per_b(study, m, tied, fields)
    tied = tied[[label(row, fields) not in lower for _, row in tied.iterrows()]]
    return Named(found, tied, pd.Index([]) if refused else members(t, fields, tied), out_, lower, refused)


def best(study: StudyRuns, m: Measure) -> list[str]:
    """The best configuration's mean and the set that cannot be told from it (named_best, as the trials table marks
    it)."""
    value, direction = study.objectives[0]  # (what best_set ranks by; the Measure only where it is that metric)
    m = m if m.name == value else Measure(value, direction == "maximize")
    named = named_best(study, m)
    if named is None:
        return []
    fields, tied, out_, lower, configurations = (named.found.fields, named.tied, named.diverged, named.lower,
                                                 named.found.configurations)
    if named.refused:
        return [f"No best {'accuracy' if m.points else m.name} is named: {out_[0]} had the best mean over the seeds "
                f"that finished but {stopped_verb(stopped_in(study.trials))} in another seed, and a pick among "
                f"survivors is no pick; run the study "
                f"with more seeds or a smaller LR there."]
    top = tied.iloc[0]
    compared = configurations - 1 - len(named.found.uncompared)
    n = int(top["n"])  # (its own finished seeds: a configuration that failed in a seed has fewer)
    first = named.found.highest.copy()
    # (an exact tie of the best mean is named once, in the pick's words: the ties that stay ties, not left out)
    first["level"] = [x for x in first.get("level", []) if x in {label(row, fields) for _, row in tied.iterrows()}
                      and label(first, fields) == label(top, fields)]
    others = [label(row, fields) for _, row in tied.iloc[1:].iterrows() if label(row, fields) not in first["level"]]
    what = "accuracy" if m.points else f"{m.name}{m.better}"
    parts = accounted(others, lower, named.found.resolved, fields)
    parts.insert(1, f"{len(out_)} left out as {stopped_in(study.trials)} in a seed: {'; '.join(out_)}" if out_ else "")
    if compared and len(named.found.resolved) == compared and not named.found.resolved["better"].any():
        parts = [f"every other configuration{' compared' * (not named.found.uncompared.empty)} was resolved worse "
                 f"than it"]
    ties = ("; ".join(p for p in parts if p) + not_compared(named.found.uncompared, fields)).removeprefix("; ")
    pick = picked(top, first, fields, configurations, m.maximize, label(named.found.highest, fields),
                  named.found.settled)
    return [f"The best {what}: {label(top, fields)} ({m.level(top[m.name])} over {n} seeds, {pick})"
            + (f"; {ties}" if ties else "")
            + (f"; paired by seed, Benjamini-Hochberg at 5% over {compared} comparisons" if compared else "") + "."]


def fastest(study: StudyRuns) -> list[str]:
    """The least median time to the target, and every configuration within what identical runs differ by: where
    any is, none is resolved fastest, and they are named."""
    found = times(study)
    value, direction = study.objectives[0]
    timed = not study.history.empty and bool({"epoch_time_s", "group_epoch_time_s"} & set(study.history))
    if found is None and direction != "maximize":  # (fused or not, no trial is timed to a target of a loss)
        return [f"No time to the target is given: the target is a share of the best mean of an objective to "
                f"maximize, and this study minimizes {value}."] if timed else []
    if found is None and value not in study.history:  # (an objective logged once, at the end: a [program]'s score)
        return [f"No time to the target is given: {value} has no per-epoch values, so no time to reach it can be "
                f"read."] if timed else []
    # (fused or not; a length of training, as batch_warmup's arms, is its findings' question: not said so)
    tied = unnamed(study, objective_trials(study)) if found is None and timed else []
    if tied and not set(tied) & set(LENGTHS):
        return [f"No time to the target is given: the study's varied fields were not crossed ({listed(tied)} did not "
                f"each run against every value of the others), so no configuration can be named apart to time."]
    if found is None:
        return _fused(study)
    line = _fastest(study.objectives[0][0], *found[:5])
    gone = found[5]  # (a median over the seeds that survived would be a pick among survivors)
    line = line[:-1] + f"; left out as {stopped_in(study.trials)} in a seed: {'; '.join(gone)}." if gone else line
    return [line[:-1] + never_reached(found[7]) + not_timed(study, found[6]) + "."]


def _fused(study: StudyRuns) -> list[str]:
    """Where the trials trained fused (several in one process: each logged its group's time, not its own), that no
    time to the target is given, and what measures one."""
    h = study.history
    if h.empty or "group_epoch_time_s" not in h:
        return []
    ids = set(study.trials["run_id"])
    fused, total = h.loc[h["group_epoch_time_s"].notna() & h["run_id"].isin(ids), "run_id"].nunique(), len(ids)
    rest = "" if fused >= total else _alone(study)
    # (a model without BatchNorm's BN rules count as one configuration: the runs of the others are not counted)
    counted = " counted (the runs under one BN momentum rule, as said above)" if set(h["run_id"]) - ids else ""
    return [f"No time to the target is given: {'every one' if fused >= total else fused} of the {total} trials{counted} "
            f"trained fused (several configurations at once in one process), each with its group's time, not its "
            f"own{rest}; `{commands.command('run')} "
            f"{study.run_as or '--study ' + study.name} --no-fuse` in a new folder times each trial alone."]


def _alone(study: StudyRuns) -> str:
    """Why the trials timed alone beside fused ones give no time line: too few configurations, or too few of
    them reached the target in most of their seeds."""
    found = timed(study)
    reached, late, gone = (0, [], []) if found is None else (len(found[2]), found[7], found[5])
    alone = reached + len(late)
    left = f" ({len(gone)} more left out as {stopped_in(study.trials)} in a seed)" if gone else ""
    if alone < 2:
        return (f", and {'only ' * (alone == 1)}{alone or 'no'} configuration{'s' * (alone != 1)} "
                f"{'was' if alone == 1 else 'were'} timed alone{left}: too few to compare")
    t, target = found[0], found[4]
    value = study.objectives[0][0]
    to = f"{value} {full_percent(target, full_scale(t[value])) if 'acc' in value else shown(target)}"
    return (f", and of the {alone} configurations timed alone{left}, {'only one' if reached else 'none'} reached "
            f"{to} in most of {'its' if reached else 'their'} seeds")


TIME_FLOOR = 0.05  # the least share of a time that two single wall-clock measurements are taken to resolve


def _fastest(value: str, t: pd.DataFrame, _, points: pd.DataFrame, fields: list[str], target: float) -> str:
    points = points.sort_values("seconds")
    top = points.iloc[0]
    # (an accuracy reads in percent of its own scale: 0.9155 and 91.55 alike read 91.5%)
    to = f"to {value} {full_percent(target, full_scale(t[value])) if 'acc' in value else shown(target)}"
    spread = identical_spread(t, fields)
    if spread is None:
        return (f"The shortest median time {to}: {label(top, fields)} ({top['seconds']:,.1f} s over its seeds); each "
                f"time is one wall-clock measurement, and no identical runs show how far two measurements of one "
                f"configuration lie apart, so it is not shown to be the fastest.")
    # (identical runs that happened to log equal times do not make one wall-clock reading exact)
    floor = max(spread, TIME_FLOOR * top["seconds"])
    why = (f"{floor:,.1f} s is the larger of what identical runs came apart by ({spread:,.1f} s) and "
           f"{100 * TIME_FLOOR:.0f}% of the shortest time: single wall-clock measurements cannot resolve less")
    near = points[points["seconds"] - top["seconds"] <= floor]
    if len(near) == 1:
        return (f"The shortest time {to}: {label(top, fields)} ({top['seconds']:,.1f} s, the median over its seeds), "
                f"ahead of every other configuration by more than {floor:,.1f} s ({why}).")
    return (f"No configuration was resolved fastest {to}: {len(near)} of the {len(points)} reached it within "
            f"{floor:,.1f} s of the shortest median ({top['seconds']:,.1f} s): "
            + "; ".join(f"{label(r, fields)} ({r['seconds']:,.1f} s)" for _, r in near.iterrows()) + f"; {why}.")


def bn_rules(study: StudyRuns, m: Measure) -> list[str]:
    """Per k, against the true batch's final value of the metric, as the findings compare them, every rule placed
    with its interval: resolved better than it, shown to match it (equivalent within the margin, not resolved
    apart), within the margin but resolved worse, within the margin with an interval off 0 that false-discovery
    control does not keep, resolved worse, or neither resolved nor shown to match it."""
    out = []
    for k, b, rules, verdicts, gone in bn_against_true(study.trials, m, study.varied):
        judged = [(r, v) for r, v in zip(rules, verdicts) if v is not None and v.d.n >= 2]
        one = [(r, v) for r, v in zip(rules, verdicts) if v is not None and v.d.n < 2]  # (one seed tells nothing)
        out_ = "".join(f"; {r} {stated(v.d, 'above', 'below', m, v)}" for r, v in one)  # ('in one seed, ...')
        out_ += f"; {'; '.join(dict.fromkeys(gone.values()))}" if gone else ""
        if not judged:
            if gone or one:
                over = " over two seeds or more" if one else ""  # (a rule compared in one seed follows)
                out.append(f"BN momentum at k = {k} (B = {b}): no rule compared with the true batch{over}{out_}.")
            continue
        better = [r for r, v in judged if v.resolved and not m.worse(v.d)]
        same = [r for r, v in judged if v.equivalent and not v.d.separated]  # (an interval off 0: said so)
        close = [r for r, v in judged if v.equivalent and v.resolved and m.worse(v.d)]
        inside = [r for r, v in judged if v.equivalent and v.d.separated and not v.resolved]
        off = "its interval excludes 0 but is" if len(inside) == 1 else "their intervals exclude 0 but are"
        worse = [r for r, v in judged if not v.equivalent and v.resolved and m.worse(v.d)]
        open_ = [r for r, v in judged if not v.resolved and r not in same and r not in inside]
        words = {r: stated(v.d, "above", "below", m, v) for r, v in judged}

        def each(names: list[str]) -> str:
            return "; ".join(f"{r} {words[r]}" for r in names)
        parts = [f"{listed(better)} resolved better than it ({each(better)})" if better else "",
                 f"{listed(same)} shown to match it ({each(same)})" if same else "",
                 f"{listed(close)} within ±{m.margin_text} of it but resolved worse ({each(close)})" if close else "",
                 f"{listed(inside)} within ±{m.margin_text} of it; {off} not kept by Benjamini-Hochberg "
                 f"({each(inside)})" if inside else "",
                 f"{listed(worse)} resolved worse than it ({each(worse)})" if worse else "",
                 f"{listed(open_)} neither shown to match it {m.within} nor resolved from it "
                 f"({each(open_)})" if open_ else ""]
        none = "" if better or same or close or inside else f"no rule shown to match it {m.within} or to do better: "
        what = "accuracy" if m.points else m.name
        out.append(f"BN momentum at k = {k} (B = {b}), against the true batch's final {what}: "
                   f"{none}{'; '.join(p for p in parts if p)}{out_}.")
    return out


def exact_use(study: StudyRuns) -> list[str]:
    """A study of exactness (its objective param_rel_diff, as `equivalence`): per model, whether to accumulate,
    as the findings' exactness reads. Its k and models are not choices ranked by that difference."""
    out = []
    for e in exact_by_model(study.trials):
        if e.exact:
            out.append(f"On {e.model}: accumulate to reach a B that does not fit; it trains as the true batch does, "
                       f"up to float rounding (below), so b is the largest that fits your memory "
                       f"(`{commands.command('plan')} --target-batch B --memory-budget SIZE`).")
        elif e.batchnorm:
            out.append(f"On {e.model}: accumulation is not the true batch (BatchNorm normalizes each micro-batch, "
                       f"below); what that costs in accuracy, and which BN momentum rule comes nearest the true "
                       f"batch, is what `{commands.command('run')} --study bn_momentum` measures.")
        else:
            out.append(f"On {e.model}: accumulation is not the true batch, and not through BatchNorm (below): find "
                       f"what in the model depends on the micro-batch before accumulating.")
    return out


def per_model(study: StudyRuns) -> list[tuple[str, StudyRuns]]:
    """The study as one ('', study), or per model (and dataset) where it ran several, each with its own runs: a
    pick pooled over models holds for none of them."""
    keys = group_keys(study.trials)
    if not keys:
        return [("", study)]
    out = []
    for group, rows in study.trials.groupby(keys):
        name = group_label(keys, group)
        history = study.history[study.history["run_id"].isin(rows["run_id"])] if not study.history.empty else \
            study.history
        evals = study.evals[study.evals["run_id"].isin(rows["run_id"])] if study.evals is not None else None
        out.append((name, replace(study, trials=rows, history=history, evals=evals,
                                  varied=tuple(f for f in study.varied if f not in keys))))
    return out


def starred(study: StudyRuns) -> pd.Index | None:
    """The trials the trials table marks ★: each model's best and ties (named_best), None where none is named."""
    named = [named_best(replace(one, trials=one_bn_rule(one.trials, one.varied)[0])) for _, one in per_model(study)]
    named = [n.trials for n in named if n is not None and not n.refused]
    return named[0].append(named[1:]) if named else None


def recommend(study: StudyRuns) -> list[str]:
    """The recommendation's lines: per B, then the pick for each goal the study can speak to; per model (and
    dataset, and norm) where the study ran several, as the findings are (per_model()), each with its BN momentum
    rules judged on its own runs (one_bn_rule(): as one configuration without BatchNorm; k = 1 runs under their
    arm's rule)."""
    groups = per_model(study)
    if len(groups) == 1 or study.objectives[0][0] == "param_rel_diff":  # (exactness already speaks per model)
        trials, no_bn = one_bn_rule(study.trials, study.varied)
        return [*filter(None, [no_bn]), *_recommend(replace(study, trials=trials))]
    out = []
    for name, one in groups:
        trials, no_bn = one_bn_rule(one.trials, one.varied)
        out += [f"On {name}: {lowered(line)}" for line in [*filter(None, [no_bn]),
                                                           *_recommend(replace(one, trials=trials))]]
    return out


def _one_b_search(study: StudyRuns, t: pd.DataFrame, m: Measure) -> list[str]:
    """An LR search that ran one B: how the LR should change with B needs 2 Bs or more; at its B, the best LR with
    those that cannot be told from it (the best line's comparison), or with one seed, what to run."""
    sizes = sorted(int(b) for b in pd.to_numeric(t["effective_batch"], errors="coerce").dropna().unique())
    if len(sizes) != 1:
        return []
    head = (f"This LR search ran one B (B = {sizes[0]}), so it cannot say how the learning rate should change "
            f"with B: that needs the search at 2 Bs or more")
    if "seed" not in t or t["seed"].nunique() < 2:
        return [f"{head}. {_one_seed(study, t)}"]
    found = best(study, m)
    return [f"{head}. At B = {sizes[0]}: {lowered(found[0])}" if found else f"{head}."]


def _recommend(study: StudyRuns) -> list[str]:
    t = finished(study.trials)
    m = measure(study.trials, study.objectives[0])
    if m is None or t.empty:
        return []
    if study.objectives[0][0] == "param_rel_diff":  # (a measurement of exactness, not a goal to rank k by)
        return exact_use(study)
    if tuned(t):  # a search of the LR at each B: its answer is the best LR against B, with its interval
        said = [f"The learning rate to use at each B: {lowered(s)}" for s in lr_exponent(study.trials, m)]
        return said or _one_b_search(study, t, m)
    if ("seed" not in t or t["seed"].nunique() < 2) and len(t) > 1:
        return [_one_seed(study, t)]
    if said := unmoved(t, m):  # (the time to a target is still measured)
        return [said, *fastest(study)]
    lines = [*per_batch(study, m), *best(study, m), *largest_free(study, m), *fastest(study), *bn_rules(study, m)]
    if not lines and not choices(study, t)[0]:
        return ["Nothing here is a choice to recommend: the study varies no field as an independent choice (its "
                "findings below answer its own question)."]
    if not lines:
        return ["Nothing is recommended: too few trials finished to compare configurations."]
    said = not m.margin or any(m.margin_text in s for s in lines)  # (no margin: said, as nothing is equivalent)
    margin = [f"In these lines {m.margin_why}."] if m.margin_why and said else []
    return lines + margin
