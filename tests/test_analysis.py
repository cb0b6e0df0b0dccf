import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib.colors
import numpy as np
import pandas as pd
import pytest
import scipy.stats

from batchsweep.analysis.figures import (accuracy_vs_batch, all_figures, best_lr, bn_rules, equivalence,
                                         learning_curves, lr_scaling, warmup_curves)
from batchsweep.analysis.plotting import context, log_scale, protocol, split
from batchsweep.analysis.measures import Measure
from batchsweep.analysis import branching
from batchsweep.analysis import cli as report_cli
from batchsweep.analysis.findings import lr_rule_reading, memory, summarize
from batchsweep.analysis.wording import stated
from batchsweep.analysis.render import MIB, _display, _table, write_report
from batchsweep.analysis.runs import Difference, StudyRuns, aggregate, ci95, load_studies, quantum, reached
from batchsweep.analysis.space import (MIN_IMPORTANCE_TRIALS, front, importance, label, memory_front,
                                       parallel_coordinates, time_front)
from tests.conftest import in_process, run_script
from tests.test_sweeps import TINY, sweep

KS = (1, 2, 4, 8, 16)


def synthetic(accuracy) -> pd.DataFrame:
    """An accum_lr-shaped frame: accuracy(rule, B, kind, seed) gives each trial's val_acc."""
    rows = []
    for seed in (0, 1, 2):
        for rule in ("none", "linear", "sqrt"):
            for k in KS:
                for b, kk, kind in ((32, k, "accumulated" if k > 1 else "true batch"), (32 * k, 1, "true batch")):
                    if kind == "true batch" and kk == 1 and b == 32 and k > 1:
                        continue
                    rows.append(dict(run_id=f"{seed}-{rule}-{b}-{kk}", status="FINISHED", physical_batch=b,
                                     accum_steps=kk, effective_batch=b * kk, lr_rule=rule, seed=seed, epochs=2,
                                     model="cnn1d", dataset="mnist1d", device_name="cpu", batch=kind,
                                     bn_momentum_rule="default", memory_source="saved_tensors",
                                     peak_memory_bytes=1000.0 + 100 * b, samples_per_s=1000.0 * b ** 0.5,
                                     val_acc=accuracy(rule, b * kk, kind, seed), reason=None))
    return pd.DataFrame(rows).drop_duplicates("run_id")


def flat(rule, B, kind, seed):
    return 0.95 + 0.001 * seed


def test_a_difference_outside_the_noise_is_stated():
    def planted(rule, B, kind, seed):  # the same 2.1 points in every seed: the interval excludes zero
        return flat(rule, B, kind, seed) - (0.021 if rule == "linear" and B == 512 else 0.0)

    sentences = " ".join(summarize(synthetic(planted).iloc[::-1]))  # sqrt's trials first
    # The rules in their own order, as the figures draw them, whatever order the trials came in.
    assert sentences.index("The none LR rule") < sentences.index("The sqrt LR rule") < \
        sentences.index("The linear LR rule")
    assert ("The linear LR rule against B = 32 over 3 seeds: equivalent within ±1 point at B = 64 (0.0 ± 0.1 points), "
            "128 (0.0 ± 0.1 points) and 256 (0.0 ± 0.1 points); at B = 512 fell (2.1 points lower, 95% CI -2.2 to "
            "-2.0 over 3 seeds; kept by Benjamini-Hochberg at 5% over 12 comparisons, adjusted p 0.0015).") in sentences
    assert "The sqrt LR rule against B = 32 over 3 seeds: equivalent within ±1 point at B = 64" in sentences
    assert ("the none rule was tied for the highest mean with sqrt (95.1%; sqrt 95.1%, linear 93.0%); against it: sqrt "
            "equivalent within ±1 "
            "point (0.0 ± 0.1 points over 3 seeds); linear 2.1 points lower") in sentences
    assert "the best there is one of none and sqrt: no contrast between them is resolved." in sentences
    assert "fell" not in " ".join(summarize(synthetic(flat)))


def test_a_difference_inside_the_noise_is_indistinguishable():
    swing = {0: -0.03, 1: 0.02, 2: -0.005}  # a mean of -0.5 points, and seeds that disagree on its sign

    def noisy(rule, B, kind, seed):
        return flat(rule, B, kind, seed) + (swing[seed] if rule == "linear" and B == 512 else 0.0)

    sentences = " ".join(summarize(synthetic(noisy)))
    # (-0.5 points lies inside ±1 point: the seeds asked for are those that would show it within the margin)
    assert "at B = 512 not resolved with 3 seeds (-0.5 ± 6.2 points; about 99 seeds would show equivalence " \
           "within ±1 point at this spread)" in sentences
    assert "fell" not in sentences


def test_identical_twins_among_few_values_are_known_to_the_recording_step_not_the_smallest_gap():
    """val_acc over 1,000 samples moves in steps of 0.001; three rules in two seeds ending between 0.275 and 0.44
    show a smallest gap of 0.017, which taken for the step gave every identical pair "0.0 ± 6.2 points" over 2
    seeds."""
    assert quantum([0.275, 0.292, 0.366, 0.388]) == pytest.approx(0.001)
    assert quantum(np.float32([0.275, 0.292, 0.366, 0.388])) == pytest.approx(0.001, rel=1e-4)  # (a float32 metric)
    assert quantum([0.25, 0.5, 0.75]) == 0.25 and quantum([0.5, 0.5]) == 0.0

    def apart(rule, B, kind, seed):
        return {0: 0.275, 1: 0.366}.get(seed, 0.5) + {"none": 0.0, "linear": 0.017, "sqrt": 0.074}[rule]

    two = synthetic(apart)
    sentences = " ".join(summarize(two[two.seed < 2]))
    assert "The linear LR rule against B = 32 over 2 seeds: equivalent within ±1 point at B = 64 (0.0 ± 0.4 " \
           "points)" in sentences, sentences


def test_one_seed_cannot_separate_anything():
    def planted(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.021 if rule == "linear" and B == 512 else 0.0)

    one = synthetic(planted)
    sentences = " ".join(summarize(one[one.seed == 0]))
    assert "2.1 points lower in one seed, which cannot be told from seed noise" in sentences
    assert "run the study with --seeds 3" in sentences and "fell below" not in sentences


def test_every_trial_at_a_b_counts_in_the_lr_rules_comparisons():
    """A grid of b in {8, 16} and k in {1, 4}: B = 64 at b = 16 is the study's largest batch and is compared. In an
    accum_lr-shaped study the true-batch twins at a B enter beside the accumulated runs, averaged per seed: a gap
    in the true-batch half alone moves the comparison by half of it, where keeping b = 32 only hid it."""
    rows = [dict(run_id=f"{seed}-{rule}-{b}-{k}", status="FINISHED", physical_batch=b, accum_steps=k,
                 effective_batch=b * k, lr_rule=rule, seed=seed, epochs=2, model="cnn1d", dataset="mnist1d",
                 device_name="cpu", val_acc=0.9 + 0.01 * seed - 0.001 * b * k * (rule == "none"))
            for seed in (0, 1) for rule in ("none", "sqrt") for b in (8, 16) for k in (1, 4)]
    sentences = summarize(pd.DataFrame(rows))
    assert any(s.startswith("At the largest batch, B = 64, the sqrt rule had the highest mean (90.5%; none 84.1%)")
               for s in sentences)
    assert not any("The LR rules are compared over every trial" in s for s in sentences)  # one (b, k) per B

    def true_half(rule, B, kind, seed):  # the true batch at B = 512 is 3 points lower in every seed, accumulation not
        return flat(rule, B, kind, seed) - (0.03 + 0.002 * seed if kind == "true batch" and B == 512 else 0.0)

    said = " ".join(summarize(synthetic(true_half)))
    assert ("The LR rules are compared over every trial at a B: at B = 64, 128, 256 and 512, each seed's runs at the "
            "(b, k) that make that B (accumulated and true batch) are averaged") in said
    assert "at B = 512 fell (1.6 points lower, 95% CI -1.8 to -1.4 over 3 seeds" in said  # (0 + 3.2) / 2: both halves


def test_planted_accumulation_gap_is_named():
    def planted(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.04 if kind == "accumulated" and B == 128 and rule == "sqrt" else 0)

    sentences = " ".join(summarize(synthetic(planted)))
    assert ("Accumulation and its true-batch twin at the same B were compared in 12 pairs, paired by seed over 3 seeds "
            "(95% t-intervals, median half-width 0.1 points): equivalent within ±1 point in 11 (linear at B = 64; ") \
        in sentences
    assert ("sqrt at B = 512); resolved in 1: sqrt at B = 128: 4.0 points true batch ahead, 95% CI -4.1 to -3.9 over 3 "
            "seeds; kept by Benjamini-Hochberg at 5% over 12 comparisons") in sentences


def test_many_pairs_are_put_under_false_discovery_control():
    # Two gaps far outside the noise, one whose own interval just excludes zero (p = 0.02 of 12 pairs: not a
    # discovery under Benjamini-Hochberg at 5%, whose threshold at rank 3 is 0.0125).
    def planted(rule, B, kind, seed):
        gap = {("sqrt", 128): 0.040 + 0.001 * seed, ("none", 64): 0.040 + 0.001 * seed,
               ("linear", 256): 0.015 + 0.005 * seed}.get((rule, B), 0.0)
        return flat(rule, B, kind, seed) - (gap if kind == "accumulated" else 0.0)

    sentences = " ".join(summarize(synthetic(planted)))
    assert re.search(r"equivalent within ±1 point in 9 \([^)]*\); not resolved in 1 \(linear at B = 256: -2\.0 ± 1\.2 "
                     r"points\); resolved in 2", sentences), sentences
    assert ("Of the 12 twin pairs, 3 differ by their own 95% interval and 2 survive false-discovery control "
            "(Benjamini-Hochberg at 5%, paired t-tests over the seeds): none at B = 64 and sqrt at B = 128.") in sentences

    def one(rule, B, kind, seed):
        return flat(rule, B, kind, seed) - (0.04 + 0.001 * seed if (rule, B, kind) == ("sqrt", 128, "accumulated")
                                            else 0.0)

    assert "Of the 12 twin pairs, 1 differs by its own 95% interval and 1 survives false-discovery control" \
        in " ".join(summarize(synthetic(one)))


@pytest.mark.parametrize("fp64, reading", [
    (6e-16, "mlp: accumulation is exactly the true batch, up to float rounding that training amplified: 1 of 3 "
            "pairs parted by up to 0.0031 in float32, and agreed to 6.0e-16 in float64"),
    (2e-3, "mlp: accumulation is not the true batch (largest relative parameter difference 0.0031; accuracy gap "
           "-0.1 to +0.0 points): something in the model depends on the micro-batch (BatchNorm or another batch "
           "statistic): in float64 the pair still differs by 2.0e-03, which is not rounding."),
    (None, "no float64 pair was measured"),
])
def test_a_pair_without_batchnorm_that_parts_in_float32_is_judged_by_its_float64_pair(fp64, reading):
    """As one seed of three did (mlp, k = 4, 3 epochs): float32 rounding that training amplified to 3e-3."""
    from batchsweep.analysis.findings import exactness

    rows = [dict(status="FINISHED", model="mlp", accum_steps=k, seed=s, param_rel_diff=d, acc_gap=g)
            for k, s, d, g in ((4, 0, 2.4e-7, 0.0), (4, 1, 3.1e-3, -0.001), (4, 2, 6.2e-7, 0.0))]
    if fp64 is not None:
        rows[1]["param_rel_diff_fp64"] = fp64
    [_, said] = exactness(pd.DataFrame(rows))
    assert reading in said, said


def test_steps_to_target_within_epochs():
    # Evaluated at epoch ends (every 10 steps) the target is first seen at step 20; every 2 steps, at 14.
    trials = synthetic(flat)
    trials = trials[(trials.physical_batch == 32) & (trials.lr_rule == "none")].assign(eval_every_steps=2)
    history = pd.DataFrame([dict(run_id=r, epoch=e, steps=10 * e, val_acc=0.5 if e < 2 else 0.95)
                            for r in trials.run_id for e in (1, 2, 3)])
    evals = pd.DataFrame([dict(run_id=r, step=s, step_val_acc=0.5 if s < 14 else 0.95)
                          for r in trials.run_id for s in range(2, 31, 2)])
    assert set(reached(trials, history, 0.9)["steps"]) == {20}
    assert set(reached(trials, history, 0.9, evals)["steps"]) == {14}
    sentences = " ".join(summarize(trials, history, evals))
    assert "evaluated every 2 optimizer steps (eval_every_steps), so steps are known to within 2)" in sentences


def test_a_batch_warmup_is_paired_with_the_fixed_batches_it_grows_from_and_to():
    # Seed 0 reaches the target at step 40 of the warmup (2,000 samples), 20 at B = 256 (5,120) and 100 at
    # B = 32 (3,200); seed s 4s steps later in each. Samples to target, warmup minus B = 256: -3,120, -3,944
    # and -4,768 (mean -3,944, 95% CI +- 4.303 * 824 / sqrt 3); minus B = 32: -1,200, -1,128, -1,056.
    reach = {("32,64", 256): (40, 2000), ("", 256): (20, 5120), ("", 32): (100, 3200)}
    trials, history, evals = [], [], []
    for (arm, b), (step, samples) in reach.items():
        for seed in (0, 1, 2):
            run = f"{arm}-{b}-{seed}"
            trials.append(dict(run_id=run, status="FINISHED", batch_warmup=arm or None, effective_batch=b,
                               physical_batch=32, accum_steps=b // 32, seed=seed, eval_every_steps=4,
                               val_acc=0.95 + 0.001 * seed, model="cnn1d", dataset="mnist1d", reason=None))
            history.append(dict(run_id=run, epoch=1, steps=200, samples=10_000, val_acc=0.95 + 0.001 * seed))
            evals += [dict(run_id=run, step=s, step_samples=s * samples // step,
                           step_val_acc=0.95 if s >= step + seed * 4 else 0.5) for s in range(4, 201, 4)]
    trials, history, evals = pd.DataFrame(trials), pd.DataFrame(history), pd.DataFrame(evals)
    sentences = " ".join(summarize(trials, history, evals))
    assert "Batch-size warmup (B = 32, 64 in the first epochs, then 256), to 90.3% validation accuracy" in sentences
    assert "(steps and samples stated where Benjamini-Hochberg at 5% over their 4 comparisons keeps them)" in sentences
    # The same 20 steps in every seed, counted every 4 steps: an interval as wide as that step, never zero.
    assert ("against a fixed B = 256: +20 steps, 95% CI +16 to +24 over 3 seeds; -3,944 samples, 95% CI -5,991 to "
            "-1,897 over 3 seeds; final accuracy equivalent within ±1 point (0.0 ± 0.1 points over 3 seeds); and "
            "against a fixed B = 32: -60 steps, 95% CI -64 to -56 over 3 seeds; -1,128 samples, 95% CI -1,307 to -949 "
            "over 3 seeds; final accuracy equivalent within ±1 point") in sentences
    assert warmup_curves(trials, evals).name == "batch_warmup" and warmup_curves(trials, None) is None


@pytest.mark.parametrize("critical, said", [
    # On a grid of doublings the branches bound the critical batch between two Bs, never to one: no ratio to the
    # noise scale finer than that is said ("0.85 times" was).
    ({1: 32, 2: 128, 4: 256}, "below 64 after epoch 1, between 128 and 256 after epoch 2, at least 256 after epoch 4 "
     "(Merrill et al. 2025; bounded by the Bs branched to: the largest that kept up, the next that did not). The "
     "reference's noise scale was 20 at epoch 1, 40 at epoch 2, 80 at epoch 4 (McCandlish et al. 2018): inside it at "
     "epoch 1, below it at epoch 2, below it at epoch 4; the branches bound the critical batch only to the Bs branched to, so no closer "
     "ratio is said."),
    ({1: 64, 2: 256, 4: 256}, "between 64 and 128 after epoch 1, at least 256 after epoch 2, at least 256 after "
     "epoch 4 (Merrill"),
    # B = 64 fails after epoch 2 while 128 keeps up: that epoch is not bracketed, and its noise scale is not
    # listed, so each value names its epoch (it read "at those epochs was 20, 80" after four epochs named).
    ({1: 32, 2: -128, 4: 256}, "below 64 after epoch 1, not bracketed after epoch 2 (B = 64 did not keep up while "
     "B = 128 did), at least 256 after epoch 4 (Merrill et al. 2025; bounded by the Bs branched to: the largest "
     "that kept up, the next that did not). The reference's noise scale was 20 at epoch 1, 80 at epoch 4 (McCandlish "
     "et al. 2018; none set against it after epoch 2): inside it at epoch 1, below it at epoch 4;"),
])
def test_the_critical_batch_by_branching_beside_the_noise_scale(critical, said):
    # Reference runs at B = 32 for 10 epochs (val_loss 1/epoch, noise scale 20 x epoch); branches at epochs 1,
    # 2 and 4 into B = 64, 128, 256 for 2 epochs keep up (loss equal to the reference's) up to `critical`.
    trials, history = [], []
    for seed in (0, 1, 2):
        trials.append(dict(run_id=f"ref{seed}", status="FINISHED", batch_warmup=None, effective_batch=32,
                           epochs=10, seed=seed, val_acc=0.9, model="cnn1d", dataset="mnist1d", reason=None))
        history += [dict(run_id=f"ref{seed}", epoch=e, val_loss=1 / e, val_acc=0.9, noise_scale=20.0 * e,
                         noise_scale_reliable=1.0, steps=125 * e) for e in range(1, 11)]
        for t, top in critical.items():
            for b in (64, 128, 256):
                run = f"{t}-{b}-{seed}"
                trials.append(dict(run_id=run, status="FINISHED", batch_warmup=",".join(["32"] * t),
                                   effective_batch=b, epochs=t + 2, seed=seed, val_acc=0.9, model="cnn1d",
                                   dataset="mnist1d", reason=None))
                keeps = b != 64 and b <= -top if top < 0 else b <= top  # (a negative top: B = 64 alone fails)
                history.append(dict(run_id=run, epoch=t + 2, val_loss=(1.0 if keeps else 1.1) / (t + 2),
                                    val_acc=0.9, steps=1))
    trials, history = pd.DataFrame(trials), pd.DataFrame(history)
    sentences = " ".join(summarize(trials, history))
    assert "the critical batch was " + said in sentences and "times the critical batch" not in sentences
    assert "Batch-size warmup" not in sentences  # a repeated B is a branch, not a warmup
    assert branching.figure(trials, history).name == "critical_batch"


def reaching(trials: pd.DataFrame, epochs_to_target) -> pd.DataFrame:
    """A history in which each trial's val_acc jumps from 0.5 to 0.95 at epoch `epochs_to_target(trial)`."""
    rows = []
    for r in trials.itertuples():
        per_epoch, reach = 4000 // r.effective_batch, epochs_to_target(r)
        for e in range(1, 21):
            rows.append(dict(run_id=r.run_id, epoch=e, steps=e * per_epoch, val_acc=0.5 if e < reach else 0.95))
    return pd.DataFrame(rows)


def test_the_critical_batch_is_fitted_to_steps_to_target_beside_the_noise_scale_at_the_target():
    """Steps to the target planted as S = 40 (1 + 128 / B), each seed 5% apart, every run at a B one point: the fit
    finds B_crit near 128 with a t-interval over the seeds' own fits, and the noise scale is the one of the epoch in
    which the target was reached (150 at epoch 5), not the last epoch's (300). No factor-of-2 test is left."""
    from batchsweep.analysis import critical

    b_crit, s_min = critical.fit([32, 64, 128, 256, 512], [100 * (1 + 128 / b) for b in (32, 64, 128, 256, 512)])
    assert b_crit == pytest.approx(128) and s_min == pytest.approx(100)
    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].assign(lr_rule="sqrt").drop_duplicates(["seed", "effective_batch"])
    history = pd.DataFrame([dict(run_id=r.run_id, epoch=e, val_acc=0.5 if e < 5 else 0.95, noise_scale=30.0 * e,
                                 noise_scale_reliable=1.0,
                                 steps=e * math.ceil(40 * (1 + 128 / r.effective_batch) * (1 + 0.05 * (r.seed - 1)) / 5))
                            for r in trials.itertuples() for e in range(1, 11)])
    sentences = " ".join(summarize(trials, history))
    assert ("Over every run, each doubling of B took the median steps to 0.60, 0.67, 0.75, 0.83 of the B before; "
            "B_crit ≈ 122 (each seed's own fit 116, 128, 121, 95% t-interval over the 3 seeds (on log B_crit) 108 to "
            "137; S_min ≈ 42 steps over every run; from 15 runs at B = 32 to 512); the gradient noise scale at "
            "the epoch the target was reached was 150 (median of the 15 runs that measured it there; no interval: 3 "
            "seeds give only 10 distinct resamples") in sentences
    assert "factor of 2" not in sentences and "stopped halving" not in sentences
    [figure] = [f for f in all_figures(trials, history) if f.name == "steps_to_target"]
    # Its caption wraps to the figure: on one line it made the saved image about three times the figure's width.
    drawn = figure.figure
    assert drawn.get_tightbbox(drawn.canvas.get_renderer()).width <= 1.05 * drawn.bbox_inches.width


def test_steps_that_keep_halving_or_were_never_reached_leave_the_critical_batch_unbounded():
    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"])
    trials = trials.assign(lr_rule=np.where(trials.seed == trials.seed.min(), "none", "sqrt"))
    # sqrt: the same epoch at every B, so the steps halve up to the largest B; none: never reached at B = 32.
    history = reaching(trials, lambda r: 4 if r.lr_rule == "sqrt" or r.effective_batch > 32 else 99)
    sentences = " ".join(summarize(trials, history))
    assert ("For none (at B = 32, 1 of 1 runs never reached it: half or more, left out of the fit), each doubling of "
            "B took the median steps to 0.50, 0.48, 0.47 of the B before; B_crit is not bounded above: seed 0's own fit "
            "lies at the search's bound (B_crit past 64 times the largest B it ran), so it is not bounded above, and "
            "neither is B_crit (from 4 runs at B = 64 to 512): the last doubling took the steps to 0.47 of the B before "
            "(0.50 is perfect scaling, 1 none); no reliable noise scale was measured") in sentences
    assert "32,768" not in sentences  # (the search's bound, no value of B_crit)
    assert "close to 1/B" not in sentences
    assert "For sqrt, each doubling of B took the median steps to 0.50, 0.50, 0.48, 0.47 of the B before; B_crit is " \
           "not bounded above: " in sentences
    one = trials[trials.effective_batch <= 64]  # two Bs: nothing to fit
    assert "B_crit could not be fitted" not in " ".join(summarize(one, history))  # (fewer than 3 Bs: no sentence)


def test_steps_known_only_to_within_an_epoch_leave_a_ratio_unresolved_and_say_so():
    """Every run reached the target at its first or second epoch's end: a ratio of 1.00 or 0.50 per doubling is
    the epoch's granularity, not a measurement of scaling; the sentence says each such ratio's range."""
    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"]).assign(lr_rule="sqrt")
    history = reaching(trials, lambda r: 1 if r.effective_batch <= 64 else 2)
    [sentence] = [s for s in summarize(trials, history) if s.startswith("For sqrt") or s.startswith("Over every")]
    assert "not resolved at this evaluation's granularity" in sentence, sentence
    assert "not resolved at B = 64 (0.00 to ∞)" in sentence, sentence
    # At the fourth epoch's end each ratio's range (0.37 to 0.66) lies within a factor of 2: resolved as measured.
    later = summarize(trials, reaching(trials, lambda r: 4))
    assert not any("granularity" in s for s in later), later


def test_a_largest_b_that_never_reached_the_target_is_not_called_the_largest_b_run():
    """sqrt halves its steps up to B = 256, and at B = 512 no run reached the target: the fit's largest B is 256,
    and B = 512's runs, censored, argue against a B_crit far above it."""
    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"]).assign(lr_rule="sqrt")
    history = reaching(trials, lambda r: 99 if r.effective_batch == 512 else 4)
    [sentence] = [s for s in summarize(trials, history) if s.startswith("For sqrt") or s.startswith("Over every")]
    assert "B_crit is not bounded above: seeds 0, 1 and 2's own fits lie at the search's bound" in sentence \
        and "(from 12 runs at B = 32 to 256)" in sentence and "largest B run" not in sentence, sentence
    assert ("runs beyond it never reached the target in their epochs (3 of 3 at B = 512), which argues against a "
            "B_crit far above 256") in sentence, sentence


def test_bn_rules_are_compared_by_their_running_statistics():
    rows = []
    errors = {"default": 0.02, "scaled": 0.13, "matched": 0.12, "true": 0.12}
    jitter = {0: 0.0, 1: 0.004, 2: -0.004}  # seed to seed, shared by the rules of one seed but scaled's
    for seed in (0, 1, 2):
        for rule in ("default", "scaled", "matched"):
            noise = jitter[(seed + 1) % 3] if rule == "scaled" else jitter[seed]
            rows.append(dict(run_id=f"{seed}{rule}", status="FINISHED", physical_batch=32, accum_steps=16,
                             effective_batch=512, bn_momentum_rule=rule, seed=seed, val_acc=0.9,
                             bn_mean_error=errors[rule] + noise, batch="accumulated"))
        rows.append(dict(run_id=f"{seed}true", status="FINISHED", physical_batch=512, accum_steps=1,
                         effective_batch=512, bn_momentum_rule="default", seed=seed, val_acc=0.9,
                         bn_mean_error=errors["true"] + jitter[seed], batch="true batch"))
    sentences = " ".join(summarize(pd.DataFrame(rows)))
    assert "the BN running means ended default 0.020, scaled 0.13, matched 0.12 population standard deviations" \
        in sentences  # the rules in their own order, as in the figures
    # default is 0.1 closer in every seed: stated; scaled's 0.01 is inside its seed noise: not stated.
    assert "(true batch: 0.12); default closer to it than the true batch (-0.10, 95% CI -0.10 to -0.096; kept by " \
           "Benjamini-Hochberg at 5% over 3 comparisons, adjusted p 2.7e-04); not resolved from the true batch's " \
           "with 3 seeds: scaled, matched." in sentences
    # (every accuracy is 90.0%: said once, and no comparison of it, whose interval would have no width)
    assert "Every finished trial ended at the same accuracy (90.0%)" in sentences and "Final accuracy" not in sentences


def test_the_memory_sentence_names_the_ks_that_ran():
    """From the smallest k run at b to the largest: a study without k = 1 at b (critical_batch's k = 2 to 32)
    never reads "from k = 1"; with one k, its memory is held against the true batch, or not said."""
    t = synthetic(flat).assign(peak_memory_bytes=lambda d: d["peak_memory_bytes"] * 1024)  # 4.10 MiB at b = 32
    assert memory(t) == ["At b = 32, peak memory (saved_tensors) stayed at 4.10 MiB from k = 1 to k = 16, while the "
                         "true batch of 512 needed 50.98 MiB (12.4x)."]
    assert memory(t[t["accum_steps"] != 1]) == ["At b = 32, peak memory (saved_tensors) stayed at 4.10 MiB from k = 2 "
                                                "to k = 16."]
    one_k = t[(t["accum_steps"] == 4) | (t["physical_batch"] == 128)]
    assert memory(one_k) == ["At b = 32 and k = 4, peak memory (saved_tensors) was 4.10 MiB, while the true batch "
                             "of 128 needed 13.48 MiB (3.3x)."]
    assert memory(t[t["accum_steps"] == 4]) == []


def test_seed_aggregation_gives_mean_and_t_interval():
    stats = aggregate(synthetic(flat), ["lr_rule", "effective_batch", "batch"], "val_acc")
    row = stats[(stats.lr_rule == "none") & (stats.effective_batch == 64) & (stats.batch == "accumulated")].iloc[0]
    assert row["n"] == 3 and row["mean"] == pytest.approx(0.951)
    # values 0.950, 0.951, 0.952: sd 0.001, t(0.975, 2) = 4.303
    assert row["ci95"] == pytest.approx(4.303 * 0.001 / 3 ** 0.5, rel=1e-3)


def test_figures_from_a_synthetic_frame(tmp_path):
    trials = synthetic(flat)
    history = pd.DataFrame([dict(run_id=r, epoch=e, val_acc=0.5 + 0.2 * e) for r in trials.run_id for e in (1, 2)])
    names = [f.name for f in all_figures(trials, history)]
    assert names == ["accuracy_vs_batch", "memory_vs_batch", "throughput", "learning_curves"]
    page = write_report([StudyRuns("synthetic", trials, history, None, "sqlite:///nowhere")], tmp_path)[0][0]
    assert page.read_text().count("<img") == 4
    assert all((tmp_path / f"{n}.png").stat().st_size > 1000 for n in names)


def test_a_study_without_accuracy_reports_what_it_has(tmp_path):
    """Float targets (a regression) log val_loss and no accuracy: the report neither fails on comparisons stated in
    accuracy points nor draws an empty accuracy figure or column; it compares the configurations in the study's
    objective, where lower is better, and says what it left out."""
    def loss(rule, B, kind, seed):  # linear worse at B = 512; one twin pair where accumulation is ahead (every
        # value a multiple of 0.001: the loss read in steps of 0.001)
        return (0.1 + 0.001 * seed + (0.031 if rule == "linear" and B == 512 else 0.0)
                - (0.004 if rule == "sqrt" and B == 128 and kind == "accumulated" else 0.0))

    trials = synthetic(loss).rename(columns={"val_acc": "val_loss"}).assign(val_acc=np.nan, noise_scale=40.0)
    history = pd.DataFrame([dict(run_id=r, epoch=e, val_loss=1.0 / e) for r in trials.run_id for e in (1, 2)])
    sentences = " ".join(summarize(trials, history, objective=("val_loss", "minimize")))
    assert "No finished trial has an accuracy (val_acc): configurations are compared in val_loss (lower is " \
           "better), and steps to a target accuracy and batch warmup are left out; ±" in sentences
    assert "±0.001 in val_loss is the equivalence margin δ: 1% of B = 32's mean 0.1 (the smallest B, its " \
           "configurations over 3 seeds)" in sentences
    assert "at B = 512 rose (val_loss 0.0310 higher, 95% CI +0.0300 to +0.0320 over 3 seeds; kept by " \
           "Benjamini-Hochberg at 5% over 12 comparisons" in sentences  # a loss that rose did worse
    # (δ is 1% of B = 32's mean, 0.001: a B whose seeds ended as B = 32's did, read in steps of 0.001, is not yet
    # shown inside it with 3 seeds)
    assert "The sqrt LR rule against B = 32 over 3 seeds: at B = 64 not resolved with 3 seeds (val_loss +0.0000 ± " \
           "0.0010; about 4 seeds would show equivalence within ±0.001 in val_loss at this spread)" in sentences
    assert "At the largest batch, B = 512, the none rule was tied for the lowest mean with sqrt (val_loss 0.101; sqrt " \
           "val_loss 0.101, " \
           "linear val_loss 0.132); against it: sqrt not resolved with 3 seeds" in sentences
    assert "resolved in 1: sqrt at B = 128: val_loss 0.0040 accumulated ahead" in sentences
    assert "The gradient noise scale" in sentences and "peak memory" in sentences
    # Which way is better follows the objective's direction: a higher r2 is.
    scored = trials.rename(columns={"val_loss": "r2"}).assign(r2=lambda t: 1 - t.r2)
    assert "sqrt at B = 128: r2 0.0040 accumulated ahead" in " ".join(summarize(scored, objective=("r2", "maximize")))
    assert "compared in" not in " ".join(summarize(trials.assign(val_loss=np.nan)))
    # An exact twin's loss differs by rounding: two significant digits, not "+0.0000".
    assert stated(Difference(3e-8, 1e-7, 3), m=Measure("val_loss", False)) == \
        "equivalent within ±0.01 in val_loss (val_loss +3e-08 ± 1e-07 over 3 seeds)"
    figures = {f.name: f for f in all_figures(trials, history, objective=("val_loss", "minimize"))}
    assert list(figures) == ["objective_vs_batch", "memory_vs_batch", "throughput", "learning_curves"]
    assert figures["learning_curves"].figure.axes[0].get_ylabel() == "val_loss"
    ax = figures["objective_vs_batch"].figure.axes[0]
    assert ax.get_ylabel() == "final val_loss (lower is better)"
    means = [y for line in ax.get_lines() if line.get_marker() in ("o", "s") for y in line.get_ydata()]
    assert max(means) == pytest.approx(0.1 + 0.001 + 0.031)  # linear at B = 512, in the loss's own units
    assert [f.name for f in all_figures(trials.assign(val_loss=np.nan), history)] == ["memory_vs_batch", "throughput"]
    rules = trials.assign(bn_momentum_rule=np.resize(["default", "scaled", "matched"], len(trials)))
    assert "Final val_loss at k = 2 against the true batch: scaled not resolved with 3 seeds (val_loss +0.0000 ± " \
           "0.0010; about 4 seeds would show equivalence within ±0.001 in val_loss at this spread)" in \
        " ".join(summarize(rules))
    assert bn_rules(rules, ("val_loss", "minimize")).figure.axes[0].get_ylabel() == "final val_loss (lower is better)"
    study = StudyRuns("regression", trials, history, None, "sqlite:///nowhere", objectives=(("val_loss", "minimize"),))
    write_report([study], tmp_path)
    assert tmp_path.joinpath("trials.csv").read_text().splitlines()[0].split(",")[:9] == [
        "effective_batch", "physical_batch", "accum_steps", "lr_rule", "model", "seed", "status", "reason", "val_loss"]
    assert "at B = 512 rose (val_loss 0.0310 higher" in tmp_path.joinpath("report.md").read_text()


def test_a_rule_keeps_its_colour_and_place_in_every_figure():
    """The trials arrive in any order: each rule reads in its own order and keeps its colour across figures."""
    trials = synthetic(flat).iloc[::-1].reset_index(drop=True)  # sqrt's trials first, then linear's
    history = pd.DataFrame([dict(run_id=r, epoch=e, val_acc=0.5 + 0.2 * e, grad_norm=1.0 / e, update_ratio=1e-3)
                            for r in trials.run_id for e in (1, 2)])
    figures = {f.name: f.figure for f in all_figures(trials, history)}
    rgb = matplotlib.colors.to_rgb

    accuracy = figures["accuracy_vs_batch"].axes[0].get_legend_handles_labels()
    by_line = {label.split(" / ")[0]: rgb(h.lines[0].get_color()) for h, label in zip(*accuracy)
               if label.endswith("accumulated")}
    legend = figures["health"].axes[0].get_legend()
    by_health = {t.get_text(): rgb(h.get_color()) for h, t in zip(legend.legend_handles, legend.get_texts())}
    assert list(by_line) == list(by_health) == ["none", "sqrt", "linear"]
    assert by_line == by_health and len(set(by_line.values())) == 3
    titles = [ax.get_title() for ax in figures["learning_curves"].axes]
    assert titles == [f"lr_rule = {rule}" for rule in ("none", "sqrt", "linear")]
    assert all(tick == int(tick) for tick in figures["learning_curves"].axes[0].get_xticks())  # whole epochs
    # A study without 'none' gives 'linear' and 'sqrt' the same colours as one with it.
    without_none = {rule: color for rule, color in split(trials)[1].items() if rule != "none"}
    assert split(trials[trials.lr_rule != "none"])[1] == without_none
    # With the LR rule varied too, the BN rules' bars keep their own colours.
    both = trials.assign(bn_momentum_rule=["default", "scaled", "matched"] * (len(trials) // 3) +
                         ["default"] * (len(trials) % 3))
    ax = bn_rules(both).figure.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["k = 1", "true batch", "default", "scaled", "matched"]
    # Its bars' intervals are the findings' t-intervals over the seeds, not seaborn's bootstrap (about their range).
    low, high = ax.get_lines()[0].get_ydata()  # k = 1, at B = 32
    assert high - low == pytest.approx(2 * 100 * ci95(both.loc[both.effective_batch == 32, "val_acc"]))


@pytest.mark.parametrize("noise, said", [(4.0, "noise scale at the last epoch ≈ 4 (median), below every B run"),
                                          (200.0, "noise scale at the last epoch ≈ 200 (median)"),
                                          (1e5, "noise scale at the last epoch ≈ 100000 (median), above every B run")])
def test_a_critical_batch_far_off_the_bs_run_is_said_not_drawn(noise, said):
    """adam_lr's noise scale of 13 drew a line left of B = 32 that squeezed the Bs run to one side."""
    trials = synthetic(flat)
    trials = trials.assign(noise_scale=np.where(trials.accum_steps > 1, noise, np.nan))
    ax = accuracy_vs_batch(trials).figure.axes[0]
    assert said in [t.get_text() for t in ax.get_legend().get_texts()]
    lines = [line for line in ax.get_lines() if line.get_linestyle() == "--" and line.get_color() == "gray"]
    assert len(lines) == (0 if said.endswith("every B run") else 1)
    assert ax.get_xlim()[0] > 16 and ax.get_xlim()[1] < 1024  # the Bs run, 32 to 512, fill the axis


def test_accuracy_bars_stop_at_100_percent():
    """Two seeds at 99% and 91%: the t-interval's half-width (t = 12.7) is 51 points, past 100% above; the
    bar stops there and keeps its full length below."""
    trials = synthetic(lambda rule, B, kind, seed: 0.99 if seed == 0 else 0.91)
    ax = accuracy_vs_batch(trials[trials.seed < 2]).figure.axes[0]
    ends = np.concatenate([np.asarray(segments)[:, :, 1].ravel() for collection in ax.collections
                           for segments in [collection.get_segments()] if segments])
    half = 100 * scipy.stats.t.ppf(0.975, 1) * np.std([0.99, 0.91], ddof=1) / np.sqrt(2)
    assert ends.max() == pytest.approx(100) and ends.min() == pytest.approx(95 - half)


def test_the_equivalence_figure_shows_each_seed_and_a_median_that_one_seed_cannot_carry():
    """mlp's one seed that parted in float32 would lift a mean 5 orders of magnitude on the log axis."""
    rows = [dict(run_id=f"{model}{seed}", status="FINISHED", model=model, dataset="mnist1d", physical_batch=32,
                 accum_steps=2, effective_batch=64, seed=seed, param_rel_diff=value, acc_gap=0.0)
            for model, values in (("mlp", (1e-7, 2e-7, 0.04)), ("cnn1d", (0.5, 0.6, 0.7)))
            for seed, value in enumerate(values)]
    left = equivalence(pd.DataFrame(rows)).figure.axes[0]
    assert sorted(bar.get_height() for bar in left.patches if bar.get_height() > 0) == pytest.approx([2e-7, 0.6])
    assert sum(len(dots.get_offsets()) for dots in left.collections) == 6


def test_a_comparison_sets_the_studies_figures_of_one_kind_side_by_side(tmp_path):
    """Learning curves by lr_rule and by bn_momentum_rule are one section, each figure's title in its caption."""
    lr = synthetic(flat)
    bn = lr.assign(bn_momentum_rule=lr.lr_rule.map({"none": "default", "linear": "scaled", "sqrt": "matched"}),
                   lr_rule="linear")
    history = pd.DataFrame([dict(run_id=r, epoch=e, val_acc=0.5 + 0.2 * e) for r in lr.run_id for e in (1, 2)])
    write_report([StudyRuns(name, trials, history, None, "sqlite:///nowhere") for name, trials in
                  (("lr", lr), ("bn", bn))], tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert md.count("## Learning curves") == 1 and "by lr_rule\n" not in md
    section = md.split("## Learning curves\n")[1].split("\n## ")[0]
    assert "*lr: Learning curves by lr_rule. cnn1d on mnist1d" in section
    assert "*bn: Learning curves by bn_momentum_rule. cnn1d on mnist1d" in section
    assert "## Validation accuracy against effective batch\n" in md  # one title: the section's, not repeated
    assert md.count("![") == len(list(tmp_path.glob("*.png")))  # no figure lost to a heading two kinds share


@pytest.mark.parametrize("rule, power", [("none", 0.0), ("sqrt", 0.5)])
def test_lr_exponent_is_fitted_to_the_lr_trained_at(rule, power):
    """Under the sqrt rule the searched base LR is scaled by (B/32)^0.5 before training: the exponent is that of
    the LR trained at (0.7 here), not of the base LR (0.2), or `none` would read as the rule the data prefer."""
    rows = [dict(run_id=f"{b}-{lr}", status="FINISHED", effective_batch=b, base_lr=lr / (b / 32) ** power, lr=lr,
                 lr_rule=rule, physical_batch=32, accum_steps=b // 32, seed=0, epochs=2, model="mlp", dataset="d",
                 device_name="cpu", val_acc=1 - abs(lr - 0.05 * (b / 32) ** 0.7) / 10, reason=None)
            for b in (32, 64, 128, 256) for lr in [0.05 * (b / 32) ** 0.7 * f for f in (0.5, 1.0, 2.0)]]
    best, alpha = best_lr(pd.DataFrame(rows))
    assert alpha == pytest.approx(0.7, abs=1e-6)
    sentence = " ".join(summarize(pd.DataFrame(rows)))
    # (each seed's best refined by a parabola in log LR through its neighbours: near 0.214, not on the grid)
    assert "at B = 256 (each seed's best LR at a B, their geometric mean)" in sentence
    # One seed: its slope (0.70) is said, and no shape or LR rule is read from it.
    assert "With one seed no shape of the best LR against B can be told from seed noise (slope 0.70 " in sentence
    assert "It reads as" not in sentence and "singles out" not in sentence
    # A regression's best LR is the one of the lowest loss, not of the highest.
    losses = pd.DataFrame(rows).assign(val_loss=lambda t: 1 - t.val_acc, val_acc=np.nan)
    sentence = " ".join(summarize(losses, objective=("val_loss", "minimize")))
    assert "at B = 256 (each seed's best LR" in sentence
    assert best_lr(losses, Measure("val_loss", False))[0]["lr"].tolist() == best["lr"].tolist()
    assert lr_scaling(losses, ("val_loss", "minimize")) is not None


def test_the_learning_curves_of_a_search_are_its_best_finished_trial_at_each_b():
    """A mean over searched LRs would mix a diverged LR into every curve, and a pruned trial's curve ends where it
    stopped: each B draws its best finished trial, and the findings say what left the unfinished ones out."""
    rows, history = [], []
    for b in (32, 128):
        for lr, final, status in ((0.01, 0.6, "FINISHED"), (0.1, 0.9, "FINISHED"), (1.0, 0.95, "KILLED")):
            rows.append(dict(run_id=f"{b}-{lr}", status=status, effective_batch=b, base_lr=lr, physical_batch=32,
                             accum_steps=b // 32, seed=0, epochs=3, model="cnn1d", dataset="d", device_name="cpu",
                             batch="true batch" if b == 32 else "accumulated", val_acc=final,
                             reason=None if status == "FINISHED" else "pruned"))
            history += [dict(run_id=f"{b}-{lr}", epoch=e, val_acc=final * e / 3) for e in (1, 2, 3)]
    trials = pd.DataFrame(rows)
    figure = learning_curves(trials, pd.DataFrame(history))
    assert figure.title == "Learning curves of the best trial at each B"
    drawn = [tuple(np.round(line.get_ydata(), 3)) for ax in figure.figure.axes for line in ax.lines
             if len(line.get_ydata())]
    assert drawn == [(0.3, 0.6, 0.9)] * 2
    assert "2 of 6 trials did not finish (2 pruned); they are left out of the figures." in summarize(trials)
    assert ("2 of 6 trials did not finish (2 pruned); they are left out of the figures, except training health, "
            "which draws every trial.") in summarize(trials.assign(grad_norm=1.0))
    one = trials.drop(index=2).assign(health=["ok", "ok", "stalled", "ok", "ok"])
    assert "1 of 5 trials did not finish (1 pruned); it is left out of the figures." in summarize(one)
    assert "1 trial was not healthy (1 stalled): see the training health table." in summarize(one)
    assert "to 0.1 at B = 128 (each seed's best LR" in " ".join(summarize(one))
    assert "(slope 0.00 in log-log" in " ".join(summarize(one))  # never "-0.00"


def test_the_learning_curves_leave_out_trials_whose_b_changed_in_training():
    """A branch of critical_batch (or a batch warmup) trained at B = 32 before its B: averaged into its B's curve,
    it would drag that curve by its own epochs at 32. Its curves are the branching and warmup figures'."""
    rows = [dict(run_id=f"{b}-{warmup}", status="FINISHED", effective_batch=b, physical_batch=32,
                 accum_steps=b // 32, seed=0, epochs=3, model="cnn1d", dataset="d", device_name="cpu",
                 batch="accumulated", val_acc=0.9, batch_warmup=warmup) for b, warmup in ((64, ""), (64, "32,32"))]
    history = pd.DataFrame([dict(run_id=r["run_id"], epoch=e, val_acc=0.3 * e if r["batch_warmup"] == "" else 0.1)
                            for r in rows for e in (1, 2, 3)])
    figure = learning_curves(pd.DataFrame(rows), history)
    drawn = [tuple(np.round(line.get_ydata(), 3)) for ax in figure.figure.axes for line in ax.lines
             if len(line.get_ydata())]
    assert drawn == [(0.3, 0.6, 0.9)]


def test_an_interval_that_excludes_zero_never_reads_as_reaching_it():
    from batchsweep.analysis.wording import stated
    from batchsweep.analysis.runs import Difference

    # adam_lr's linear rule at B = 128 on a 2-core CPU: 1.3 points lower, the interval ending 0.04 below zero
    # (both ends in the decimals that keep the nearer one off zero: not "-2.6 to -0.04")
    assert stated(Difference(-0.0130, 0.0126, 3)) == ("1.30 points lower, 95% CI -2.56 to -0.04 over 3 seeds; paired "
                                                      "t-test p 0.047, the one comparison")
    assert stated(Difference(0.0210, 0.0050, 3)).startswith("2.1 points higher, 95% CI +1.6 to +2.6 over 3 seeds")


@pytest.mark.parametrize("lo, hi, reading", [
    (0.3, 0.7, "It reads as square-root scaling: of the exponents 0 (LR unchanged), 0.5 (square root) and 1 "
               "(linear), the interval holds 0.5 and lies within 0.25 of it (halfway to the neighbouring exponents)"),
    (0.8, 1.2, "It reads as linear scaling: of the exponents 0 (LR unchanged), 0.5 (square root) and 1 (linear), "
               "the interval holds 1 and lies within 0.25 of it (halfway to the neighbouring exponents)"),
    (-0.2, 0.2, "It reads as no scaling: of the exponents 0 (LR unchanged), 0.5 (square root) and 1 (linear), "
                "the interval holds 0 and lies within 0.25 of it (halfway to the neighbouring exponents)"),
    # holds 0.5 alone, but reaches 0.05 from 0 and 1: not read as the square root
    (0.05, 0.95, "It is consistent with square-root scaling (the interval holds 0.5), but does not lie within 0.25 "
                 "of one exponent (halfway to the neighbouring ones), so no rule is read from it: use each B's best LR"),
    # lr_search on a 2-core CPU read -0.17 to 0.75: that cannot tell the square root from leaving the LR alone
    (-0.17, 0.75, "It is consistent with no scaling and square-root scaling (the interval holds 0 and 0.5), but "
                  "does not lie within 0.25 of one exponent (halfway to the neighbouring ones), so no rule is read "
                  "from it: use each B's best LR"),
    (1.2, 1.5, "It is consistent with no rule: the interval holds none of the exponents 0 (LR unchanged), 0.5 "
               "(square root) and 1 (linear), and lies above 1 (steeper than linear: 1.20 to 1.50 excludes 1); use "
               "each B's best LR"),
    # within 0.25 of 1 but excluding it: not read as linear
    (0.8, 0.95, "It is consistent with no rule: the interval holds none of the exponents 0 (LR unchanged), 0.5 "
                "(square root) and 1 (linear), and lies between 0.5 and 1 (between the square root and linear: 0.80 "
                "to 0.95 excludes both); use each B's best LR"),
])
def test_an_lr_rule_is_named_only_where_the_interval_lies_within_a_quarter_of_its_exponent(lo, hi, reading):
    assert lr_rule_reading(lo, hi) == reading


@pytest.fixture(scope="module")
def tiny_study(tmp_path_factory):
    folder = tmp_path_factory.mktemp("study")
    proc = sweep(folder, *TINY, "--n-trials", "8", "--epochs", "2", "--seeds", "2")  # 4 points: B = 32 and 64
    assert proc.returncode == 0, proc.stderr
    return folder


def test_loads_typed_frames_from_a_real_study(tiny_study):
    runs = load_studies(["accum_lr"], f"sqlite:///{tiny_study}/mlruns/mlflow.db")[0]
    t = runs.trials
    assert len(t) == 8 and set(t["seed"]) == {0, 1}
    assert t["effective_batch"].dtype.kind == "i" and t["lr"].dtype.kind == "f" and t["drop_last"].dtype == bool
    assert (t["effective_batch"] == t["physical_batch"] * t["accum_steps"]).all()
    assert list(runs.history.groupby("run_id")["epoch"].apply(list).iloc[0]) == [1, 2]
    assert runs.parent_run_id is not None


def test_each_run_of_several_seeds_is_named_with_its_seed(tiny_study):
    """In the MLflow UI and on the epoch bar, '3: b32 k2 linear seed 1', not the same name for every seed."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tiny_study}/mlruns/mlflow.db")
    runs = [r for r in client.search_runs([client.get_experiment_by_name("accum_lr").experiment_id])
            if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 8
    for run in runs:
        number = run.data.tags["optuna.trial_number"]
        assert re.fullmatch(rf"{number}: b\d+ k\d+ \w+ seed {run.data.params['seed']}", run.info.run_name), \
            run.info.run_name


def test_the_protocol_line_counts_one_epoch_as_one():
    trials = pd.DataFrame({"optimizer": ["adamw"] * 2, "schedule": ["cosine"] * 2, "warmup_epochs": ["1"] * 2,
                           "weight_decay": ["0.0"] * 2, "epochs": ["1"] * 2, "seed": [0, 1]})
    assert protocol(trials) == "adamw; linear warmup 1 epoch, then cosine; weight decay 0.0; 1 epoch; 2 seeds"
    trials["warmup_epochs"], trials["epochs"] = "2.5", "8"
    assert "linear warmup 2.5 epochs, then cosine; weight decay 0.0; 8 epochs; 2 seeds" in protocol(trials)
    trials = pd.concat([trials, trials.assign(epochs="10"), trials.assign(epochs="3", optimizer="sgd")])
    assert protocol(trials).endswith("3, 8, 10 epochs; 2 seeds")  # critical_batch's read '10, 3, 4, 6 epochs'
    assert protocol(trials).startswith("adamw, sgd;")


@pytest.mark.slow
def test_report_command_and_compare(tiny_study):
    uri = f"sqlite:///{tiny_study}/mlruns/mlflow.db"
    proc = in_process(report_cli.main, tiny_study, "--study", "accum_lr", "--tracking-uri", uri)  # (imports paid)
    assert proc.returncode == 0, proc.stderr
    folder = tiny_study / "reports/accum_lr"
    assert {"report.html", "report.md", "trials.csv", "accuracy_vs_batch.png"} <= {p.name for p in folder.iterdir()}
    md = (folder / "report.md").read_text()
    assert "## Findings: accum_lr" in md and "2 epochs; 2 seeds" in md
    assert "Protocol: sgd (momentum 0.9); no warmup, then cosine; weight decay 0.0005; 2 epochs; 2 seeds." in md
    assert "## Training health: accum_lr" in md and "health.png" in md
    raw = pd.read_csv(folder / "trials.csv")  # the table's columns first, then every param, metric and tag
    assert list(raw.columns[:3]) == ["effective_batch", "physical_batch", "accum_steps"] and len(raw) == 8
    assert {"run_id", "val_loss", "train_loss", "grad_norm", "weight_decay", "optuna.trial_number"} <= set(raw)
    # A second study under another name, then both side by side.
    assert sweep(tiny_study, *TINY, "--study", "batch_memory", "--n-trials", "3").returncode == 0
    proc = in_process(report_cli.main, tiny_study, "--compare", "accum_lr", "batch_memory", "--tracking-uri", uri)
    assert proc.returncode == 0, proc.stderr
    both = (tiny_study / "reports/accum_lr_vs_batch_memory/report.md").read_text()
    assert "## Findings: accum_lr" in both and "## Findings: batch_memory" in both
    assert "batch_memory-throughput.png" in both


@pytest.mark.parametrize("args,expected", [
    (["--study", "nothing"], "no study 'nothing'"),
    (["--compare", "accum_lr", "nothing", "--out", "new/reports"], "no study 'nothing'"),
    (["--compare", "accum_lr", "accum_lr"], "--compare names 'accum_lr' twice"),  # not a report of two equal halves
    (["--study", "accum_lr", "--tracking-uri", "sqlite:////nonexistent/mlflow.db"], "no MLflow store at"),
])
def test_report_bad_input(tiny_study, args, expected):
    uri = ["--tracking-uri", f"sqlite:///{tiny_study}/mlruns/mlflow.db"] if "--tracking-uri" not in args else []
    proc = run_script("analysis/report.py", *args, *uri, cwd=tiny_study)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: ") and expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not {"nothing", "accum_lr_vs_accum_lr"} & {p.name for p in (tiny_study / "reports").glob("*")}
    assert not (tiny_study / "new").exists()  # no empty folder


# Injected before the report's own content: collects console errors and checks every image once loaded.
PROBE = """<script>
window.__errors = [];
const error = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); error(...a); };
window.addEventListener('error', e => window.__errors.push(String(e.message || e.target.src || e)), true);
window.addEventListener('load', () => {
  const images = [...document.images].map(i => ({alt: i.alt, ok: i.complete && i.naturalWidth > 0}));
  const pre = document.createElement('pre'); pre.id = 'probe';
  const page = document.documentElement;  // wider than the window: the reader scrolls the whole page sideways
  pre.textContent = JSON.stringify({errors: window.__errors, overflow: page.scrollWidth - page.clientWidth, images});
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
    pytest.skip("headless Chromium is not installed here (apt-get install chromium)")


def probe_in_chromium(page: str, folder: Path, probe: str = PROBE) -> dict:
    """Open an HTML page, with `probe` injected first, in headless Chromium; returns what the probe found."""
    probed = folder / "probed.html"
    probed.write_text(page.replace("<head>", "<head>" + probe, 1))
    out = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                          "--no-first-run", "--disable-background-networking", "--disable-component-update",
                          "--disable-sync", f"--user-data-dir={folder / 'profile'}", "--virtual-time-budget=5000",
                          "--dump-dom", probed.as_uri()], capture_output=True, text=True, timeout=120)
    assert '<pre id="probe">' in out.stdout, out.stderr[-2000:]
    return json.loads(out.stdout.split('<pre id="probe">', 1)[1].split("</pre>", 1)[0].replace("&quot;", '"'))


def test_html_report_opens_in_chromium_with_every_figure(tiny_study, tmp_path):
    chromium()
    uri = f"sqlite:///{tiny_study}/mlruns/mlflow.db"
    assert in_process(report_cli.main, tiny_study, "--study", "accum_lr", "--tracking-uri", uri, "--no-log",
                      "--out", str(tmp_path)).returncode == 0
    result = probe_in_chromium((tmp_path / "accum_lr/report.html").read_text(), tmp_path)
    assert result["errors"] == []
    assert len(result["images"]) >= 3 and all(i["ok"] for i in result["images"]), result["images"]
    assert result["overflow"] == 0  # the trials table, wider than the window, scrolls by itself
    alts = " ".join(i["alt"] for i in result["images"])
    assert "Validation accuracy against effective batch" in alts and "Peak memory against effective batch" in alts


def test_noise_scale_sentence_leaves_out_unreliable_values():
    trials = synthetic(flat)
    trials["noise_scale"] = trials["accum_steps"].map(lambda k: 250.0 if k > 1 else float("nan"))
    trials["noise_scale_reliable"] = trials["accum_steps"].map(lambda k: 0.0 if k == 16 else 1.0)
    trials.loc[trials.accum_steps == 16, "noise_scale"] = 4000.0  # the finite-set correction dominated
    sentences = " ".join(summarize(trials))
    assert "The gradient noise scale at the last epoch was 250 (median of 27 trials with k ≥ 2, range 250–250); " \
           "9 values left out as unreliable" in sentences
    figure = next(all_figures(trials, pd.DataFrame()))
    assert figure.name == "accuracy_vs_batch" and "noise scale" in figure.title
    one = trials.assign(noise_scale=trials.noise_scale.where(trials.accum_steps == 16))  # the unreliable only
    one.loc[one.index[one.accum_steps == 2][0], "noise_scale"] = 250.0
    assert "The gradient noise scale at the last epoch was 250 (one trial with k ≥ 2); 9 values left out" \
        in " ".join(summarize(one))
    assert context(one.iloc[:1]).endswith("; 1 trial") and context(one).endswith("; 81 trials")
    # Trials whose B changed during training (a batch warmup, a branch) are left out, as the figure leaves them.
    warm = trials.assign(batch_warmup="")
    changed = warm.index[warm.accum_steps.isin([2, 4])]
    warm.loc[changed, ["batch_warmup", "noise_scale"]] = ["32,64", 9000.0]
    assert "was 250 (median of 9 trials with k ≥ 2 that trained at one B throughout, range 250–250)" \
        in " ".join(summarize(warm))


def test_importance_finds_the_field_that_was_planted():
    gains = {"none": 0.0, "sqrt": 0.2, "linear": 0.1}  # the LR rule decides; b and k barely matter
    trials = synthetic(lambda rule, B, kind, seed: 0.6 + gains[rule] + 0.002 * seed)
    study = StudyRuns("s", trials, pd.DataFrame(), None, "", varied=("physical_batch", "accum_steps", "lr_rule"))
    figure = importance(study)
    assert figure is not None and figure.finding.startswith("Of the varied fields, lr_rule mattered most for val_acc")
    assert f"(from {len(trials)} finished trials; b and k ran in 9 of their 25 combinations, moving with B, so they " \
           f"count as effective_batch" in figure.finding  # b and k move with B alone: B's share is not split
    assert "physical_batch" not in figure.finding and "accum_steps" not in figure.finding
    # The same trials finished in another order (workers race) read the same shares: the forest is seeded, and
    # the bootstrap samples it draws follow the order of the rows.
    for seed in (1, 2, 3):
        shuffled = StudyRuns("s", trials.sample(frac=1, random_state=seed), pd.DataFrame(), None, "",
                             varied=study.varied)
        assert importance(shuffled).finding == figure.finding
    assert importance(StudyRuns("s", trials.head(MIN_IMPORTANCE_TRIALS - 1), pd.DataFrame(), None, "",
                                varied=("physical_batch", "lr_rule"))) is None  # too few trials to say
    assert parallel_coordinates(study) is not None


def budget_study() -> StudyRuns:
    """b = 8 .. 64 at k = 1: accuracy and memory grow with b, and the larger b reach the target sooner."""
    rows, history = [], []
    for b in (8, 16, 32, 64):
        for seed in (0, 1):
            run = f"{b}-{seed}"
            rows.append(dict(run_id=run, status="FINISHED", physical_batch=b, accum_steps=1, seed=seed, epochs=3,
                             model="m", dataset="d", device_name="cpu", peak_memory_bytes=b * MIB,
                             val_acc=0.80 + b / 1000 + seed / 1000))
            history += [dict(run_id=run, epoch=e, epoch_time_s=10.0, val_acc=(0.5 if e < 5 - b // 16 else 0.8 + b / 1000))
                        for e in (1, 2, 3, 4)]
    return StudyRuns("budget", pd.DataFrame(rows), pd.DataFrame(history), None, "", varied=("physical_batch",))


def test_pareto_fronts_answer_a_budget():
    study = budget_study()
    memory = memory_front(study)
    assert memory.finding == ("Against peak memory, the best mean of the 4 configurations was b = 64 (86.5%, at 64.0 "
                              "MiB of peak memory; picked as the highest, so biased upward); every other configuration "
                              "was resolved below it (paired by seed over 2 seeds, Benjamini-Hochberg at 5% over 3 "
                              "comparisons).")
    # The target is 95% of 86.45%: b = 64 reaches it in epoch 1, b = 32 in epoch 3, b = 8 and 16 never.
    time = time_front(study)
    assert time.finding.startswith("Against time to the target, the best mean of the 2 configurations was b = 64 "
                                   "(86.5%, at 10.0 s to reach val_acc 82.1%;")
    assert time.finding.endswith("Each time is one wall-clock measurement of one run (a configuration's: the median "
                                 "over its seeds).")
    # b = 32 within the seeds' spread of b = 64: named as a tie, and the lighter of the two.
    tied = study.trials.assign(val_acc=lambda t: t.val_acc.where(t.physical_batch != 32,
                                                                 t.seed.map({0: 0.870, 1: 0.855})))
    assert memory_front(StudyRuns("budget", tied, study.history, None, "", varied=("physical_batch",))).finding \
        .endswith("; 1 other cannot be told from it (b = 32); 2 resolved worse than it: b = 16; b = 8; paired by seed "
                  "over 2 seeds, Benjamini-Hochberg at 5% over 3 comparisons; the least peak memory among it and its "
                  "ties: b = 32 (86.2%) at 32.0 MiB of peak memory.")
    assert [len(c.get_offsets()) for c in time.figure.axes[0].collections] == [1, 1]  # b = 32 dominated, 64 on it
    points = pd.DataFrame({"cost": [1, 2, 2, 3], "value": [0.5, 0.7, 0.6, 0.7]})
    assert list(front(points, "cost", "value")) == [True, True, False, False]
    assert list(front(points, "cost", "value", maximize=False)) == [True, False, False, False]


def test_a_configuration_is_named_as_people_say_it():
    fields = ["accum_steps", "batch_warmup"]
    assert label({"accum_steps": 16, "batch_warmup": "32,32,32,32,32,32,32,32"}, fields) == \
        "k = 16, warmup B = 32 for 8 epochs"  # a critical-batch branch
    assert label({"accum_steps": 8, "batch_warmup": "32,64,128"}, fields) == "k = 8, warmup B = 32, 64, 128"
    assert label({"accum_steps": 1, "batch_warmup": ""}, fields) == "k = 1, fixed B"


def test_no_lr_rule_is_named_best_at_the_base_batch():
    # At B = base_batch = 32 the three rules are one configuration (the same lr): the best there is named
    # without a rule, from its seeds once, not thrice.
    trials = synthetic(lambda rule, B, kind, seed: 0.97 - B / 10_000 + 0.001 * seed).assign(base_batch=32)
    history = pd.DataFrame([dict(run_id=r.run_id, epoch=e, epoch_time_s=1.0, val_acc=r.val_acc)
                            for r in trials.itertuples() for e in (1, 2)])
    study = StudyRuns("s", trials, history, None, "", varied=("accum_steps", "lr_rule"),
                      objectives=(("val_acc", "maximize"),))
    for figure in (memory_front(study), time_front(study)):
        finding = figure.finding
        assert "the best mean of the 16 configurations was k = 1, every LR rule (B = base_batch) (96.8%" in finding
        assert "k = 1, linear" not in finding and "k = 1, none" not in finding and "k = 1, sqrt" not in finding
    # Three identical runs of one seed took 1.0, 1.5 and 2.0 s: their mean stands for that seed, whichever rule sorts
    # first, and the sentence says how far apart two measurements of one configuration came.
    clock = {"none": 1.0, "sqrt": 1.5, "linear": 2.0}
    timed = history.assign(epoch_time_s=history.run_id.map(dict(zip(trials.run_id, trials.lr_rule))).map(clock))
    finding = time_front(StudyRuns("s", trials, timed, None, "", varied=study.varied)).finding
    assert "every LR rule (B = base_batch) (96.8%, at 1.5 s to reach val_acc" in finding
    assert finding.endswith("identical runs (B = base_batch under each LR rule, one seed) took times up to 1.0 s apart.")


@pytest.mark.parametrize("values, labels, scale", [
    ((1.87, 1.93, 6.75), ["2", "5"], "log"),  # a textcls study's peak memory, MiB: no power of ten inside
    ((42, 96, 160), ["50", "100"], "log"),  # noise scales
    ((0.49, 0.49, 6.45), ["0.5", "1", "2", "5"], "log"),  # accum_lr's memory
    ((1.87, 1.93), None, "linear")])  # within a factor of 3: the linear axis, named by matplotlib
def test_a_log_axis_has_numbers_on_it_wherever_its_values_lie(values, labels, scale):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.scatter(range(len(values)), values)
    log_scale(ax, "y", values)
    fig.canvas.draw()
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high and t.get_text()]
    plt.close(fig)
    assert ax.get_yscale() == scale and len(shown) >= 2
    assert labels is None or shown == labels, shown


def test_table_columns_keep_one_format_and_mark_the_best():
    trials = pd.DataFrame({"effective_batch": [32] * 3 + [64] * 3, "lr": [0.05] * 3 + [0.1] * 3,
                           "seed": [0, 1, 2] * 2, "status": ["FINISHED"] * 6,
                           "bn_momentum_rule": ["default"] * 6,  # the same for every trial: no column
                           "val_acc": [0.91, 0.912, 0.905, 0.935, 0.936, 0.93],
                           "samples_per_s": [9934.2] * 3 + [12760.0] * 3,
                           "peak_memory_bytes": [3 * MIB] * 3 + [5.5 * MIB] * 3})
    study = StudyRuns("s", trials, pd.DataFrame(), None, "", varied=("effective_batch",))
    headers, rows = _display(_table(study))
    assert headers == ["best or not told apart", "effective_batch", "lr", "seed", "status", "val_acc, %", "samples/s",
                       "peak memory, MiB"]
    assert [[text for text, _ in row] for row in rows][2:4] == [
        ["", "32", "0.0500", "2", "FINISHED", "90.50", "9,934", "3.0"],
        ["★", "64", "0.1000", "0", "FINISHED", "93.50", "12,760", "5.5"]]
    assert [row[0][0] for row in rows] == [""] * 3 + ["★"] * 3  # B = 64 resolved above B = 32 in every seed


def test_the_tables_mark_names_ties_as_ties_and_nothing_with_one_seed():
    """Issue 100, defect 6: the ★ crowned one of several configurations that cannot be told apart. A difference
    of 0.1 point, not resolved over 3 seeds, marks both; one seed marks nothing (nothing can be told apart)."""
    trials = pd.DataFrame({"effective_batch": [32] * 3 + [64] * 3, "seed": [0, 1, 2] * 2, "status": ["FINISHED"] * 6,
                           "val_acc": [0.910, 0.915, 0.905, 0.912, 0.913, 0.907]})
    study = StudyRuns("s", trials, pd.DataFrame(), None, "", varied=("effective_batch",))
    assert _table(study)["best or not told apart"].tolist() == ["★"] * 6
    study.trials = trials[trials.seed == 0]
    assert "best or not told apart" not in _table(study)


def test_the_table_shows_the_studys_objectives_and_marks_their_front():
    """A study of val_loss (minimize) and a metric of the user's (maximize): both are columns, and ★ marks
    Optuna's Pareto front of them, as the run's final table does, not the best val_acc nor the best first
    objective alone. A failed trial is on no front."""
    trials = pd.DataFrame({"effective_batch": [16, 64, 64, 128], "status": ["FINISHED"] * 3 + ["FAILED"],
                           "val_acc": [0.50, 0.53, 0.52, math.nan], "val_loss": [0.72, 0.79, 0.80, math.nan],
                           "val_f1": [0.50, 0.53, 0.51, math.nan], "samples_per_s": [2000.0, 3500.0, 1700.0, 0.0]})
    study = StudyRuns("s", trials, pd.DataFrame(), None, "",
                      objectives=(("val_loss", "minimize"), ("val_f1", "maximize")))
    table = _table(study)
    assert list(table.columns) == ["front", "effective_batch", "status", "val_acc", "val_loss", "val_f1",
                                   "samples_per_s"]
    assert table["front"].tolist() == ["★", "★", "", ""]
    study.objectives = (("val_loss", "minimize"),)
    assert "best or not told apart" not in _table(study)  # one trial per configuration: nothing can be told apart


def test_a_loggers_own_epoch_metric_does_not_break_the_history(tmp_path):
    """Lightning's MLFlowLogger logs an `epoch` metric of its own into a [program] trial's run: the history is
    indexed by epoch already, and the report read it as a second `epoch` column and failed with a traceback."""
    from mlflow import MlflowClient

    from batchsweep.analysis.runs import load_studies

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("logged")
    parent = client.create_run(experiment).info.run_id
    child = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    for epoch in (1, 2):
        client.log_metric(child, "val_acc", 0.5 + epoch / 10, step=epoch)
        client.log_metric(child, "epoch", epoch - 1, step=epoch)  # the logger's, counted from 0
    [study] = load_studies(["logged"], uri)
    assert list(study.history["epoch"]) == [1, 2] and list(study.history["val_acc"]) == [0.6, 0.7]


def test_a_bootstrap_interval_is_said_from_five_seeds_and_not_from_three():
    """Issue 100: a bootstrap over 3 seeds has 10 distinct resamples; its "95% interval" was stated as one. From 5
    seeds (126) the noise scale at the target gives one; with 3 the sentence says why there is none. B_crit's
    interval is a t-interval over the seeds' own fits, from 3 seeds as from 5 (test_critical.py checks its
    coverage)."""
    from batchsweep.analysis import critical

    def said(seeds):
        rng = np.random.default_rng(0)
        points = pd.DataFrame([dict(seed=s, effective_batch=b, steps=40 * (1 + 128 / b) * rng.uniform(0.95, 1.05))
                               for s in range(seeds) for b in (32, 64, 128, 256, 512)])
        noise = pd.DataFrame([dict(run_id=f"{s}", seed=s, noise=150 + 10 * s) for s in range(seeds)])
        return critical.reading(points, noise)

    assert "95% t-interval over the 5 seeds (on log B_crit)" in said(5)
    assert "95% bootstrap interval over the seeds" in said(5)
    three = said(3)
    assert "bootstrap interval over" not in three and three.count("3 seeds give only 10 distinct resamples") == 1
    assert "95% t-interval over the 3 seeds (on log B_crit)" in three
