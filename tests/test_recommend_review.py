"""The recommendation's ties, words and numbers as a review of the default report found them wanting: a
configuration the per-B lines resolve worse is no tie, a comparison that could not be made is no tie, exact ties
are ties, and each word follows the metric's direction."""
import re

import numpy as np

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import named_best, recommend, starred
from batchsweep.analysis.space import memory_front
from tests.test_recommend_edges import _study

RULES = ("physical_batch", "accum_steps", "lr_rule")


def _drop(oom_true_batch: bool = True):
    """none falls 2 points per doubling of B, sqrt 0.8, linear 0.2 (noise 0.2 points); the true batch at B = 512
    ran out of memory, and at B = 128 in seed 2."""
    rng, rows = np.random.default_rng(9), []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                B = b * k
                v = 0.96 - {"none": 0.02, "sqrt": 0.008, "linear": 0.002}[rule] * np.log2(B / 32) / 2
                v += rng.normal(0, 0.002)
                oom = oom_true_batch and ((b, k) == (512, 1) or ((b, k) == (128, 1) and seed == 2))
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=B,
                                 base_batch=32, status="FAILED" if oom else "FINISHED", reason="oom" if oom else None,
                                 val_acc=np.nan if oom else round(v, 3)))
    return _study(rows, RULES)


def test_a_configuration_resolved_below_a_tie_of_the_best_is_neither_tied_nor_starred():
    """The best is b = 32, k = 4, linear (B = 128); B = 32 cannot be told from it; none at B = 128 fell below B = 32
    in the per-B lines (2 points, kept by BH), so it is no tie of the best, though its own contrast is open."""
    study = _drop()
    named = named_best(study)
    tied = {(r.physical_batch, r.accum_steps, r.lr_rule) for r in named.tied.itertuples()}
    assert (32, 1, "every LR rule (B = base_batch)") in tied and (128, 1, "none") not in tied, tied
    assert "b = 128, k = 1, none" in named.lower
    t = study.trials
    none_128 = t.index[(t.lr_rule == "none") & (t.effective_batch == 128)]
    assert not set(none_128) & set(starred(study))
    [line] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    ties = line.split("cannot be told from it")[1].split(";  not tied")[0].split("not tied")[0]
    assert "none" not in ties and "worse than its rule's smallest B" in line and "b = 128, k = 1, none" in line, line


def test_a_configuration_sharing_no_seed_with_the_best_is_not_compared_not_tied_nor_starred():
    """B = 32 ran seeds 0-2, B = 128 seeds 3-5: no B = 128 configuration can be paired with the best, so none is a
    tie, none is starred, and none counts in the false-discovery family."""
    rng, rows = np.random.default_rng(4), []
    for seed in range(6):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 4), (128, 1)):
                if (b * k == 32) != (seed < 3):
                    continue
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED",
                                 val_acc=round((0.96 if b * k == 32 else 0.90) + rng.normal(0, 0.002), 3)))
    study = _study(rows, RULES)
    [line] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    assert "cannot be told from it" not in line and "comparisons" not in line, line
    assert "not compared with it (no seed shared): " in line and line.count("b = 128, k = 1") == 3, line
    assert set(starred(study)) == set(study.trials.index[study.trials.effective_batch == 32])


def _bn(loss: bool):
    """Per k: default 3 points below the true batch, scaled 0.4 below (inside ±1 point, resolved), matched 2
    above; as val_loss = 2 - accuracy where `loss`."""
    rng, rows = np.random.default_rng(5), []
    for seed in range(3):
        for k in (2, 4, 8):
            true = 0.95 - 0.005 * np.log2(k) + rng.normal(0, 0.001)
            runs = [(32 * k, 1, "default", true)] + [(32, k, bn, true + off + rng.normal(0, 0.001)) for bn, off in
                                                     (("default", -0.03), ("scaled", -0.004), ("matched", 0.02))]
            for b, kk, bn, v in runs:
                rows.append(dict(seed=seed, lr_rule="sqrt", bn_momentum_rule=bn, physical_batch=b, accum_steps=kk,
                                 effective_batch=32 * k, base_batch=32, status="FINISHED",
                                 **({"val_loss": round(2 - v, 3)} if loss else {"val_acc": round(v, 3)})))
        rows.append(dict(seed=seed, lr_rule="sqrt", bn_momentum_rule="default", physical_batch=32, accum_steps=1,
                         effective_batch=32, base_batch=32, status="FINISHED",
                         **({"val_loss": round(1.05, 3)} if loss else {"val_acc": 0.95})))
    return _study(rows, ("accum_steps", "bn_momentum_rule"), ("val_loss", "minimize") if loss else
                  ("val_acc", "maximize"))


def test_a_bn_rule_resolved_better_than_the_true_batch_is_named_and_one_resolved_worse_inside_the_margin_is_so_said():
    lines = [s for s in recommend(_bn(False)) if s.startswith("BN momentum at k = 2")]
    assert len(lines) == 1 and "no rule shown" not in lines[0], lines
    assert "final accuracy: matched resolved better than it (matched 2.0 points above" in lines[0], lines
    assert "scaled within ±1 point of it but resolved worse (scaled 0." in lines[0], lines
    [loss] = [s for s in recommend(_bn(True)) if s.startswith("BN momentum at k = 2")]
    assert re.search(r"final val_loss: matched resolved better than it \(matched val_loss 0\.0\d+ below", loss), loss


def test_an_exact_tie_of_means_is_said_as_a_tie_not_crowned_by_float_rounding():
    """B = 32 and b = 64, none end at 0.965/0.972/0.977 and 0.966/0.973/0.975: both sum to 2.914, which float
    addition makes 2.914 and 2.9139999999999997. At B = 128 sqrt and linear end alike in every seed."""
    vals = {(32, 1): (0.965, 0.972, 0.977), (64, 1): (0.966, 0.973, 0.975), (128, 1): (0.95, 0.955, 0.951)}
    rows = []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for (b, k), v in vals.items():
                drop = {"none": 0.0 if b < 128 else 0.03, "sqrt": 0.01, "linear": 0.01}[rule] if b > 32 else 0.0
                drop = 0.0 if (b, rule) == (64, "none") else drop
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=round(v[seed] - drop, 3),
                                 peak_memory_bytes=b * 20000.0))
    study = _study(rows, RULES)
    finding = memory_front(study).finding
    assert ("tied for the highest mean with b = 64, none, and named for the least peak memory of them; both picked "
            "as the highest, so biased upward") in finding, finding
    lines = recommend(study)
    [best] = [s for s in lines if s.startswith("The best accuracy")]
    assert "tied for the highest mean with b = 64, none" in best, best
    [at_128] = [s for s in lines if s.startswith("At B = 128")]
    assert "was tied for the highest mean with " in at_128 and "had the highest mean" not in at_128, at_128


def test_a_metric_where_lower_is_better_reads_better_and_worse_not_above_and_below():
    """val_loss rises with B under every rule: the B line's 'or better than the smallest B's' and the best line's
    ties resolved 'worse' (a loss above the smallest B's is worse, not 'resolved below it')."""
    rng, rows = np.random.default_rng(1), []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                v = 0.30 + {"none": 0.05, "sqrt": 0.02, "linear": 0.005}[rule] * np.log2(b * k / 32) / 2
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_loss=v + rng.normal(0, 0.003)))
    lines = recommend(_study(rows, RULES, ("val_loss", "minimize")))
    said = " ".join(s for s in lines if s.startswith(("The best", "No B")))
    assert "or better than the smallest B's" in said and "above the smallest B's" not in said, said
    assert "resolved below" not in said and "resolved worse than it" in said, said


def _perplexity():
    """none's perplexity rises 3 per doubling of B, linear's 0.5; accumulating to B = 256 adds 4; the true batch
    at B = 64 logged no peak memory."""
    rng, rows = np.random.default_rng(8), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for b, k in ((16, 1), (16, 4), (64, 1), (16, 16), (256, 1)):
                v = 30 + {"none": 3, "linear": 0.5}[rule] * np.log2(b * k / 16) + 4 * ((b, k) == (16, 16))
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=16, status="FINISHED", perplexity=v + rng.normal(0, 0.2),
                                 peak_memory_bytes=np.nan if b == 64 else b * 20000.0))
    return _study(rows, RULES, ("perplexity", "minimize"))


def test_twins_resolved_apart_name_the_better_of_the_two():
    """perplexity (lower is better): accumulating to B = 256 at b = 16 ends 4 higher than the true batch under both
    rules; the B line names the true batch as the better, not 'the better one'."""
    [at_256] = [s for s in recommend(_perplexity()) if s.startswith("At B = 256")]
    assert "they differ: the true batch was resolved better; use the true batch where it fits your memory" in at_256
    assert "the better one" not in at_256, at_256


def test_an_interval_shows_the_decimals_its_half_width_needs_and_unlogged_memory_is_said_unmeasured():
    """none's perplexity at B = 256 is 14 above B = 16 ± 0.2: its ends read apart (it read '+14 to +14'); an end
    near 0 reads in the decimals both ends share (not '-2.5 to -0.0079'); a mean that rounds to 0 reads '0.0',
    not '-0.0'; the true batch at B = 64 logged no peak memory (not 'nan MiB')."""
    study = _perplexity()
    said = " ".join(recommend(study) + summarize(study.trials, study.history, None, study.objectives[0]))
    ends = re.findall(r"95% CI ([-+][\d.,]+) to ([-+][\d.,]+)", said)
    assert ends and all(lo != hi for lo, hi in ends), ends
    assert all(len(lo.split(".")[-1]) == len(hi.split(".")[-1]) for lo, hi in ends), ends
    assert "+13.9" in said or "+14.0" in said or "+14.1" in said, said
    assert "nan MiB" not in said and "(b = 64, k = 1, memory not measured)" in said, said
    assert not re.search(r"-0\.0+ ±", said)
    d12 = " ".join(recommend(_drop()))
    assert not re.search(r"to -0\.00\d", d12), d12


def test_identical_runs_with_equal_times_do_not_make_a_hundredth_of_a_second_a_resolved_lead():
    """B = 32 under each rule (bitwise copies) logged the same time; b = 64 none is 0.01 s ahead of b = 32, k = 2:
    no single measurement resolves that, so no configuration is the fastest."""
    import pandas as pd

    seconds = {(32, 1): 10.0, (32, 2): 9.01, (64, 1): 9.0, (32, 4): 30.0, (128, 1): 9.02}
    rows, history = [], []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for (b, k), sec in seconds.items():
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=0.95, run_id=f"r{len(rows)}"))
                sec += {"none": 0.0, "sqrt": 0.01, "linear": 0.02}[rule] * (b * k > 32)
                history += [dict(run_id=rows[-1]["run_id"], epoch=e, val_acc=0.95 * e / 2, epoch_time_s=sec / 2)
                            for e in (1, 2)]
    study = _study(rows, RULES)
    study.history = pd.DataFrame(history)
    [line] = [s for s in recommend(study) if "fastest" in s or "shortest" in s]
    assert line.startswith("No configuration was resolved fastest"), line
    assert "5% of the shortest time: single wall-clock measurements cannot resolve less" in line, line


def test_a_true_batch_out_of_memory_is_said_at_its_b_and_a_mixed_per_seed_average_too():
    """The true batch at B = 512 ran out of memory in every seed, at B = 128 in seed 2 only."""
    lines = recommend(_drop())
    [at_128] = [s for s in lines if s.startswith("At B = 128")]
    [at_512] = [s for s in lines if s.startswith("At B = 512")]
    assert at_512.endswith("the true batch (b = 512, k = 1) ran out of memory here in every seed: accumulation is "
                           "how B is reached."), at_512
    assert ("the true batch (b = 128, k = 1) ran out of memory in seed 2, so that seed's value at B is the "
            "accumulated half alone, the other seeds' the mean of both halves") in at_128, at_128
    assert "ran out of memory" not in " ".join(recommend(_drop(oom_true_batch=False)))


def test_rules_that_reach_the_same_largest_free_b_are_each_named():
    """sqrt and linear are each shown to cost less than 1 point up to B = 128 (none is pruned at B = 512 in two
    seeds): the line named sqrt alone, the first rule met, while the B = 128 line resolves sqrt worse than
    linear; both are named now."""
    rng, rows = np.random.default_rng(2), []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                v = 0.96 - {"none": 0.02, "sqrt": 0.01, "linear": 0.005}[rule] * np.log2(b * k / 32) / 4 \
                    + rng.normal(0, 0.002)
                pruned = rule == "none" and (b, k) == (512, 1) and seed > 0
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="PRUNED" if pruned else "FINISHED",
                                 reason="pruned" if pruned else None, val_acc=np.nan if pruned else round(v, 3)))
    [line] = [s for s in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
              if s.startswith("The largest B shown")]
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 128 under the "), line
    assert "under the sqrt LR rule" in line and "under the linear LR rule" in line, line


def test_every_bn_rule_at_a_k_is_placed_with_its_interval_not_only_those_that_match_or_do_better():
    """At k = 4: scaled matches the true batch, default is 3 points below in every seed (resolved worse), and
    matched spreads from 1.5 points below to 1 above (neither shown to match within ±1 point nor resolved): the
    line named scaled alone; each rule is placed now."""
    rows = []
    for seed, base in enumerate((0.950, 0.955, 0.948)):
        for b, k, bn, off in ((128, 1, "default", 0.0), (32, 4, "default", -0.03), (32, 4, "scaled", -0.001 * seed),
                              (32, 4, "matched", (0.01, -0.015, 0.004)[seed])):
            rows.append(dict(seed=seed, lr_rule="sqrt", bn_momentum_rule=bn, physical_batch=b, accum_steps=k,
                             effective_batch=b * k, base_batch=32, status="FINISHED", val_acc=round(base + off, 3)))
    [line] = [s for s in recommend(_study(rows, ("accum_steps", "bn_momentum_rule"))) if s.startswith("BN momentum")]
    assert "scaled shown to match it (scaled equivalent within ±1 point" in line, line
    assert "; default resolved worse than it (default 3.0 points below, 95% CI " in line, line
    assert re.search(r"; matched neither shown to match it within ±1 point nor resolved from it \(matched not "
                     r"resolved with 3 seeds \([-+]?\d\.\d ± \d\.\d points", line), line


def test_a_steps_ratio_the_evaluations_cannot_resolve_is_not_quoted_as_a_measurement_first():
    """Every run reached the target at its first epoch's end up to B = 64 and its second above: the median steps
    per doubling read '0.50, 1.00, 0.48, 0.47' before '(not resolved ...: B = 128: 0.50 to ∞)'. At the third
    epoch up to B = 128, the last doubling 'still took the steps to 0.47', whose range is 0.31 to 0.70."""
    from tests.test_analysis import flat, reaching, synthetic

    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"]).assign(lr_rule="sqrt")
    [early] = [s for s in summarize(trials, reaching(trials, lambda r: 1 if r.effective_batch <= 64 else 2))
               if s.startswith("Over every run")]
    assert "1.00" not in early and "took the median steps to 0." not in early, early
    assert ("each doubling of B took the median steps to this share of the B before's: not resolved at B = 64 (0.00 "
            "to ∞); not resolved at B = 128 (0.50 to ∞); ") in early, early
    [late] = [s for s in summarize(trials, reaching(trials, lambda r: 6 if r.effective_batch <= 64 else 3))
              if s.startswith("Over every run")]
    assert "0.50 at B = 64; 0.25 at B = 128; not resolved at B = 256 (0.32 to 0.73)" in late, late
    assert ("the last doubling's share of the steps of the B before is not resolved (0.31 to 0.70; 0.50 is perfect "
            "scaling, 1 none)") in late and "0.47" not in late, late


def _default_like(memory_at_32: float = 32 * 20000.0, memory: bool = True):
    """The default study's shape (B = 32, and b = 32 accumulated against the true batch at B = 64 to 512, under
    three rules: 25 configurations): b = 64, none ties B = 32's mean exactly; none at B = 512 falls 15 points in
    every seed (resolved directly, both halves); sqrt's two halves at B = 512 swing ±1.5 points with the seed but
    average 3 below (resolved by the per-B line only); at B = 128 sqrt and linear tie exactly."""
    special = {(64, 1, "none"): (0.971, 0.970, 0.972),
               (512, 1, "none"): (0.820, 0.822, 0.821), (32, 16, "none"): (0.821, 0.823, 0.822),
               (32, 16, "sqrt"): (0.93, 0.96, 0.94), (512, 1, "sqrt"): (0.95, 0.92, 0.94),
               (32, 16, "linear"): (0.96, 0.97, 0.95), (512, 1, "linear"): (0.975, 0.95, 0.96),
               (32, 4, "sqrt"): (0.968, 0.966, 0.973), (32, 4, "linear"): (0.966, 0.973, 0.968),
               (128, 1, "sqrt"): (0.966, 0.972, 0.970), (128, 1, "linear"): (0.972, 0.966, 0.970)}
    rng, rows = np.random.default_rng(3), []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 2), (64, 1), (32, 4), (128, 1), (32, 8), (256, 1), (32, 16), (512, 1)):
                v = special.get((b, k, rule))
                v = v[seed] if v else (0.970, 0.972, 0.971)[seed] - (
                    0 if b * k == 32 else round(abs(rng.normal(0.004, 0.003)) + 0.001, 3))
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=round(v, 3),
                                 **({"peak_memory_bytes": memory_at_32 if b * k == 32 else b * 20000.0}
                                    if memory else {})))
    return _study(rows, RULES)


def _counts(line: str) -> dict[str, int]:
    return {what: int(n) for n, what in re.findall(r"; (\d+) (others? cannot be told|set apart|resolved worse)", line)}


def test_the_best_lines_count_every_other_configuration_once_where_it_went_and_the_counts_add_up():
    """The best line said '15 others cannot be told from it' and 'set apart, ...: <6>' beside a family of 24, and
    left out the 2 configurations resolved worse than the best directly; the memory line counted 22 as 'cannot
    be told from it', 6 of which the per-B lines resolve worse. Each names the exact tie once."""
    study = _default_like()
    [best] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    memory = memory_front(study).finding
    for line in (best, memory):
        assert "tied for the highest mean with b = 64, k = 1, none, and named for the least peak memory" in line, line
        assert line.count("b = 64, k = 1, none") == 1, line
        assert _counts(line) == {"others cannot be told": 15, "set apart": 6, "resolved worse": 2}, line
        assert 1 + 15 + 6 + 2 == 24 and "Benjamini-Hochberg at 5% over 24 comparisons" in line, line
        assert "; 2 resolved worse than it: b = 32, k = 16, none; b = 512, k = 1, none; " in line, line
    assert "may resolve" not in memory, memory


def test_an_exact_tie_of_the_best_mean_says_how_the_one_named_first_was_picked():
    """B = 32 measured more peak memory than b = 64, none, whose mean ties it: b = 64, none is named, for its
    least peak memory, in the best line and the memory line alike ('picked as the highest' said of a tie whose
    order settled it); without memory, the order of the fields settles it, and the line says so."""
    study = _default_like(memory_at_32=5e6)
    [best] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    assert best.startswith("The best accuracy: b = 64, k = 1, none (97.1% over 3 seeds, tied for the highest mean "
                           "with b = 32, k = 1, every LR rule (B = base_batch), and named for the least peak memory of "
                           "them; both the highest of 25 configurations, so biased upward by the pick); "), best
    assert ("was b = 64, k = 1, none (97.1%, at 1.2 MiB of peak memory; tied for the highest mean with b = 32, k = 1, "
            "every LR rule (B = base_batch), and named for the least peak memory of them; both picked as the highest, "
            "so biased upward)") in memory_front(study).finding
    [plain] = [s for s in recommend(_default_like(memory=False)) if s.startswith("The best accuracy")]
    assert ("The best accuracy: b = 32, k = 1, every LR rule (B = base_batch) (97.1% over 3 seeds, tied for the "
            "highest mean with b = 64, k = 1, none, and named first in the order of b, then k, then lr_rule; both the "
            "highest of 25 configurations") in plain, plain


def test_a_rule_tied_exactly_with_the_pick_at_a_b_is_named_once():
    """At B = 128 sqrt and linear tie exactly: 'it was tied for the highest mean with linear; linear and none
    cannot be told from it' named linear twice."""
    [at_128] = [s for s in recommend(_default_like()) if s.startswith("At B = 128")]
    assert "(96.9%; it was tied for the highest mean with linear; none cannot be told from it)" in at_128, at_128
