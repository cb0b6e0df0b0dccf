"""What a sentence says it would take, and what it says at all, only as far as the study settles it: the seeds
that would show equivalence where the difference seen lies inside the margin, a margin set by the reference
alone, a half that never ran said, a model without BatchNorm, one seed, and a metric that never moved."""
import math

from scipy import stats

from batchsweep.analysis.measures import ACCURACY
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.runs import Difference
from batchsweep.analysis.verdicts import judge
from batchsweep.analysis.wording import stated
from tests.test_recommend_edges import _study

RULES = ("physical_batch", "accum_steps", "lr_rule")


def _seeds_inside(mean: float, sd: float, margin: float) -> int:
    n = 2
    while abs(mean) + stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return n


def test_a_difference_inside_the_margin_gives_the_seeds_that_would_show_equivalence_not_those_that_resolve_it():
    """0.05 ± 1.7 points over 3 seeds: resolving 0.05 points from 0 takes thousands of seeds, showing it within
    ±1 point about 5; the sentence gives the second and says which."""
    d = Difference(0.0005, 0.017, 3)
    said = stated(d, m=ACCURACY)
    n = _seeds_inside(d.mean, d.sd, ACCURACY.margin)
    assert f"about {n} seeds would show equivalence within ±1 point at this spread" in said, said
    assert n == 5 and "resolve" not in said.split(";")[-1], said


def test_a_difference_beyond_the_margin_gives_the_seeds_that_would_resolve_it_from_0():
    d = Difference(-0.04, 0.05, 3)
    [v] = judge([d], ACCURACY.margin)
    assert not v.shows_equivalence
    assert "seeds would resolve a difference this size from 0 at this spread" in stated(d, m=ACCURACY, v=v)


def _grid(value, seeds=(0, 1, 2), rules=("none", "sqrt", "linear"), made=((32, 1), (32, 2), (64, 1), (32, 4),
                                                                          (128, 1)), **extra):
    """Three LR rules over B = 32 to 128, twins at 64 and 128; value(rule, b, k, seed) is the accuracy."""
    import numpy as np

    rows = []
    for seed in seeds:
        for rule in rules:
            for b, k in made:
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", reason=None, run_id=f"r{len(rows)}",
                                 val_acc=round(float(value(rule, b, k, seed)), 3), peak_memory_bytes=1000.0 * b,
                                 **extra))
    return np.random.default_rng(0), rows


def test_a_metric_that_never_moved_is_one_sentence_with_no_comparison_of_zero_width():
    from batchsweep.analysis.findings import summarize

    _, rows = _grid(lambda *_: 0.97)
    study = _study(rows, RULES)
    said = summarize(study.trials, study.history)
    assert said[0].startswith("Every finished trial ended at the same accuracy (97.0%)"), said
    assert not any("± 0.0" in s or "equivalent within" in s or "LR rule against" in s for s in said), said


def test_one_seed_at_the_largest_b_says_one_seed_cannot_tell_the_rules_apart_not_that_seeds_differ():
    from batchsweep.analysis.findings import summarize

    rng, rows = _grid(lambda rule, b, k, seed: 0.95 - 0.01 * math.log2(b * k / 32) * (rule == "none"), seeds=(0,))
    study = _study(rows, RULES)
    [line] = [s for s in summarize(study.trials, study.history) if s.startswith("At the largest batch")]
    assert line == ("At the largest batch, B = 128, no LR rule is picked: every rule finished in the same one seed "
                    "there, and one seed cannot tell them apart."), line


def test_a_b_where_only_the_true_batch_ran_says_accumulation_was_not_measured_there():
    """Twins at B = 64; at B = 128 only b = 128, k = 1 ran: the findings named the twin verdicts at 64 and said
    nothing of 128, and the block's line at 128 read as if accumulation had been weighed there."""
    from batchsweep.analysis.findings import summarize

    rng, rows = _grid(lambda rule, b, k, seed: 0.95 - 0.01 * math.log2(b * k / 32) * (rule == "none")
                      + 0.002 * seed, made=((32, 1), (32, 2), (64, 1), (128, 1)))
    study = _study(rows, RULES)
    said = "only the true batch (b = 128, k = 1) ran, so accumulation was not measured"
    twins = next(s for s in summarize(study.trials, study.history) if s.startswith("Accumulation and its"))
    assert f"At B = 128 {said}." in twins, twins
    at_128 = next(s for s in recommend(study) if s.startswith("At B = 128"))
    assert at_128.endswith(f"; {said}.") and "accumulating" not in at_128, at_128


def test_a_study_with_no_twins_says_nothing_of_a_half_not_measured():
    from batchsweep.analysis.findings import summarize

    rng, rows = _grid(lambda rule, b, k, seed: 0.95 - 0.01 * math.log2(b * k / 32) * (rule == "none")
                      + 0.002 * seed, made=((32, 1), (32, 2), (32, 4)))
    study = _study(rows, RULES)
    assert not any("was not measured" in s for s in [*summarize(study.trials, study.history), *recommend(study)])


def test_the_margin_of_a_metric_of_its_own_is_set_by_the_reference_and_not_moved_by_a_bad_b():
    """val_loss rises 0.004 per doubling (seeds 0.01 apart): B = 64 to 256 were not equivalent to B = 32 within the
    margin. Adding B = 1024, where training went badly (loss 1.5), widened δ (a tenth of the spread over every
    trial) from 0.02 to 0.14, and the same comparisons read 'equivalent'. δ is read from B = 32's seeds alone."""
    from batchsweep.analysis.findings import summarize
    from batchsweep.analysis.measures import measure

    def rows(bad: bool):
        rng, out = _grid(lambda *_: 0.9, made=((32, 1), (32, 2), (32, 4), (32, 8), *(((32, 32),) if bad else ())))
        for r in out:
            k = r["accum_steps"]
            wobble = 0.001 * ((r["seed"] * 7 + k + len(r["lr_rule"])) % 3 - 1) * (k > 1)  # (B = 32: one run)
            r["val_loss"] = 0.1 + 0.01 * r["seed"] + 0.004 * math.log2(k) + wobble + 1.4 * (k == 32)
        return _study(out, RULES, ("val_loss", "minimize"))

    plain, bad = rows(False), rows(True)
    margins = [measure(s.trials, s.objectives[0]).margin for s in (plain, bad)]
    assert margins[0] == margins[1], margins
    ref = plain.trials[plain.trials["accum_steps"] == 1]["val_loss"].mean()
    assert math.isclose(margins[0], 0.01 * ref, rel_tol=1e-9), margins
    said = [s for s in summarize(bad.trials, bad.history, None, bad.objectives[0]) if "LR rule against" in s]
    assert said and not any("equivalent within" in s and "at B = 256" in s.split("equivalent within")[1].split(";")[0]
                            for s in said), said


def test_a_model_without_batchnorm_has_one_configuration_for_its_bn_momentum_rules_and_says_so():
    """norm = none: the BN momentum rules set a momentum no layer uses, and each seed's runs under them are
    identical. They were ranked against the true batch per k, and counted as 3 configurations in the best's
    family."""
    from batchsweep.analysis.findings import summarize

    def acc(b, k, seed):
        return 0.95 - 0.004 * math.log2(b * k / 32) + 0.002 * ((seed * 5 + k) % 3)

    rows = []
    for bn in ("default", "scaled", "matched"):
        _, some = _grid(lambda rule, b, k, seed: acc(b, k, seed), rules=("none",), norm="none", bn_momentum_rule=bn)
        rows += some
    rows = [{**r, "wall_time_s": 10.0 + i} for i, r in enumerate(rows)]  # (a result of each run's own)
    study = _study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule"))
    lines = recommend(study)
    said = ("The model has no BatchNorm (norm = none): the BN momentum rules default, scaled and matched set a "
            "momentum no layer uses, so they count as one configuration (the runs under default); no BN momentum rule "
            "is ranked.")
    assert lines[0] == said, lines
    assert not any("BN momentum at k" in s or "BN scaled" in s or "BN matched" in s for s in lines), lines
    [best] = [s for s in lines if s.startswith("The best")]
    assert "of 5 configurations" in best or "over 4 comparisons" in best, best
    found = summarize(study.trials, study.history, None, None, study.varied)
    assert found[0] == said and not any(s.startswith("Final accuracy at k") for s in found), found
    # A run that diverged ran under its settings too: the rules stay crossed (it read 'did not each run under
    # every value of the other fields').
    last = {key: rows[-1][key] for key in ("physical_batch", "accum_steps", "bn_momentum_rule")}
    rows = [{**r, "status": "FAILED", "reason": "diverged", "val_acc": math.nan}
            if all(r[key] == v for key, v in last.items()) else r for r in rows]  # (every seed's)
    assert recommend(_study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule")))[0] == said


def _loss_rows(loss, seeds=(0, 1, 2)):
    """The twin grid of _grid() with val_loss = loss(rule, b, k, seed)."""
    _, rows = _grid(lambda *_: 0.9, seeds=seeds)
    for r in rows:
        r["val_loss"] = loss(r["lr_rule"], r["physical_batch"], r["accum_steps"], r["seed"])
    return _study(rows, RULES, ("val_loss", "minimize"))


def test_one_bad_seed_at_the_reference_does_not_widen_the_margin_until_every_b_reads_equivalent():
    """Accumulation's loss is 0.01 above its twin's in every seed (0.1 and 0.11), and seed 2 at B = 32 ended 0.12
    worse. δ as twice B = 32's seed sd was 0.14: every twin pair read 'equivalent' and every B advised any b. δ
    is 1% of B = 32's mean (0.14), and the sentence says so."""
    from batchsweep.analysis.findings import summarize
    from batchsweep.analysis.measures import measure

    study = _loss_rows(lambda rule, b, k, seed: 0.1 + 0.001 * seed + 0.01 * (k > 1) + 0.12 * (b * k == 32 and seed == 2))
    ref = study.trials[study.trials["effective_batch"] == 32]["val_loss"].mean()
    m = measure(study.trials, study.objectives[0])
    assert math.isclose(m.margin, 0.01 * ref, rel_tol=1e-9), (m.margin, ref)
    lines = recommend(study)
    assert not any("b: the largest that fits your memory" in s for s in lines), lines
    assert lines[-1] == (f"In these lines ±{0.01 * ref:.2g} in val_loss is the equivalence margin δ: 1% of B = 32's "
                         f"mean {ref:.2g} (the smallest B, its configurations over 3 seeds), a share of the metric's "
                         f"level as accuracy's 1 point is; not the seeds' spread, which one bad seed can widen until "
                         f"every B reads equivalent."), lines[-1]
    [twins] = [s for s in summarize(study.trials, study.history, None, study.objectives[0]) if "true-batch twin" in s]
    assert "equivalent within ±0.0014 in val_loss in 0;" in twins, twins


def test_a_reference_whose_seeds_agree_exactly_gets_1_percent_of_its_mean_not_the_recording_step():
    """Every seed at B = 32 ended at 0.2: δ was the recording step / sqrt(6), '±4.1e-08 in val_loss'."""
    from batchsweep.analysis.measures import measure

    study = _loss_rows(lambda rule, b, k, seed: 0.2 if b * k == 32 else 0.2 + 0.001 * seed + 0.0001 * k)
    assert math.isclose(measure(study.trials, study.objectives[0]).margin, 0.002, rel_tol=1e-9)


def test_a_reference_of_one_seed_or_of_mean_0_sets_no_margin_and_no_line_reads_a_margin_of_0():
    """One seed at B = 32, or a loss whose mean there is 0: no δ, and nothing is 'equivalent within ±0' or
    'shown to cost less than 0'; the lines say no margin is set."""
    from batchsweep.analysis.findings import summarize

    one = _loss_rows(lambda rule, b, k, seed: 0.1 + 0.001 * seed + 0.002 * k)
    one = type(one)(**{**one.__dict__, "trials": one.trials[(one.trials["effective_batch"] > 32)
                                                            | (one.trials["seed"] == 0)]})
    zero = _loss_rows(lambda rule, b, k, seed: (seed - 1) * 0.01 if b * k == 32 else 0.01 * seed + 0.002 * k)
    for study, why in ((one, "ran fewer than 2 seeds"), (zero, "is 0, and 1% of it is none")):
        said = [*recommend(study), *summarize(study.trials, study.history, None, study.objectives[0])]
        assert not any("±0 in" in s or "than 0 in" in s for s in said), said
        assert any("no equivalence margin δ is set for val_loss" in s and why in s for s in said), said
    assert any("shown to do better than the smallest B (no equivalence margin δ is set)" in s
               for s in recommend(one)), recommend(one)


def test_an_interval_inside_the_margin_that_excludes_0_says_both_never_equivalent_alone():
    """+0.5 points, 95% CI +0.1 to +0.9, in a family where Benjamini-Hochberg does not keep it: it lies within
    ±1 point, and it excludes 0; it read 'equivalent within ±1 point (+0.5 ± 0.4 points)'."""
    from batchsweep.analysis.runs import Difference

    diffs = [Difference(0.005, 0.004, 3), *[Difference(0.0, 0.02, 3)] * 5]
    v = judge(diffs, ACCURACY.margin)[0]
    assert v.equivalent and v.d.separated and not v.resolved
    said = stated(v.d, m=ACCURACY, v=v)
    assert said.startswith("0.5 points higher, 95% CI +0.1 to +0.9 over 3 seeds; its own interval excludes 0, but it "
                           "is not kept by Benjamini-Hochberg") and said.endswith(
        ", inside the ±1 point equivalence margin"), said


def test_a_model_without_batchnorm_whose_bn_momentum_rule_moves_with_the_lr_rule_keeps_every_run():
    """norm = none, the BN momentum rule zipped with the LR rule (default with none, scaled with sqrt, matched with
    linear): keeping the runs under default alone dropped the sqrt and linear runs, and the line said they 'count
    as one configuration'. Every run is kept; the line says the differences come from the LR rule."""
    from batchsweep.analysis.findings import summarize

    zipped = {"none": "default", "sqrt": "scaled", "linear": "matched"}
    _, rows = _grid(lambda rule, b, k, seed: 0.95 - 0.004 * math.log2(b * k / 32) * (rule != "sqrt") + 0.002 * seed,
                    norm="none")
    for r in rows:
        r["bn_momentum_rule"] = zipped[r["lr_rule"]]
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule", "bn_momentum_rule"))
    said = ("The model has no BatchNorm (norm = none): the BN momentum rule has no BatchNorm layer to act on, so "
            "differences between its rules default, scaled and matched come from the field it moves with, the LR rule "
            "(default ran with none, scaled ran with sqrt and matched ran with linear); every run is kept, and no BN "
            "momentum rule is ranked.")
    lines, found = recommend(study), summarize(study.trials, study.history, None, None, study.varied)
    assert lines[0] == said and found[0] == said, (lines[0], found[0])
    for rule in ("none", "sqrt", "linear"):
        assert any(s.startswith(f"The {rule} LR rule against B = 32") for s in found), found
    # (each LR rule ran under one BN rule, and the BN rules of a model without BatchNorm are not ranked)
    assert not any("BN momentum rules default" in s or "BN momentum at k" in s for s in lines), lines
    assert not any(s.startswith("Final accuracy at k") for s in found), found


def test_the_per_b_lines_say_they_average_over_a_field_only_where_it_took_several_values_under_one_lr_rule():
    """BatchNorm, the BN momentum rule zipped with the LR rule: each LR rule at a B ran under one BN rule, and the
    per-B lines said '(over the BN momentum rules default, scaled and matched, each seed's runs averaged)'."""
    zipped = {"none": "default", "sqrt": "scaled", "linear": "matched"}
    _, rows = _grid(lambda rule, b, k, seed: 0.95 - 0.004 * math.log2(b * k / 32) + 0.002 * seed, norm="batch")
    for r in rows:
        r["bn_momentum_rule"] = zipped[r["lr_rule"]]
    lines = recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule", "bn_momentum_rule")))
    at_128 = next(s for s in lines if s.startswith("At B = 128"))
    assert at_128.startswith("At B = 128: the "), at_128


def test_a_model_without_batchnorm_whose_bn_momentum_rule_moves_with_a_field_beside_the_lr_rule_keeps_every_run():
    """norm = none, every LR rule under every BN momentum rule, each BN rule zipped with its own weight decay: the
    rules were checked for crossing against the LR rule and B alone, read as one configuration, and the runs under
    default kept, dropping the weight decays 0.001 and 0.01 (two thirds of the runs) unsaid."""
    from batchsweep.analysis.findings import summarize

    decay = {"default": 0.0, "scaled": 0.001, "matched": 0.01}
    rows = []
    for bn, wd in decay.items():
        _, some = _grid(lambda rule, b, k, seed: 0.95 - 0.004 * math.log2(b * k / 32) - 2 * wd + 0.002 * seed,
                        norm="none", bn_momentum_rule=bn, weight_decay=wd)
        rows += some
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule", "bn_momentum_rule", "weight_decay"))
    said = ("The model has no BatchNorm (norm = none): the BN momentum rule has no BatchNorm layer to act on, so "
            "differences between its rules default, scaled and matched come from the field it moves with, "
            "weight_decay (default ran with 0.0, scaled ran with 0.001 and matched ran with 0.01); every run is kept, "
            "and no BN momentum rule is ranked.")
    lines = recommend(study)
    found = summarize(study.trials, study.history, None, None, study.varied)
    assert lines[0] == said and found[0] == said, (lines[0], found[0])
    at_128 = next(s for s in lines if s.startswith("At B = 128"))
    assert "weight_decay 0.0, 0.001 and 0.01, each seed's runs averaged)" in at_128, at_128
    assert not any("BN momentum at k" in s for s in lines), lines
    # Without the study's fields, settings cannot be told from results (a result may repeat a value): every run
    # kept, no crossing claimed.
    unknown = ("The model has no BatchNorm (norm = none): the BN momentum rules default, scaled and matched set a "
               "momentum no layer uses; which fields they ran with is not recorded, so every run is kept, and no BN "
               "momentum rule is ranked.")
    assert summarize(study.trials, study.history)[0] == unknown
    assert recommend(type(study)(**{**study.__dict__, "varied": ()}))[0] == unknown


def test_a_bn_rule_inside_the_margin_off_0_but_not_kept_by_benjamini_hochberg_has_its_own_group():
    """scaled 0.3 points below the true batch in every seed (95% CI -0.5 to -0.1: off 0, inside ±1 point), not kept
    by Benjamini-Hochberg beside two noisy rules: it was put with the rules neither shown to match it nor resolved,
    under 'no rule shown to match it within ±1 point or to do better'."""
    off = {"default": (0.01, -0.012, 0.003), "scaled": (-0.002, -0.003, -0.004), "matched": (-0.02, 0.015, 0.004)}
    rows = []
    for seed, base in enumerate((0.950, 0.955, 0.948)):
        rows.append(dict(physical_batch=128, accum_steps=1, bn_momentum_rule="default", val_acc=base, seed=seed))
        rows += [dict(physical_batch=32, accum_steps=4, bn_momentum_rule=bn, val_acc=round(base + o[seed], 3),
                      seed=seed) for bn, o in off.items()]
    rows = [{**r, "status": "FINISHED", "effective_batch": r["physical_batch"] * r["accum_steps"]} for r in rows]
    study = _study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule"))
    [line] = [s for s in recommend(study) if s.startswith("BN momentum at k = 4")]
    assert line.startswith("BN momentum at k = 4 (B = 128), against the true batch's final accuracy: scaled within ±1 "
                           "point of it; its interval excludes 0 but is not kept by Benjamini-Hochberg (scaled 0.3 "
                           "points below, 95% CI -0.5 to -0.1 over 3 seeds;"), line
    assert "; default and matched neither shown to match it within ±1 point nor resolved from it (" in line, line
    assert "no rule shown" not in line, line
