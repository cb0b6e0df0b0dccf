"""Sentences of the report that read wrong where a count or a list is: one BN rule named in the plural, a count of
trials whose total is not said, a list of Bs whose items hold 'and' themselves."""
import dataclasses

import pandas as pd
import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import VARIED, _bn_grid


def test_one_bn_rule_on_a_model_without_batchnorm_is_named_in_the_singular():
    """mlp with bn_momentum_rule = ["scaled"] read 'the BN momentum rules scaled set a momentum ...'."""
    rows = [r for r in _bn_grid("mlp", "batch", True) if r["bn_momentum_rule"] == "scaled" or r["accum_steps"] == 1]
    study = _study(rows, VARIED)
    first = summarize(study.trials, study.history, None, None, study.varied)[0]
    assert "the BN momentum rule scaled sets a momentum no layer uses" in first, first
    assert "rules scaled" not in first, first
    # (runs at k > 1 and at k = 1 are not one configuration: it read 'its runs and those at k = 1 count as one')
    assert "so its label changes nothing: its runs are compared as the default's would be; no BN" in first, first
    # Runs at k = 1 under both labels (the same configuration twice): those left out are said, not dropped unsaid.
    twice = [dict(r, bn_momentum_rule="scaled", run_id=r["run_id"] + "s") for r in rows
             if r["accum_steps"] == 1 and r["physical_batch"] == 32]
    study = _study(rows + twice, VARIED)
    first = summarize(study.trials, study.history, None, None, study.varied)[0]
    assert ("its runs are compared as the default's would be; at k = 1, where every rule sets the default momentum, "
            "a run under default counts where there is one, and the 3 under scaled that repeat one are left out; no BN "
            "momentum rule is ranked.") in first, first
    assert "one configuration" not in first, first


@pytest.mark.parametrize("seeds, said", [
    ((2,), "a run under default counts where there is one, 1 under scaled where there is none, and the 2 under scaled "
           "that repeat one are left out"),
    ((1, 2), "a run under default counts where there is one, 2 under scaled where there is none, and the 1 under "
             "scaled that repeats one is left out")])
def test_one_bn_rule_keeps_a_run_at_k_1_under_another_label_where_it_is_the_only_one(seeds, said):
    """mlp, scaled at k > 1, k = 1 under default and scaled, default's k = 1, b = 32 run missing in `seeds`: the k = 1
    runs of default alone were kept, so scaled's run there, which repeats nothing, was dropped unsaid beside 'the
    runs under default count, and the 3 under scaled repeat them'."""
    from batchsweep.analysis.findings import one_bn_rule

    rows = [r for r in _bn_grid("mlp", "batch", True) if r["bn_momentum_rule"] == "scaled" or r["accum_steps"] == 1]
    small = [r for r in rows if r["accum_steps"] == 1 and r["physical_batch"] == 32]
    rows = [r for r in rows if r not in small or r["seed"] not in seeds]
    study = _study(rows + [dict(r, bn_momentum_rule="scaled", run_id=r["run_id"] + "s") for r in small], VARIED)
    kept = one_bn_rule(study.trials, study.varied)[0]
    ones = kept[(kept["accum_steps"] == 1) & (kept["physical_batch"] == 32)]
    assert sorted(ones["seed"]) == [0, 1, 2], ones
    assert set(ones.loc[ones["seed"].isin(seeds), "bn_momentum_rule"]) == {"scaled"}, ones
    first = summarize(study.trials, study.history, None, None, study.varied)[0]
    assert f"; at k = 1, where every rule sets the default momentum, {said}; no BN momentum rule is ranked." in first, \
        first


def test_bn_rules_counted_as_one_name_a_run_at_k_1_kept_under_another_label():
    """mlp, every rule at k > 1, k = 1 under default and scaled, default's k = 1, b = 32 run missing in seed 2: it read
    '(the runs under default)', and scaled's run there was dropped unsaid."""
    rows = _bn_grid("mlp", "batch", True)
    small = [r for r in rows if r["accum_steps"] == 1 and r["physical_batch"] == 32]
    rows = [r for r in rows if r not in small or r["seed"] != 2]
    study = _study(rows + [dict(r, bn_momentum_rule="scaled", run_id=r["run_id"] + "s") for r in small], VARIED)
    first = summarize(study.trials, study.history, None, None, study.varied)[0]
    assert ("so they count as one configuration (the runs under default at k > 1; at k = 1, where every rule sets the "
            "default momentum, a run under default counts where there is one, 1 under scaled where there is none, and "
            "the 2 under scaled that repeat one are left out); no BN momentum rule is ranked.") in first, first


def test_the_fused_count_says_its_trials_are_those_of_one_bn_rule():
    """mlp, 27 trials, 15 kept as one configuration, 6 of them fused: it read 'every one of the 15 trials trained
    fused', counting the fused runs of every rule, and did not say why 15."""
    rows = _bn_grid("mlp", "batch", True)
    history = pd.DataFrame([dict(run_id=r["run_id"], epoch=1, steps=10, val_acc=r["val_acc"],
                                 group_epoch_time_s=1.0 if r["accum_steps"] > 1 else float("nan"))
                            for r in rows])
    study = dataclasses.replace(_study(rows, VARIED), history=history)
    [line] = [s for s in recommend(study) if s.startswith("No time to the target")]
    assert "6 of the 15 trials counted (the runs under one BN momentum rule" in line, line


def test_a_design_that_names_no_configuration_says_so_for_its_time_not_that_none_was_timed_alone():
    """bn_momentum (cnn1d with BatchNorm): its BN rules run at k > 1 alone, so no configuration is named; 18 of its
    27 trials trained alone, and it read 'no configurations were timed alone: too few to compare; `... --no-fuse`'
    (which would time none either)."""
    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    fused = {r["run_id"] for r in rows if r["physical_batch"] == 32 and r["bn_momentum_rule"] == "default"}
    history = pd.DataFrame([dict(run_id=r["run_id"], epoch=1, steps=10, val_acc=r["val_acc"],
                                 **({"group_epoch_time_s": 1.0} if r["run_id"] in fused else {"epoch_time_s": 1.0}))
                            for r in rows])
    study = dataclasses.replace(_study(rows, VARIED), history=history)
    [line] = [s for s in recommend(study) if s.startswith("No time to the target")]
    assert line == ("No time to the target is given: the study's varied fields were not crossed (physical_batch, "
                    "accum_steps and bn_momentum_rule did not each run against every value of the others), so no "
                    "configuration can be named apart to time."), line


@pytest.mark.parametrize("name", ["batch_warmup", "critical_batch"])
def test_a_study_of_lengths_of_training_with_epoch_times_still_says_nothing_is_a_choice(name):
    """Their arms differ in a length of training (batch_warmup, epochs), which their findings compare: with per-epoch
    times logged, as real runs log them, the block read 'no configuration is named apart to time'."""
    from tests.test_recommend import built_in
    study = built_in(name)
    study.trials["run_id"] = [f"r{i}" for i in range(len(study.trials))]
    history = pd.DataFrame([dict(run_id=r.run_id, epoch=e, steps=10 * e, epoch_time_s=1.0, val_acc=r.val_acc * e / 4)
                            for r in study.trials.itertuples() for e in range(1, 5)])
    lines = recommend(dataclasses.replace(study, history=history))
    assert lines[0].startswith("Nothing here is a choice to recommend"), lines
    assert not any("named apart to time" in line for line in lines), lines


def test_a_finished_trial_without_its_objective_does_not_make_the_fields_tied():
    """Every trial fused, and one finished at k = 16 under sqrt alone that logged no val_acc: the fields read as tied
    ('accum_steps and lr_rule did not each run against every value ...') beside a best line naming 7 configurations
    by them; the time is read from trials with a value, as the best is."""
    from tests.test_recommend_edges import _rows
    rows = _rows(lambda s, rule, b, k: 0.95 - (0.01 if b * k > 32 else 0) + 0.001 * s)
    rows = [dict(r, run_id=f"r{i}") for i, r in enumerate(rows)]
    rows.append(dict(rows[0], run_id="x", accum_steps=16, effective_batch=512, lr_rule="sqrt", val_acc=float("nan")))
    history = pd.DataFrame([dict(run_id=r["run_id"], epoch=e, steps=10 * e, group_epoch_time_s=1.0,
                                 val_acc=r["val_acc"] * e / 4) for r in rows for e in range(1, 5)])
    study = dataclasses.replace(_study(rows, ("physical_batch", "accum_steps", "lr_rule")), history=history)
    [line] = [s for s in recommend(study) if s.startswith("No time to the target")]
    assert line.startswith("No time to the target is given: every one of the 28 trials trained fused"), line


def test_the_bs_left_out_of_a_fit_are_told_apart_where_an_item_holds_and():
    """'(at B = 128, 3 of 6 runs never reached it and 1 diverged, at B = 256, 4 of 6 runs never reached it and at
    B = 512, ...)': one list whose 'and' joins both items and their parts."""
    from batchsweep.analysis.targets import steps
    from tests.test_critical import _one_diverged

    trials, history = _one_diverged(128)
    for b, seeds in ((128, (1, 2, 3)), (256, (0, 1, 2, 3))):
        never = trials.loc[(trials["effective_batch"] == b) & trials["seed"].isin(seeds), "run_id"]
        history = history.assign(val_acc=history["val_acc"].where(~history["run_id"].isin(never), 0.5))
        trials.loc[trials["run_id"].isin(never), "val_acc"] = 0.5
    line = steps(trials, history)[1]
    assert line.startswith("Over every run (at B = 128, 3 of 6 runs never reached it and 1 diverged; at B = 256, "
                           "4 of 6 runs never reached it: half or more"), line
