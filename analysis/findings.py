"""The report's summary: plain sentences computed from the trials frame (the LR rules and the twins in
rules.py, steps to a target and batch warmup in targets.py).

Every comparison (rule against rule, accumulated against its true-batch twin, a batch against the smallest
one) pairs the trials of the same seed (same initial weights, same sample order) and reads as its verdict
(verdicts.py): a difference only where its 95% t-interval excludes 0 and Benjamini-Hochberg over the
sentence's comparisons keeps it, "equivalent within ±margin" only where the interval lies inside the
margin, else "not resolved with N seeds", with the seeds that would resolve it. With one seed no difference
can be separated from seed noise, and the sentences say so.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from . import branching
from .best_lr import moved, over_training, rule_reading
from .figures import best_lr, best_lr_of_seeds, trained_lr
from .measures import (ACCURACY, NOT_SETTINGS, SEARCHED, Measure, finished, group_keys, group_label, has_accuracy,
                       measure, no_batchnorm, one_batch, reliable_noise, unmoved)
from .norms import norms
from .plotting import in_order
from .rules import ended_how, ended_worse, lr_rules, twins, unlogged, unpaired, went
from .runs import paired, quantum, typed
from .targets import steps, warmup
from .verdicts import control, judge
from .wording import listed, lowered, significant, stated

EXACT = 1e-4  # relative parameter difference below which accumulation is float rounding, not a change
FLOAT64_ROUNDING = 1e-10  # in float64, a ghost twin this close shows that what is left in float32 is rounding


def _seed_note(t: pd.DataFrame) -> list[str]:
    if "seed" in t and t["seed"].nunique() == 1 and len(t) > 1:
        return ["With one seed no difference between configurations can be told from seed noise; run the study "
                "with --seeds 3 (or more) to separate them."]
    return []


def rule_at_one(trials: pd.DataFrame, varied: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The grid runs every k = 1 point under the default BN momentum rule (there every rule sets the default
    momentum), so a k = 1 run's label does not say whose arm it is. Where the rule moved with the study's other
    `varied` fields ("bn_momentum_rule+weight_decay"), those fields say it: each k = 1 run takes the rule that ran
    at k > 1 with its values of them, so an accumulated run's true-batch twin is the run at B with its weight decay,
    not every run labelled default. Where the rules crossed those fields, or no fields are known, the trials as
    they are (a k = 1 run is then every rule's twin)."""
    fields = arm_fields(trials, varied)
    up = trials[(trials["accum_steps"] > 1) & trials["bn_momentum_rule"].notna()] if fields else trials
    if not fields or up["bn_momentum_rule"].nunique() < 2:
        return trials
    combo = _combos(trials, fields)
    if (up.groupby(combo[up.index])["bn_momentum_rule"].nunique() > 1).any():
        return trials  # (crossed with some field: no one rule is a k = 1 run's)
    rule = combo[trials["accum_steps"] == 1].map(dict(zip(combo[up.index], up["bn_momentum_rule"]))).dropna()
    return trials.assign(bn_momentum_rule=trials["bn_momentum_rule"].where(~trials.index.isin(rule.index), rule))


def arm_fields(trials: pd.DataFrame, varied: tuple[str, ...] | None) -> list[str]:
    """The varied fields besides b, k and the BN momentum rule that the accumulated runs took several values of: an
    accumulated run's true-batch twin (b·k, 1, under default) holds the same values of them."""
    if not varied or not {"bn_momentum_rule", "accum_steps"} <= set(trials) or trials.empty:
        return []
    up = trials[(trials["accum_steps"] > 1) & trials["bn_momentum_rule"].notna()]
    return [f for f in dict.fromkeys([*varied, *SEARCHED]) if f in trials and f not in NOT_SETTINGS
            and f not in ("physical_batch", "accum_steps") and up[f].nunique() > 1]


def _combos(t: pd.DataFrame, fields: list[str]) -> pd.Series:
    """Each run's values of `fields` as one text (a missing value too)."""
    return pd.Series(["|".join(v) for v in zip(*(t[f].map(str) for f in fields))], index=t.index, dtype=object)


def one_bn_rule(trials: pd.DataFrame, varied: tuple[str, ...] | None = None) -> tuple[pd.DataFrame, str]:
    """Where the trials record a model without BatchNorm (no_batchnorm()) and vary the BN momentum rule, that rule
    sets a momentum no layer uses. Where it ran under every combination of the study's other varied fields
    (`varied`, with b, k, the LR rule and base LR) at k > 1, its rules are one configuration: the trials of the
    first rule alone (at k = 1, of one rule), and the sentence that says so. Without `varied` (trials from no
    store), which fields are settings is not known (a result can repeat a value), so every run is kept. Where it
    moved with another field (zipped with the LR rule, the weight decay, ...), every run is kept (the first rule's
    alone would drop that field's other values), and the sentence names the field its differences come from; no
    sentence ranks its rules (bn(), bn_against_true()).
    Else (trials, ''). Either way k = 1 runs take the rule of their arm where it moved with other fields
    (rule_at_one())."""
    trials = rule_at_one(trials, varied)
    t = finished(trials)
    without = no_batchnorm(t)
    if not without or "bn_momentum_rule" not in t or t["bn_momentum_rule"].nunique() < 2:
        return trials, ""
    rules = in_order("bn_momentum_rule", t["bn_momentum_rule"].dropna().unique())
    said = f"The model has no BatchNorm ({without}): "
    if not varied:
        return trials, (f"{said}the BN momentum rules {listed(rules)} set a momentum no layer uses; which fields they "
                        f"ran with is not recorded, so every run is kept, and no BN momentum rule is ranked.")
    ran = trials[trials["bn_momentum_rule"].notna()]  # (a run that diverged or failed ran under its settings too)
    # At k = 1 every rule sets the default momentum: one configuration, which the grid runs under default alone, so
    # the rules are checked for crossing where k > 1.
    at_1 = ran["accum_steps"] == 1 if "accum_steps" in ran else pd.Series(False, index=ran.index)
    ran, ones = (ran[~at_1], ran[at_1]) if (~at_1).any() else (ran, ran.iloc[0:0])
    rules = in_order("bn_momentum_rule", ran["bn_momentum_rule"].unique())
    others = [f for f in dict.fromkeys([*varied, *SEARCHED]) if f in ran and f not in NOT_SETTINGS
              and ran[f].nunique() > 1]
    crossed = not others or (ran.groupby(others, dropna=False)["bn_momentum_rule"].nunique() == len(rules)).all()
    if crossed:
        first = in_order("bn_momentum_rule", ones["bn_momentum_rule"].unique())[:1]  # (k = 1 under one rule)
        at_one, how = _one_run_at_k1(ones, varied)
        kept = trials[trials.index.isin([*ran.index[ran["bn_momentum_rule"] == rules[0]], *at_one])]
        under = rules[0] if first in ([], rules[:1]) else f"{rules[0]} at k > 1 and under {first[0]} at k = 1"
        if set(ones.loc[at_one, "bn_momentum_rule"]) - set(first):  # (else the repeats are that one configuration)
            under = f"{rules[0]} at k > 1; {how}"
        if len(rules) == 1:  # (nothing to count as one: its label is all that differs from default)
            return kept, (f"{said}the BN momentum rule {rules[0]} sets a momentum no layer uses, so its label "
                          f"changes nothing: its runs are compared as the default's would be{'; ' * bool(how)}{how}; "
                          f"no BN momentum rule is ranked.")
        return kept, (f"{said}the BN momentum rules {listed(rules)} set a momentum no layer uses, so they count as "
                      f"one configuration (the runs under {under}); no BN momentum rule is ranked.")
    tied = [f for f in others if (ran.groupby("bn_momentum_rule")[f].nunique() == 1).all()]
    if not tied:
        return trials, (f"{said}the BN momentum rule has no BatchNorm layer to act on, and its rules {listed(rules)} "
                        f"did not each run under every value of the other fields, so differences between them come "
                        f"from the fields they ran with ({listed(others)}); every run is kept, and no BN momentum "
                        f"rule is ranked.")
    field = tied[0]
    each = listed([f"{r} ran with {ran.loc[ran['bn_momentum_rule'] == r, field].iloc[0]}" for r in rules])
    return trials, (f"{said}the BN momentum rule has no BatchNorm layer to act on, so differences between its rules "
                    f"{listed(rules)} come from the field it moves with, "
                    f"{'the LR rule' if field == 'lr_rule' else field} ({each}); every run is kept, and no BN "
                    f"momentum rule is ranked.")


def _one_run_at_k1(ones: pd.DataFrame, varied: tuple[str, ...]) -> tuple[pd.Index, str]:
    """At k = 1 every BN rule sets the default momentum, so runs of one configuration and seed under several rules
    are one run repeated: one counts, a finished one first, then the first rule's, so a run under another rule
    counts where the first rule has none. Their index, and which counted and which were left out ('' where every
    run at k = 1 is under one rule and counts)."""
    if ones.empty:
        return ones.index, ""
    order = in_order("bn_momentum_rule", ones["bn_momentum_rule"].unique())
    fields = [f for f in dict.fromkeys(["seed", *varied, *SEARCHED]) if f in ones
              and (f == "seed" or f not in NOT_SETTINGS)]
    combo = _combos(ones, fields)
    rank = pd.DataFrame({"not_done": ~ones.index.isin(finished(ones).index), "combo": combo,
                         "rule": ones["bn_momentum_rule"].map(order.index)}, index=ones.index)
    kept = rank.sort_values(["not_done", "rule"], kind="stable").groupby("combo", sort=False).head(1).index
    kept = ones.index[ones.index.isin(kept)]
    rule, left = ones.loc[kept, "bn_momentum_rule"], ones.drop(kept)
    other = rule[rule != order[0]]
    if other.empty and left.empty:
        return kept, ""
    instead = other[combo[other.index].isin(combo[ones["bn_momentum_rule"] == order[0]])]

    def counts(runs: pd.Series) -> str:
        return listed([f"{(runs == r).sum()} under {r}" for r in in_order("bn_momentum_rule", runs.unique())])

    how = f"a run under {order[0]} counts where there is one"
    if len(instead):  # (a finished run counts before one of the first rule's that did not finish)
        how = (f"one run counts per configuration and seed, a finished one before one that did not and then one "
               f"under {order[0]} before one under another rule, so {counts(other)} {'count' + 's' * (len(other) == 1)}")
    elif len(other):
        how += f", {counts(other)} where there is none"
    if len(left):
        how += (f", and the {counts(left['bn_momentum_rule'])} that "
                f"{'repeats one is' if len(left) == 1 else 'repeat one are'} left out")
    return kept, f"at k = 1, where every rule sets the default momentum, {how}"


def memory(trials: pd.DataFrame) -> list[str]:
    t = finished(trials)
    t = t.dropna(subset=["peak_memory_bytes"]) if "peak_memory_bytes" in t else t  # (a k not measured spans nothing)
    if "peak_memory_bytes" not in t or "batch" not in t or t.get("model", pd.Series()).nunique() > 1:
        return []  # memory of different models is not one series
    acc = t[t["batch"] == "accumulated"]
    if acc.empty:
        return []
    b = acc["physical_batch"].mode().iloc[0]
    same_b = t[t["physical_batch"] == b]
    k_min, k_max = same_b["accum_steps"].min(), same_b["accum_steps"].max()
    low, high = same_b["peak_memory_bytes"].min(), same_b["peak_memory_bytes"].max()
    big_b = b * k_max
    true = t[(t["physical_batch"] == big_b) & (t["accum_steps"] == 1)]
    if k_min == k_max and true.empty:
        return []  # one k and nothing to hold it against
    source = ", ".join(t["memory_source"].dropna().unique()) if "memory_source" in t else ""
    source = source or "its source not logged"
    span = f"at {high / 2 ** 20:.2f} MiB" if high - low < 0.01 * high else \
        f"between {low / 2 ** 20:.2f} and {high / 2 ** 20:.2f} MiB"
    if k_min < k_max:
        sentence = f"At b = {b}, peak memory ({source}) stayed {span} from k = {k_min} to k = {k_max}"
    else:
        sentence = f"At b = {b} and k = {k_max}, peak memory ({source}) was {span.removeprefix('at ')}"
    if not true.empty:
        need = true["peak_memory_bytes"].mean()
        sentence += f", while the true batch of {big_b} needed {need / 2 ** 20:.2f} MiB ({need / high:.1f}x)"
    return [sentence + "."]


def bn(trials: pd.DataFrame, m: Measure = ACCURACY, final_too: bool = True,
       varied: tuple[str, ...] | None = None) -> list[str]:
    """BN momentum rules: the final measure (paired against the true batch; not where `final_too` is False) and,
    what a momentum rule changes, how far the running statistics are from the population statistics of the final
    weights."""
    t = finished(trials)
    if "bn_momentum_rule" not in t or t["bn_momentum_rule"].nunique() < 2 or no_batchnorm(t):
        return []
    out = []
    b = t["physical_batch"].min()
    finals = {k: (verdicts, gone) for k, _, _, verdicts, gone in bn_against_true(trials, m, varied)}  # (the same)
    fields = arm_fields(trials, varied)
    for k in sorted(t.loc[t["accum_steps"] > 1, "accum_steps"].unique()):
        at_k = t[(t["accum_steps"] == k) & (t["physical_batch"] == b)]
        rules = in_order("bn_momentum_rule", at_k["bn_momentum_rule"])
        ran = {r: true_twins(trials, at_k[at_k["bn_momentum_rule"] == r], int(k * b), fields) for r in rules}
        twin = {r: finished(x) for r, x in ran.items()}
        if means := _running_means(at_k, rules, twin, fields,
                                   trials[(trials["accum_steps"] == k) & (trials["physical_batch"] == b)], ran):
            out.append(f"At k = {k} (B = {k * b}), the BN running means ended {means}.")
        verdicts, gone = finals[int(k)]
        final = "; ".join(dict.fromkeys(f"{r} {stated(v.d, 'above', 'below', m, v)}" if r not in gone else gone[r]
                                        for r, v in zip(rules, verdicts) if v is not None or r in gone))
        final = f"no rule compared; {final}" if final and all(v is None for v in verdicts) else final
        if final and final_too:
            out.append(f"Final {'accuracy' if m.points else m.name} at k = {k} against the true batch: {final}.")
    return out


def _running_means(at_k: pd.DataFrame, rules: list[str], twin: dict, fields: list[str], tried: pd.DataFrame,
                   ran: dict) -> str:
    """How far each rule's BN running means at one k ended from the population means of the final weights, against
    its true-batch `twin` (each rule's own at its values of the other varied `fields`), paired by seed over the
    seeds both finished, and the seeds left out said: of those that ran at this k (`tried`, every status) or at a
    rule's true batch (`ran`, every status); a rule with no finished twin is named; '' where no twin measured it."""
    seeds = sorted(set(tried["seed"]).union(*(x["seed"] for x in ran.values()))) if "seed" in tried else []
    true = pd.concat(twin.values())
    true = true.drop_duplicates("run_id") if "run_id" in true else true
    if "bn_mean_error" not in at_k or true.empty or not true["bn_mean_error"].notna().any():
        return ""
    errors = at_k.groupby("bn_momentum_rule")["bn_mean_error"].mean()
    listing = ", ".join(f"{r} {significant(errors[r])}" for r in rules)
    own = {r: twin[r]["bn_mean_error"].mean() for r in rules}  # (NaN where it has no finished twin)
    against = (f"each rule's true batch at its own {listed([f.replace('_', ' ') for f in fields])}: "
               + ", ".join(f"{r} {significant(float(own[r])) if own[r] == own[r] else 'none'}" for r in rules)
               if fields else f"true batch: {significant(float(true['bn_mean_error'].mean()))}")
    apart, lone, unshared = [], [], []
    alike: dict[str, list[str]] = {}  # (a verdict over the same seeds -> its rules, said once)
    diffs = [paired(at_k[at_k["bn_momentum_rule"] == r], twin[r], "bn_mean_error") for r in rules]
    for r, v in zip(rules, judge(diffs, 0.0)):  # (no margin: any difference in tracking is the question)
        if v is None:  # (a twin measured in other seeds than the rule's own runs is not a missing twin)
            (unshared if twin[r]["bn_mean_error"].notna().any() else lone).append(r)
            continue
        d, mine = v.d, at_k[at_k["bn_momentum_rule"] == r]
        left = unpaired(seeds, mine, twin[r], "bn_mean_error", r, f"{r}'s true batch" if fields else "the true batch",
                        (tried[tried["bn_momentum_rule"] == r], ran[r]))
        over = f"paired over {d.n} of {len(seeds)} seeds ({left})" if left else ""
        if v.resolved:
            apart.append(f"{r} {'further from' if d.mean > 0 else 'closer to'} it than the true batch "
                         f"({significant(d.mean, '+')}, 95% CI {significant(d.mean - d.half, '+')} to "
                         f"{significant(d.mean + d.half, '+')}; {control(v)}{'; ' * bool(over)}{over})")
        else:  # (one seed resolves nothing: said as such, not as 'not resolved with 1 seeds')
            words = ("cannot be told from the true batch's with one seed" if d.n < 2 else
                     f"not resolved from the true batch's{'' if over else f' with {d.n} seeds'}")
            alike.setdefault(f"{words}{', ' * bool(over)}{over}", []).append(r)
    verdicts = [*apart, *(f"{words}: {', '.join(rs)}" for words, rs in alike.items())]
    if len(seeds) < 2 and (apart or alike):
        verdicts = ["with one seed no rule can be told from the true batch"]
    verdicts += [f"no seed in common with its true batch: {', '.join(unshared)}"] if unshared else []
    verdicts += [f"no finished true-batch twin to compare with: {', '.join(lone)}"] if lone else []
    return (f"{listing} population standard deviations from the population means of the final weights "
            f"({against}); {'; '.join(verdicts)}")


def bn_against_true(trials: pd.DataFrame, m: Measure = ACCURACY, varied: tuple[str, ...] | None = None
                    ) -> list[tuple[int, int, list[str], list, dict]]:
    """Per k: (k, B, the BN rules, their verdicts against the true batch at B, {rule: why it is not compared}),
    paired by seed, one family per k. A rule whose accumulated run (or the true batch) diverged or was pruned in a
    seed has no verdict (None): over the seeds that survived it would be a pick among survivors."""
    t = finished(trials)
    if "bn_momentum_rule" not in t or t["bn_momentum_rule"].nunique() < 2 or no_batchnorm(t):
        return []  # (a model without BatchNorm: its rules ranked would rank the fields they moved with)
    b, step, out = t["physical_batch"].min(), quantum(t[m.name]), []
    worse, fields = "reason" in trials and "seed" in trials, arm_fields(trials, varied)
    for k in sorted(t.loc[t["accum_steps"] > 1, "accum_steps"].unique()):
        at_k = t[(t["accum_steps"] == k) & (t["physical_batch"] == b)]
        rules = in_order("bn_momentum_rule", at_k["bn_momentum_rule"])
        ran = trials[(trials["accum_steps"] == k) & (trials["physical_batch"] == b)]
        gone, diffs = {}, []
        for r in rules:
            ran_1 = true_twins(trials, ran[ran["bn_momentum_rule"] == r], int(k * b), fields)
            lost = ended_worse(ran_1) if worse else None
            found = ended_worse(ran[ran["bn_momentum_rule"] == r]) if worse else None
            whose = f"{r}'s true batch" if fields else "the true batch"  # (without fields, every rule's twin)
            if lost or found:
                gone[r] = f"{went(whose if lost else r, lost or found)}, not compared over the seeds that finished"
            elif finished(ran_1).empty:
                gone[r] = _unfinished_twin(r, ran_1, int(k * b), fields)
            diffs.append(None if r in gone else paired(at_k[at_k["bn_momentum_rule"] == r], finished(ran_1), m.name,
                                                        step))
        apart = [r for r, d in zip(rules, diffs) if d is None and r not in gone and "seed" in t]  # (other seeds)
        for r in apart:  # (without fields the rules share one twin: said once)
            gone[r] = (f"{r}'s true batch (b = {int(k * b)}, k = 1 with its other settings) finished in no seed that "
                       f"{r} finished in, not compared" if fields else f"{listed(apart)}{' each' * (len(apart) > 1)} "
                       f"finished in no seed that the true batch (b = {int(k * b)}, k = 1) finished in")
        out.append((int(k), int(k * b), rules, judge(diffs, m.margin), gone))
    return out


def _unfinished_twin(rule: str, ran_1: pd.DataFrame, b: int, fields: list[str]) -> str:
    """Why `rule` has no finished true-batch twin: none ran at its settings, or its twin ran and did not finish
    (out of memory, an error, still running, ...: how, in how many seeds). Without other varied fields every rule
    shares one twin, so the words name no rule and are said once per k."""
    at = f"b = {b}, k = 1{' with its other settings' if fields else ''}"
    if ran_1.empty:
        return f"{rule} has no true-batch twin ({at}), not compared" if fields else \
            f"the true batch ({at}) has no run in this study"
    seeds = ran_1["seed"] if "seed" in ran_1 else pd.Series(range(len(ran_1)), index=ran_1.index)
    reason = ran_1["reason"] if "reason" in ran_1 else pd.Series(None, index=ran_1.index, dtype=object)
    mismatch = ran_1["config_mismatch"] if "config_mismatch" in ran_1 else pd.Series(None, index=ran_1.index,
                                                                                      dtype=object)
    how = pd.Series([ended_how(*x) for x in zip(reason, ran_1["status"], mismatch)], index=ran_1.index)
    n = seeds.nunique()
    ways = listed([f"{w} in {seeds[g.index].nunique()} of {n} seed{'s' * (n != 1)}" for w, g in how.groupby(how)])
    return f"{rule}'s true batch ({at}) {ways}, not compared" if fields else f"the true batch ({at}) {ways}"


def true_twins(trials: pd.DataFrame, runs: pd.DataFrame, b: int, fields: list[str]) -> pd.DataFrame:
    """The true-batch runs (k = 1 at B = `b`) that twin accumulated `runs`: those with the values of the other
    varied `fields` that `runs` hold (arm_fields(): a BN rule zipped with the weight decay has its twin at its own
    weight decay, whatever the rule's label at k = 1), none where it has none."""
    true = trials[(trials["accum_steps"] == 1) & (trials["effective_batch"] == b)]
    return true[_combos(true, fields).isin(set(_combos(runs, fields)))] if fields else true


@dataclass
class Exact:
    """Per model: whether accumulation is the true batch up to float rounding, whether it has BatchNorm, and the
    finding that says so."""
    model: str
    exact: bool
    batchnorm: bool
    sentence: str


def exactness(trials: pd.DataFrame) -> list[str]:
    """Per model: is accumulation exactly the true batch, and if not, why."""
    found = exact_by_model(trials)
    if not found:
        return []
    return ["Each loss term is divided by its number of counted items over the whole window (samples, or tokens "
            "that are not padding), never by k: without BatchNorm, a window's gradient is then exactly the gradient "
            "of the mean loss over all its items, whatever each micro-batch holds (unequal token counts, a short "
            "last window). A mean per micro-batch divided by k is not: it gives the items of a micro-batch with "
            "fewer of them more weight.", *(e.sentence for e in found)]


def exact_by_model(trials: pd.DataFrame) -> list[Exact]:
    t = finished(trials)
    if "param_rel_diff" not in t:
        return []
    out = []
    for model, rows in t.groupby("model"):
        worst = rows["param_rel_diff"].max()
        gaps = (f"accuracy gap {100 * rows['acc_gap'].min():+.1f} to {100 * rows['acc_gap'].max():+.1f} points"
                if "acc_gap" in rows else "no accuracy gap logged")
        # The equivalence objective trains a ghost-batch twin only for a model with BatchNorm: its metric says so.
        has_bn = "ghost_rel_diff" in rows and rows["ghost_rel_diff"].notna().any()
        # Without BatchNorm, a pair that parts in float32 is trained again in float64 (sweeps/trials/objective.py).
        parted = rows.loc[rows["param_rel_diff"] >= EXACT, "param_rel_diff_fp64"] \
            if "param_rel_diff_fp64" in rows else pd.Series(dtype=float)
        if worst < EXACT:
            out.append(Exact(model, True, has_bn, f"{model}: accumulation is exactly the true batch, up to float "
                             f"rounding (largest relative parameter difference {worst:.1e}; {gaps})."))
        elif not has_bn and len(parted) and parted.notna().all() and parted.max() < FLOAT64_ROUNDING:
            out.append(Exact(model, True, has_bn, f"{model}: accumulation is exactly the true batch, up to float "
                             f"rounding that training amplified: {len(parted)} of {len(rows)} pairs parted by up to "
                             f"{worst:.2g} in float32, and agreed to {parted.max():.1e} in float64 ({gaps})."))
        else:
            why = ("BatchNorm normalizes each micro-batch of b samples, so accumulated training is Ghost "
                   "BatchNorm with ghost size b (Hoffer et al. 2017), not the true batch" if has_bn else
                   "something in the model depends on the micro-batch (BatchNorm or another batch statistic)")
            if not has_bn and parted.notna().any():
                why += f": in float64 the pair still differs by {parted.max():.1e}, which is not rounding"
            elif not has_bn:
                why += ", or float32 rounding that training amplified: no float64 pair was measured"
            ghost = ""
            if "ghost_rel_diff" in rows and rows["ghost_rel_diff"].notna().any():
                ghost = (f" The true batch with ghost_batch = b came within {rows['ghost_rel_diff'].max():.2g} of "
                         f"accumulation in {rows['dtype'].iloc[0] if 'dtype' in rows else 'float32'}, against "
                         f"{worst:.2g} without it")
                f64 = rows["ghost_rel_diff_fp64"].max() if "ghost_rel_diff_fp64" in rows else math.nan
                if f64 < FLOAT64_ROUNDING:
                    ghost += (f"; in float64 the same pair agreed to {f64:.1e}, so what remains in float32 is "
                              f"rounding, amplified by training.")
                elif math.isfinite(f64):
                    ghost += f"; in float64 they still differ by {f64:.1e}: that is not rounding."
                else:
                    ghost += ": rounding amplified by training, or a real difference (no float64 twin measured)."
            out.append(Exact(model, False, has_bn, f"{model}: accumulation is not the true batch (largest relative "
                             f"parameter difference {worst:.2g}; {gaps}): {why}.{ghost}"))
    return out


def lr_rule_reading(lo: float, hi: float) -> str:
    """Which LR rule an interval of the exponent reads as (best_lr.rule_reading: one only where the interval lies
    within a quarter of its exponent). The sentence shows the ends with the digits that keep them on their side of
    every exponent and margin (best_lr.shown), so the ends as printed read the same."""
    return rule_reading(lo, hi)


def lr_exponent(trials: pd.DataFrame, m: Measure = ACCURACY, history: pd.DataFrame | None = None) -> list[str]:
    """The best LR against B: each seed's best at each B and the curve's shape over the seeds (best_lr.py), with
    the LR rule its slope's interval reads as; where that cannot be read (the seeds do not pair up across the Bs,
    or the trials at a B differ in more than the LR), the fitted exponent of lr_opt ~ B^alpha with no interval and
    no rule."""
    found = best_lr(trials, m)
    if found is None:
        return []
    per_seed = best_lr_of_seeds(trials, m)
    if per_seed is not None:
        first, last = per_seed.points[0], per_seed.points[-1]
        went = (f"The best learning rate went from {first.lr:.3g} at B = {first.batch} to {last.lr:.3g} at B = "
                f"{last.batch} (each seed's best LR at a B, their geometric mean). ")
        lr = trials.assign(lr=trials[trained_lr(trials)])
        over = moved(over_training(lr, history, m.name, "maximize" if m.maximize else "minimize"))
        return [went + per_seed.sentence() + _reading(per_seed, trials) + (f" {over}" if over else "")]
    best, alpha = found
    t = finished(trials).dropna(subset=[m.name])
    # No seed's own slope exists here, and resampling each B's trials would mix its seeds' LR grids: no interval.
    fix = "run the study with --seeds 3 (every B in the same seeds)"
    at = [set(g["seed"]) for _, g in t.groupby("effective_batch")] if "seed" in t else [set()]
    if min(map(len, at)) < 2:
        why = ("each B's best from one seed of its own: with one seed at a B, how far its best LR moves with the "
               "seed is not measured")
    elif not set.intersection(*at):
        why = "each B's best from seeds of its own, none run at every B: no seed gives a slope of its own"
    else:
        why, fix = ("the trials at a B differ in more than the LR, so each B's best is a pick over those too",
                    "search the LR alone at each B (as lr_search and adam_lr_search do)")
    return [f"The best learning rate went from {best['lr'].iloc[0]:.3g} at B = {best['effective_batch'].iloc[0]} "
            f"to {best['lr'].iloc[-1]:.3g} at B = {best['effective_batch'].iloc[-1]} (B^{round(alpha, 2) + 0.0:.2f} "
            f"fitted over every B), {why}, so no interval is put on the exponent and no LR rule is read from it; "
            f"{fix}."]


def _reading(found, trials: pd.DataFrame) -> str:
    """The LR rule the slope's interval reads as, where it can: none through a best LR at the edge of the LRs tried
    (the sentence gives the slope's interval, open on the side the edge leaves open), nor through a curve that
    does not move as one power of B (a turn, or a step against the slope's direction)."""
    if math.isnan(found.slope_low) or found.shape == "beyond the LRs tried":  # (its sentence says why)
        return ""
    if any(p.at_edge for p in found.points):
        return " No LR rule is read from the slope while a best sits at the edge of the LRs tried: widen the LR grid."
    if found.shape == "rises then falls" or (found.shape == "not resolved" and
                                             (found.slope_low > 0 or found.slope_high < 0)):
        return " No LR rule is read from the slope: the best LR does not move with B as one power of it here."
    # A step resolved against the slope's direction (its interval over the seeds excludes 0): a line through
    # means that go up and down is no rule to scale by; a wiggle the seeds do not resolve is no move.
    at = {p.batch: p for p in found.points}
    against = [(at[a], at[b]) for a, b, _, low, high in found.steps
               if (found.slope > 0 and high < 0) or (found.slope < 0 and low > 0)]
    if against:
        a, b = against[0]
        return (f" No LR rule is read from the slope: the best LR moved against it from B = {a.batch} to "
                f"{b.batch} ({a.lr:.3g} to {b.lr:.3g}, beyond the seeds' spread and the LR grid's spacing), so no "
                f"one power of B describes it here; use each B's best LR.")
    # An interval that holds 0 beside a step the seeds resolve: the flat reading would deny that move.
    moves = [(at[a], at[b]) for a, b, _, low, high in found.steps if low > 0 or high < 0]
    if moves and found.slope_low <= 0 <= found.slope_high:
        a, b = moves[0]
        return (f" No LR rule is read from the slope: its interval holds 0, but the best LR moved from B = "
                f"{a.batch} to {b.batch} ({a.lr:.3g} to {b.lr:.3g}, beyond the seeds' spread and the LR grid's "
                f"spacing), so no one power of B describes it here; use each B's best LR.")
    return f" {lr_rule_reading(found.slope_low, found.slope_high)}."


def noise_scale(trials: pd.DataFrame) -> list[str]:
    """The measured noise scale, reliable values only, of the trials that the figure against B draws and the
    critical batch is predicted from: a batch warmup's or a branch's B changed during training."""
    t = one_batch(finished(trials))
    if "noise_scale" not in t or t["noise_scale"].notna().sum() == 0:
        return []
    values = reliable_noise(t)
    dropped = int(t["noise_scale"].notna().sum()) - len(values)
    rule = (f"; {dropped} value{'s' * (dropped != 1)} left out as unreliable (the measured |G|² fell below the "
            f"finite-set correction tr(Σ)/N, where the estimate tends to N whatever the gradient)") if dropped else ""
    which = " that trained at one B throughout" if len(t) < len(finished(trials)) else ""
    if values.empty:
        return [f"The gradient noise scale could not be read at the last epoch{rule}."]
    if len(values) == 1:
        return [f"The gradient noise scale at the last epoch was {values.iloc[0]:.0f} (one trial with k ≥ 2{which})"
                f"{rule}."]
    return [f"The gradient noise scale at the last epoch was {values.median():.0f} (median of {len(values)} trials "
            f"with k ≥ 2{which}, range {values.min():.0f}–{values.max():.0f}){rule}."]


def script_note(trials: pd.DataFrame) -> list[str]:
    """What a [program] study's report cannot show, and why."""
    if "batchsweep.program" not in trials or trials["batchsweep.program"].isna().all():
        return []
    missing = [what for what, metric in (("noise scale", "noise_scale"), ("training health", "grad_norm"))
               if metric not in trials]
    return [f"The trials ran a script of their own; its {' and '.join(missing)} figures are left out, as only "
            f"batchsweep's trainer measures them."] if missing else []


def mismatches(trials: pd.DataFrame) -> list[str]:
    """The trials whose script did not run as it was asked to, as the tracer saw it: left out of every comparison."""
    if "config_mismatch" not in trials:
        return []
    off = trials[trials["config_mismatch"].notna()]
    if off.empty:
        return []
    first = off["config_mismatch"].iloc[0]
    they = "it is" if len(off) == 1 else "they are"
    return [f"{len(off)} of {len(trials)} trials did not run as they were asked to (as batchsweep saw the script: "
            f"{first}); {they} left out of every comparison."]


def failures(trials: pd.DataFrame) -> list[str]:
    bad = trials[trials["status"] != "FINISHED"]
    if bad.empty:
        return []
    reasons = bad["reason"].astype(object)  # (a column of NaN alone is float)
    reasons = reasons.where(reasons.notna() & (reasons != ""), bad["status"].map(unlogged)).value_counts()
    listing = ", ".join(f"{n} {reason}" for reason, n in reasons.items())
    health = ", except training health, which draws every trial" if "grad_norm" in trials else ""
    they = "it is" if len(bad) == 1 else "they are"
    return [f"{len(bad)} of {len(trials)} trials did not finish ({listing}); {they} left out of the figures{health}."]


def health(trials: pd.DataFrame) -> list[str]:
    if "health" not in trials:
        return []
    broken = trials[trials["health"].notna() & (trials["health"] != "ok")]
    if broken.empty:
        return []  # the health section says it; a sentence about nothing is left out
    counts = ", ".join(f"{n} {name}" for name, n in broken["health"].value_counts().items())
    were = "trial was" if len(broken) == 1 else "trials were"
    return [f"{len(broken)} {were} not healthy ({counts}): see the training health table."]


def _comparisons(trials: pd.DataFrame, history: pd.DataFrame, evals: pd.DataFrame | None,
                 objective: tuple[str, str] | None, varied: tuple[str, ...] | None = None) -> list[str]:
    m = measure(trials, objective)
    if m is None:
        return ["No finished trial has an accuracy (val_acc) or a value of the study's objective, in which "
                "configurations are compared: the comparisons are left out; the table holds each trial's metrics.",
                *noise_scale(trials), *memory(trials)]
    # Where every trial ended at one value, the values show no recording step to set an interval's width by, and
    # nothing differs to compare: that one sentence stands for the comparisons in it (the block says the same);
    # the BN running statistics are another measurement, still compared.
    still = unmoved(trials, m)
    compared = [still, *bn(trials, m, False, varied)] if still else [
        *lr_rules(trials, m), *twins(trials, m), *bn(trials, m, varied=varied), *lr_exponent(trials, m, history)]
    if not m.points:
        aimed = has_accuracy(finished(trials))  # (steps to a target and warmup aim at an accuracy)
        lead = (f"Configurations are compared in the study's objective, {m.name}{m.better}, not in val_acc; steps "
                f"to a target accuracy are in val_acc; {m.margin_why}." if aimed else f"No finished trial has an "
                f"accuracy (val_acc): configurations are compared in {m.name}{m.better}, and steps to a target "
                f"accuracy and batch warmup are left out; {m.margin_why}.")
        aimed_at = [*steps(trials, history, evals), *warmup(trials, history, evals),
                    *branching.finding(trials, history)] if aimed else []
        lead = [lead] if compared or not aimed else []  # (where no sentence compares in it, it is not said)
        return [*lead, *compared, *noise_scale(trials), *aimed_at, *memory(trials)]
    return [*compared, *noise_scale(trials), *steps(trials, history, evals), *warmup(trials, history, evals),
            *branching.finding(trials, history), *memory(trials)]


def summarize(trials: pd.DataFrame, history: pd.DataFrame | None = None, evals: pd.DataFrame | None = None,
              objective: tuple[str, str] | None = None, varied: tuple[str, ...] | None = None) -> list[str]:
    """The findings. Sentences that compare configurations hold one model and one dataset at a time, in accuracy
    or, for a study without one, in its first objective (`objective`: metric and direction); a model without
    BatchNorm's BN momentum rules as one configuration where they crossed the study's other `varied` fields
    (one_bn_rule())."""
    history = pd.DataFrame() if history is None else history
    trials = typed(trials, [objective[0]] if objective else [])  # (numbers read back as text)
    keys = group_keys(trials)
    if keys:  # (each model's BN rules judged on its own runs: one with BatchNorm, one without)
        no_bn, comparisons, kept = "", [], []
        for group, rows in trials.groupby(keys):
            label = group_label(keys, group)
            rows, said = one_bn_rule(rows, tuple(f for f in varied if f not in keys) if varied else varied)
            no_bn += f" {label}: {lowered(said)}" if said else ""
            part = history[history["run_id"].isin(rows["run_id"])] if not history.empty else history
            comparisons += [f"{label}: {lowered(s)}" for s in _comparisons(rows, part, evals, objective, varied)]
            kept.append(rows)
        no_bn = no_bn.strip()
        comparisons += norms(pd.concat(kept), measure(trials, objective), varied)
    else:
        compared, no_bn = one_bn_rule(trials, varied)
        comparisons = _comparisons(compared, history, evals, objective, varied)
    return [*filter(None, [no_bn]), *exactness(trials), *comparisons, *_seed_note(finished(trials)),
            *mismatches(trials), *failures(trials), *health(trials), *script_note(trials)]
