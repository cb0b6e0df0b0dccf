"""The default study's findings recomputed by an independent path, and one test per defect of issue 100.

TABLE is the default study (`python sweeps/run.py --study accum_lr`, cnn1d on MNIST-1D, 12 epochs, 3 seeds) as
it ran on a 2-core CPU (torch 2.14.1; 27 min under a load of 8 to 12 from other jobs), read from its MLflow store:
per trial its seed, LR rule, b, k, final val_acc, from its history the optimizer steps at the end of the first
epoch at or above the target (95% of the best (rule, B) mean, 92.2%) with the noise scale there, the noise scale
at the last epoch with its reliability flag, and the peak memory. The tests feed the table to the report and
recompute every number of the LR-rule, twin, critical-batch, memory, noise-scale and best-configuration
sentences with scipy.stats and scipy.optimize directly (paired t by seed, Benjamini-Hochberg written out by hand,
the fit by curve_fit), then find each number in the sentences as the report prints it.
"""
import io
import math
import re

import numpy as np
import pandas as pd
import pytest
import scipy.optimize
import scipy.stats

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.rules import twins
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.runs import Difference, StudyRuns, paired
from batchsweep.analysis.space import memory_front
from batchsweep.analysis.verdicts import judge

TABLE = """\
seed,lr_rule,physical_batch,accum_steps,val_acc,steps,noise,noise_last,reliable,peak_memory_bytes
0,linear,32,1,0.972,750,,,,514236
0,linear,32,2,0.967,252,79.6163,145.146,1,514236
0,linear,32,4,0.958,224,173.757,279.516,1,514236
0,linear,32,8,0.944,112,175.455,430.359,1,514236
0,linear,32,16,0.906,,,386.577,1,514236
0,linear,64,1,0.969,252,,,,930492
0,linear,128,1,0.959,224,,,,1763004
0,linear,256,1,0.942,128,,,,3428028
0,linear,512,1,0.895,,,,,6758076
0,none,32,1,0.972,750,,,,514236
0,none,32,2,0.96,378,182.275,347.458,1,514236
0,none,32,4,0.958,192,146.535,371.541,1,514236
0,none,32,8,0.939,144,372.494,624.974,1,514236
0,none,32,16,0.867,,,633.823,1,514236
0,none,64,1,0.966,378,,,,930492
0,none,128,1,0.955,192,,,,1763004
0,none,256,1,0.932,144,,,,3428028
0,none,512,1,0.867,,,,,6758076
0,sqrt,32,1,0.972,750,,,,514236
0,sqrt,32,2,0.963,378,227.171,492.171,1,514236
0,sqrt,32,4,0.959,192,162.516,467.359,1,514236
0,sqrt,32,8,0.953,112,184.422,488.266,1,514236
0,sqrt,32,16,0.924,88,455.503,601.416,1,514236
0,sqrt,64,1,0.965,315,,,,930492
0,sqrt,128,1,0.965,192,,,,1763004
0,sqrt,256,1,0.949,112,,,,3428028
0,sqrt,512,1,0.932,64,,,,6758076
1,linear,32,1,0.973,625,,,,514236
1,linear,32,2,0.971,315,133.211,364.711,1,514236
1,linear,32,4,0.967,192,221.306,556.324,1,514236
1,linear,32,8,0.948,112,153.319,389.016,1,514236
1,linear,32,16,0.933,80,269.049,471.53,1,514236
1,linear,64,1,0.963,315,,,,930492
1,linear,128,1,0.962,224,,,,1763004
1,linear,256,1,0.916,160,,,,3428028
1,linear,512,1,0.923,88,,,,6758076
1,none,32,1,0.973,625,,,,514236
1,none,32,2,0.975,315,215.731,554.957,1,514236
1,none,32,4,0.961,224,235.037,555.964,1,514236
1,none,32,8,0.936,144,297.176,492.953,1,514236
1,none,32,16,0.818,,,1010.74,1,514236
1,none,64,1,0.97,378,,,,930492
1,none,128,1,0.961,256,,,,1763004
1,none,256,1,0.933,144,,,,3428028
1,none,512,1,0.83,,,,,6758076
1,sqrt,32,1,0.973,625,,,,514236
1,sqrt,32,2,0.968,441,117.694,245.796,1,514236
1,sqrt,32,4,0.964,192,160.816,407.597,1,514236
1,sqrt,32,8,0.963,112,227.658,594.772,1,514236
1,sqrt,32,16,0.936,80,348.264,659.535,1,514236
1,sqrt,64,1,0.964,441,,,,930492
1,sqrt,128,1,0.956,256,,,,1763004
1,sqrt,256,1,0.962,144,,,,3428028
1,sqrt,512,1,0.914,,,,,6758076
2,linear,32,1,0.966,625,,,,514236
2,linear,32,2,0.958,378,210.476,534.875,1,514236
2,linear,32,4,0.963,192,179.15,294.371,1,514236
2,linear,32,8,0.958,128,206.806,402.141,1,514236
2,linear,32,16,0.837,,,304.591,1,514236
2,linear,64,1,0.96,378,,,,930492
2,linear,128,1,0.961,160,,,,1763004
2,linear,256,1,0.946,144,,,,3428028
2,linear,512,1,0.81,,,,,6758076
2,none,32,1,0.966,625,,,,514236
2,none,32,2,0.958,315,169.884,540.881,1,514236
2,none,32,4,0.951,192,315.76,595.827,1,514236
2,none,32,8,0.929,160,406.223,764.655,1,514236
2,none,32,16,0.822,,,1344.32,1,514236
2,none,64,1,0.962,315,,,,930492
2,none,128,1,0.955,224,,,,1763004
2,none,256,1,0.923,160,,,,3428028
2,none,512,1,0.816,,,,,6758076
2,sqrt,32,1,0.966,625,,,,514236
2,sqrt,32,2,0.965,315,179.663,460.06,1,514236
2,sqrt,32,4,0.959,160,237.496,693.486,1,514236
2,sqrt,32,8,0.958,112,313.348,898.332,1,514236
2,sqrt,32,16,0.912,,,589.682,1,514236
2,sqrt,64,1,0.965,315,,,,930492
2,sqrt,128,1,0.959,192,,,,1763004
2,sqrt,256,1,0.941,128,,,,3428028
2,sqrt,512,1,0.928,80,,,,6758076
"""
STEP = 0.001  # val_acc over 1,000 validation samples
VARIED = ("physical_batch", "accum_steps", "lr_rule")
RULES = ("none", "sqrt", "linear")


def default_study() -> tuple[pd.DataFrame, pd.DataFrame]:
    t = pd.read_csv(io.StringIO(TABLE))
    t = t.assign(effective_batch=t.physical_batch * t.accum_steps, status="FINISHED", model="cnn1d",
                 dataset="mnist1d", epochs=12, run_id=[f"r{i}" for i in range(len(t))],
                 batch=np.where(t.accum_steps > 1, "accumulated", "true batch"))
    reached = t.steps.notna()
    history = pd.DataFrame({"run_id": t.run_id, "epoch": 1, "steps": t.steps.fillna(10_000),
                            "val_acc": np.where(reached, 1.0, 0.0), "noise_scale": t.noise,
                            "noise_scale_reliable": 1.0})
    t = t.assign(noise_scale=t.noise_last, noise_scale_reliable=t.reliable, memory_source="saved_tensors",
                 base_batch=32)
    return t.drop(columns=["steps", "noise", "noise_last", "reliable"]), history


def ttest(a: pd.Series, b: pd.Series) -> tuple[float, float, float, float]:
    """mean, half-width, p and sd of a - b paired by seed; the sd no lower than the rounding of two values."""
    a, b = a.sort_index(), b.sort_index()
    d = (a - b).to_numpy()
    n, sd = len(d), max(np.std(d, ddof=1), STEP / math.sqrt(6))
    if np.std(d, ddof=1) >= STEP / math.sqrt(6):
        p = scipy.stats.ttest_rel(a.to_numpy(), b.to_numpy()).pvalue
    else:
        p = 2 * scipy.stats.t.sf(abs(d.mean()) / (sd / math.sqrt(n)), n - 1)
    return d.mean(), scipy.stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n), p, sd


def bh(p: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, written out: p * m / rank, the running minimum from the largest."""
    m, order = len(p), np.argsort(p)
    adjusted, running = [0.0] * m, 1.0
    for rank in range(m, 0, -1):
        i = order[rank - 1]
        running = min(running, p[i] * m / rank)
        adjusted[i] = running
    return adjusted


def seeds_for(mean: float, sd: float, family: int) -> int:
    """Seeds whose 95% interval would lie inside ±1 point where the mean does; else that would exclude 0 at 5%/m."""
    if abs(mean) < 0.01:
        return next(n for n in range(2, 1002)
                    if abs(mean) + scipy.stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) < 0.01)
    level = 0.05 / family
    return next(n for n in range(2, 1002)
                if scipy.stats.t.ppf(1 - level / 2, n - 1) * sd / math.sqrt(n) < abs(mean))


def per_seed(t: pd.DataFrame, **at) -> pd.Series:
    rows = t
    for key, value in at.items():
        rows = rows[rows[key] == value]
    return rows.groupby("seed")["val_acc"].mean()


def clause(mean, half, p, sd, adjusted, family) -> str:
    """How the report must word one comparison of accuracy, by the rules of docs/report.md."""
    lo, hi = 100 * (mean - half), 100 * (mean + half)
    kept = "kept" if adjusted <= 0.05 else "its own interval excludes 0, but it is not kept"
    if abs(mean) > half and (adjusted <= 0.05 or abs(mean) + half < 0.01):  # (off 0 inside the margin: both said)
        return (f"{100 * abs(mean):.1f} points {'lower' if mean < 0 else 'higher'}, 95% CI {lo:+.1f} to {hi:+.1f} "
                f"over 3 seeds; {kept} by Benjamini-Hochberg at 5% over {family} comparisons, adjusted p "
                f"{adjusted:.2g}" + (", inside the ±1 point equivalence margin" if abs(mean) + half < 0.01 else ""))
    if abs(mean) + half < 0.01:
        return f"({100 * mean:+.1f} ± {100 * half:.1f} points"
    why = (f"; its own interval excludes 0, but it is not kept by Benjamini-Hochberg at 5% over {family} comparisons, "
           f"adjusted p {adjusted:.2g}" if abs(mean) > half else "")
    return (f"not resolved with 3 seeds ({100 * mean:+.1f} ± {100 * half:.1f} points{why}; about "
            f"{seeds_for(mean, sd, family)} seeds would {'show equivalence' if abs(mean) < 0.01 else 'resolve'}")


def test_the_default_studys_sentences_recomputed_by_an_independent_path():
    trials, history = default_study()
    sentences = summarize(trials, history)
    said = " ".join(sentences)
    # Each rule's B against B = 32: every trial at a B (both halves averaged per seed), one family of 12.
    rows = [(rule, b, *ttest(per_seed(trials, lr_rule=rule, effective_batch=b),
                             per_seed(trials, lr_rule=rule, effective_batch=32)))
            for rule in RULES for b in (64, 128, 256, 512)]
    adjusted = bh([r[4] for r in rows])
    for (rule, b, mean, half, p, sd), adj in zip(rows, adjusted):
        sentence = next(s for s in sentences if s.startswith(f"The {rule} LR rule against B = 32"))
        assert clause(mean, half, p, sd, adj, 12) in sentence, (rule, b, sentence)
        if abs(mean) > half and adj <= 0.05:
            assert f"at B = {b} fell (" in sentence
    kept = [f"{rule} at B = {b}" for (rule, b, *_), adj in zip(rows, adjusted) if adj <= 0.05 and abs(_[0]) > _[1]]
    apart = sum(abs(r[2]) > r[3] for r in rows)
    assert (f"Of the 12 comparisons of a rule's B against its smallest B, {apart} differ by their own 95% interval and "
            f"{len(kept)} survive") in said
    assert ", ".join(kept[:-1]) in said and kept[-1] in said
    # The rules at B = 512, against the best mean: the means, and each contrast.
    means = {rule: per_seed(trials, lr_rule=rule, effective_batch=512).mean() for rule in RULES}
    best = max(means, key=means.get)
    ranked = sorted(RULES, key=lambda r: -means[r])
    assert (f"the {best} rule had the highest mean ({100 * means[best]:.1f}%; "
            + ", ".join(f"{r} {100 * means[r]:.1f}%" for r in ranked[1:]) + "); against it: ") in said
    # Each contrast is controlled with the rules' contrasts against the best mean at every B above 32 (8), the
    # family the recommendation's per-B lines share.
    contrasts = []
    for b in (64, 128, 256, 512):
        at = {rule: per_seed(trials, lr_rule=rule, effective_batch=b).mean() for rule in RULES}
        top = max(at, key=at.get)
        contrasts += [(b, r, *ttest(per_seed(trials, lr_rule=r, effective_batch=b),
                                    per_seed(trials, lr_rule=top, effective_batch=b))) for r in RULES if r != top]
    for (b, r, mean, half, p, sd), adj in zip(contrasts, bh([c[4] for c in contrasts])):
        if b == 512:
            assert f"{r} " + clause(mean, half, p, sd, adj, 8).removeprefix("(") in said, r  # (a contrast: no bracket)
    # The twins: accumulated against true batch at each rule and B > 32, one family of 12.
    pairs = [(f"{rule} at B = {b}", *ttest(per_seed(trials, lr_rule=rule, effective_batch=b, batch="accumulated"),
                                          per_seed(trials, lr_rule=rule, effective_batch=b, batch="true batch")))
             for rule in sorted(RULES) for b in (64, 128, 256, 512)]
    twin_adjusted = bh([pr[3] for pr in pairs])
    equivalent = [pr for pr, adj in zip(pairs, twin_adjusted) if abs(pr[1]) + pr[2] < 0.01]
    resolved = [pr for pr, adj in zip(pairs, twin_adjusted) if abs(pr[1]) > pr[2] and adj <= 0.05]
    open_ = [pr for pr in pairs if pr not in equivalent and pr not in resolved]
    assert (f"(95% t-intervals, median half-width {100 * np.median([pr[2] for pr in pairs]):.1f} points): equivalent "
            f"within ±1 point in {len(equivalent)}"
            + (f" ({'; '.join(pr[0] for pr in equivalent)})" if equivalent else "")
            + f"; not resolved in {len(open_)} (") in said
    for where, mean, half, *_ in open_:
        assert f"{where}: {100 * mean:+.1f} ± {100 * half:.1f} points" in said
    assert f"resolved in {len(resolved)}" in said
    # The critical batch: each seed's own S = S_min (1 + B_crit / B) by curve_fit on log steps, per rule, over the
    # Bs where every run reached the target; a 95% t-interval on log B_crit over the seeds; the noise scale there.
    runs = pd.read_csv(io.StringIO(TABLE)).assign(B=lambda t: t.physical_batch * t.accum_steps)
    for rule in RULES:
        mine = runs[runs.lr_rule == rule]
        every = mine.groupby("B").steps.apply(lambda s: s.notna().all())
        points = mine[mine.B.isin(every[every].index)]
        logs = np.array([scipy.optimize.curve_fit(lambda b, ls, lb: ls + np.log1p(np.exp(lb) / b), p.B,
                                                  np.log(p.steps), p0=(4.0, 5.0), maxfev=20_000)[0][1]
                         for _, p in points.groupby("seed")])
        half = scipy.stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs))
        lo, hi = math.exp(logs.mean() - half), math.exp(logs.mean() + half)
        sentence = next(s for s in sentences if s.startswith(f"For {rule}"))
        assert f"(on log B_crit) {lo:,.0f} to {hi:,.0f}" in sentence, sentence
        if hi > points.B.max():
            assert "B_crit is not bounded above by the Bs fitted" in sentence and "B_crit ≈" not in sentence
        else:
            assert f"B_crit ≈ {math.exp(logs.mean()):,.0f} " in sentence
        assert f"was {points.noise.median():,.0f} (median of the {points.noise.notna().sum()} runs" in sentence
    assert "factor of 2" not in said


def test_every_trial_at_a_b_enters_the_lr_rule_comparisons():
    """Issue 100, defect 1: the true-batch twins at a B were dropped. The comparison of none at B = 512 against
    B = 32 is the mean of both halves per seed, not the accumulated half alone."""
    trials, history = default_study()
    both = paired(trials[(trials.lr_rule == "none") & (trials.effective_batch == 512)],
                  trials[(trials.lr_rule == "none") & (trials.effective_batch == 32)], "val_acc", STEP)
    acc = paired(trials[(trials.lr_rule == "none") & (trials.effective_batch == 512) & (trials.accum_steps > 1)],
                 trials[(trials.lr_rule == "none") & (trials.effective_batch == 32)], "val_acc", STEP)
    assert both.mean != pytest.approx(acc.mean)
    sentence = next(s for s in summarize(trials, history) if s.startswith("The none LR rule"))
    assert f"{100 * abs(both.mean):.1f} points lower" in sentence


def test_constant_per_seed_differences_keep_the_metrics_resolution():
    """Defect 7: three equal per-seed differences gave an interval of zero width and p = 0, counted as a
    discovery. At val_acc's step of 0.001 the interval is as wide as the step (t(2) * 0.001 / sqrt(6) * sqrt(3)
    is 1.01 steps), and p is positive."""
    a = pd.DataFrame({"seed": [0, 1, 2], "val_acc": [0.952, 0.948, 0.950]})
    b = a.assign(val_acc=a.val_acc - 0.002)
    d = paired(a, b, "val_acc", STEP)
    assert d.mean == pytest.approx(0.002) and d.half >= STEP and 0 < d.p < 1
    assert d.half == pytest.approx(scipy.stats.t.ppf(0.975, 2) * STEP / math.sqrt(6) / math.sqrt(3))
    # Inferred from the values themselves where no step is given (their smallest gap here is 0.002): never narrower.
    assert paired(a, b, "val_acc").half == pytest.approx(2 * d.half)


def test_a_fall_needs_its_interval_and_the_false_discovery_control():
    """Defects 2 and 3: a difference whose own interval excludes 0 but that Benjamini-Hochberg does not keep is
    not a fall; one inside the margin is equivalence; the rest is not resolved, with the seeds it would take."""
    strong, weak = Difference(-0.05, 0.01, 3), Difference(-0.02, 0.018, 3)
    [s, w, *_] = judge([strong, weak, *[Difference(0.0, 0.02, 3)] * 10], 0.01)
    assert s.resolved and weak.separated and not w.resolved and w.adjusted > 0.05
    tight = judge([Difference(0.001, 0.004, 3)], 0.01)[0]
    assert tight.equivalent and not tight.resolved
    wide = judge([Difference(-0.01, 0.03, 3)], 0.01)[0]
    assert not wide.equivalent and not wide.resolved and wide.seeds_needed > 3


def test_the_twins_sentence_says_equivalence_only_inside_the_margin():
    """Defect 2: "indistinguishable in 11 of 12 pairs" quoted point estimates. Pairs whose intervals reach past
    ±1 point are counted as not resolved, with their half-widths."""
    trials, _ = default_study()
    [sentence, _] = twins(trials)
    assert "indistinguishable" not in sentence and "median |difference|" not in sentence
    counts = [int(x) for x in (sentence.split("equivalent within ±1 point in ")[1].split(";")[0].split(" (")[0],
                               sentence.split("not resolved in ")[1].split(" ")[0],
                               sentence.split("resolved in ")[-1].split(".")[0].split(":")[0])]
    assert sum(counts) == 12 and counts[1] > 0


def test_the_memory_noise_and_best_sentences_recomputed_by_an_independent_path():
    """The memory sentence, the last epoch's noise scale and the best configuration with the set that cannot be
    told from it (the memory front's sentence, the recommendation's best line and the table's ★ share it),
    recomputed from the table by pandas and scipy.stats."""
    trials, history = default_study()
    said = " ".join(summarize(trials, history))
    # Memory: at b = 32 from k = 1 to 16, and the true batch of 512 against the largest peak at b = 32.
    at_b = trials[trials.physical_batch == 32].peak_memory_bytes / 2 ** 20
    true = trials[trials.physical_batch == 512].peak_memory_bytes.mean() / 2 ** 20
    span = (f"at {at_b.max():.2f} MiB" if at_b.max() - at_b.min() < 0.01 * at_b.max()
            else f"between {at_b.min():.2f} and {at_b.max():.2f} MiB")
    assert (f"At b = 32, peak memory (saved_tensors) stayed {span} from k = 1 to k = 16, while the true batch of "
            f"512 needed {true:.2f} MiB ({true / at_b.max():.1f}x).") in said
    # The noise scale at the last epoch: the reliable values only, the others counted.
    noise = trials[trials.noise_scale_reliable == 1].noise_scale
    left = int(trials.noise_scale.notna().sum()) - len(noise)
    assert (f"The gradient noise scale at the last epoch was {np.median(noise):.0f} (median of {len(noise)} trials "
            f"with k ≥ 2, range {noise.min():.0f}–{noise.max():.0f})") in said
    assert (f"; {left} value{'s' * (left != 1)} left out as unreliable" in said) == (left > 0)
    # The best: per configuration (b, k, rule; at B = 32 every rule is one configuration, each seed's copies
    # averaged), the highest mean; each other configuration against it paired by seed, BH written out.
    config = trials.assign(lr_rule=np.where(trials.effective_batch == 32, "every", trials.lr_rule))
    per_seed = config.groupby(["physical_batch", "accum_steps", "lr_rule", "seed"]).val_acc.mean().unstack("seed")
    means = per_seed.mean(axis=1)
    best = means.idxmax()
    others = [c for c in per_seed.index if c != best]
    tests = [ttest(per_seed.loc[best], per_seed.loc[c]) for c in others]
    adjusted = bh([p for _, _, p, _ in tests])
    tied = [c for c, (mean, half, _, _), adj in zip(others, tests, adjusted) if not (adj <= 0.05 and mean > half)]
    finding = memory_front(StudyRuns("accum_lr", trials, history, None, "", varied=VARIED)).finding
    b, k, rule = best
    name = f"b = {b}, k = {k}, " + ("every LR rule (B = base_batch)" if rule == "every" else rule)
    assert (f"Against peak memory, the best mean of the {len(means)} configurations was {name} "
            f"({100 * means[best]:.1f}%") in finding
    # Every other configuration counted once where it went: tied exactly, cannot be told, set apart by the per-B
    # lines, resolved worse; the counts add up to the comparisons.
    def count(what: str, text: str) -> int:
        found = re.search(rf"; (\d+) {what}", text)
        return int(found.group(1)) if found else 0
    level = finding.partition("tied for the highest mean with ")[2].partition(", and named")[0]
    exact = len(level.split("; ")) if level else 0
    apart = count("set apart", finding)
    assert count(r"others? cannot be told from it", finding) + apart + exact == len(tied), finding
    assert count("resolved worse than it", finding) == len(others) - len(tied), finding
    assert f"paired by seed over 3 seeds, Benjamini-Hochberg at 5% over {len(others)} comparisons" in finding
    line = next(s for s in recommend(StudyRuns("accum_lr", trials, history, None, "", varied=VARIED))
                if s.startswith("The best accuracy: "))
    assert line.startswith(f"The best accuracy: {name} ({100 * means[best]:.1f}% over 3 seeds, the highest of "
                           f"{len(means)} configurations")
    # The block names apart the ties that the per-B contrasts (a B's (b, k) pooled) resolve lower: with them, the
    # same set as recomputed here.
    below = re.split(r"; \d+ resolved|; paired by seed", line.partition(", which is the best or cannot be told from "
                                                                      "it: ")[2])[0]
    below = below.split("; ") if below else []
    assert f"; {len(tied) - len(below)} others cannot be told from it" in line, line
    assert count("resolved worse than it", line) == len(others) - len(tied) and count("set apart", line) == len(below)
