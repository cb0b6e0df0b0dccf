"""A reason the report gives is the true one: why no time to the target is given, why a half of a B is missing in
a seed, why a configuration has no time of its own, and over how many seeds each comparison was paired."""
import numpy as np

from batchsweep.analysis.recommend import recommend
from tests.test_recommend_resolve import _time_line, _timed


def test_fused_trials_beside_configurations_timed_alone_that_never_reached_the_target_say_so():
    """b = 32, k = 2 and b = 64 trained fused; the 4 configurations timed alone (B = 32 and b = 128 under each
    rule) never reached the target in seeds 0 and 1: the line says that of those, none reached it in most seeds,
    not that the rest are too few to compare."""
    alone = [((32, 1, rule), seed) for rule in ("none", "sqrt", "linear") for seed in (0, 1)]
    alone += [((128, 1, rule), seed) for rule in ("none", "sqrt", "linear") for seed in (0, 1)]
    [line] = _time_line(_timed(fused=((32, 2), (64, 1)), never=tuple(alone)))
    assert line.startswith("No time to the target is given: 18 of the 36 trials trained fused"), line
    assert ("of the 4 configurations timed alone, none reached val_acc 90.2% in most of their seeds" in line
            and "too few" not in line), line


def test_a_configuration_with_no_epoch_time_in_a_study_with_none_fused_is_not_said_fused():
    """Nothing trained fused; b = 32, k = 2, none logged no epoch time: it is not timed because none was logged,
    and --no-fuse, which would not time it, is not advised."""
    from batchsweep.analysis.space import time_front

    study = _timed()
    t, h = study.trials, study.history
    runs = t[(t.physical_batch == 32) & (t.accum_steps == 2) & (t.lr_rule == "none")]["run_id"]
    h.loc[h.run_id.isin(runs), "epoch_time_s"] = np.nan
    said = "1 configuration not timed, no epoch time logged for its trials: b = 32, k = 2, none"
    for line in (_time_line(study)[0], time_front(study).finding):
        assert said in line and "fused" not in line and "--no-fuse" not in line, line


def test_configurations_fused_and_with_no_epoch_time_are_each_said_as_they_are():
    """b = 64 trained fused and b = 32, k = 2, none logged no time: each is named under its own reason."""
    study = _timed(fused=((64, 1),))
    t, h = study.trials, study.history
    runs = t[(t.physical_batch == 32) & (t.accum_steps == 2) & (t.lr_rule == "none")]["run_id"]
    h.loc[h.run_id.isin(runs), "epoch_time_s"] = np.nan
    [line] = _time_line(study)
    assert ("3 configurations not timed, their trials trained fused (several at once in one process, each logging "
            "its group's time, not its own): b = 64, k = 1, linear; b = 64, k = 1, none; b = 64, k = 1, sqrt; ") \
        in line and "1 configuration not timed, no epoch time logged for its trials: b = 32, k = 2, none" in line, line


def _half_128(status):
    """_drop's study, all finished, but for the true batch at B = 128 under sqrt in seed 2: its row absent (None)
    or of `status` with no reason logged."""
    from tests.test_recommend_review import _drop

    study = _drop(oom_true_batch=False)
    t = study.trials
    t["reason"] = t["reason"].astype(object)
    at = (t.physical_batch == 128) & (t.accum_steps == 1) & (t.lr_rule == "sqrt") & (t.seed == 2)
    if status is None:
        study.trials = t[~at].reset_index(drop=True)
    else:
        t.loc[at, ["status", "val_acc"]] = [status, np.nan]
    return study


def _halves_said(study, said):
    from batchsweep.analysis.findings import summarize

    [at_128] = [s for s in recommend(study) if s.startswith("At B = 128")]
    assert said + ", so that seed's value at B is the accumulated half alone" in at_128, at_128
    [halves] = [s for s in summarize(study.trials, study.history) if s.startswith("The LR rules are compared")]
    assert said + " at B = 128, that seed counts the accumulated half alone" in halves, halves


def test_a_half_whose_run_was_never_logged_is_found_and_said():
    """The true batch at B = 128 under sqrt has no row in seed 2 (an interrupted study): that seed's value at B is
    the accumulated half alone, said as for a half that failed, not mixed in unsaid."""
    _halves_said(_half_128(None), "the true batch (b = 128, k = 1) under sqrt has no run logged in seed 2")


def test_a_half_running_or_killed_with_no_reason_is_said_in_its_state_not_as_an_error():
    for status, state in (("RUNNING", "is still marked running"), ("KILLED", "was killed")):
        study = _half_128(status)
        _halves_said(study, f"the true batch (b = 128, k = 1) under sqrt {state} in seed 2")
        assert "error" not in " ".join(recommend(study)), status


def test_the_budget_sentences_give_the_seeds_each_comparison_was_paired_over_not_the_fewest_alone():
    """b = 512, k = 1, sqrt crashed in seed 0: its comparison with the best is over 2 seeds, every other over 3;
    the memory line says 'over 2 to 3 seeds', not 'over 2 seeds' as if every comparison had 2."""
    from batchsweep.analysis.space import memory_front
    from tests.test_recommend_resolve import RULES
    from tests.test_recommend_edges import _study

    rng, rows = np.random.default_rng(1), []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 2), (64, 1), (512, 1)):
                crash = (b, rule, seed) == (512, "sqrt", 0)
                v = 0.95 - 0.01 * np.log2(b * k / 32) + rng.normal(0, 0.002)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if crash else "FINISHED",
                                 reason="error" if crash else None, val_acc=np.nan if crash else round(v, 3),
                                 peak_memory_bytes=1000.0 * b))
    finding = memory_front(_study(rows, RULES)).finding
    assert "paired by seed over 2 to 3 seeds, Benjamini-Hochberg" in finding, finding


def test_configurations_timed_alone_left_out_as_diverged_are_counted_where_too_few_remain():
    """b = 32, k = 2 and b = 64 trained fused; of the 4 configurations timed alone, the 3 at b = 128 diverged in
    seed 0: one remains, too few to compare, and the line says the 3 left out (it read 'only 1 configuration was
    timed alone')."""
    study = _timed(fused=((32, 2), (64, 1)))
    t = study.trials
    t["reason"] = None  # (a study with nothing but finished trials logs no reason column)
    at = (t.physical_batch == 128) & (t.seed == 0)
    t.loc[at, ["status", "reason", "val_acc"]] = ["FAILED", "diverged", np.nan]
    [line] = _time_line(study)
    assert "only 1 configuration was timed alone (3 more left out as diverged in a seed): too few" in line, line


def test_a_half_no_seed_ran_under_one_rule_while_the_others_ran_it_is_named():
    """The true batch at B = 128 has no row under sqrt in any seed, while none and linear ran it: every seed's sqrt
    value at B is the accumulated half alone, against the others' mean of both halves (it went unsaid: only a
    (b, k) that a rule ran in some seed was looked for)."""
    study = _half_128(None)
    t = study.trials
    study.trials = t[~((t.physical_batch == 128) & (t.accum_steps == 1) & (t.lr_rule == "sqrt"))].reset_index(drop=True)
    from batchsweep.analysis.findings import summarize

    said = "the true batch (b = 128, k = 1) under sqrt has no run logged in any seed (none and linear ran it)"
    [at_128] = [s for s in recommend(study) if s.startswith("At B = 128")]
    assert said + ", so every seed's value at B is the accumulated half alone" in at_128, at_128
    [halves] = [s for s in summarize(study.trials, study.history) if s.startswith("The LR rules are compared")]
    assert said + " at B = 128, every seed counts the accumulated half alone" in halves, halves


def test_a_half_that_finished_but_did_not_run_as_asked_is_said_with_its_mismatch():
    """The true batch at B = 128 under sqrt finished in seed 2, but its script did not accumulate as asked: it is
    left out of every comparison, so that seed's value at B is the accumulated half alone (it went unsaid)."""
    study = _half_128("FINISHED")
    t = study.trials
    at = (t.physical_batch == 128) & (t.accum_steps == 1) & (t.lr_rule == "sqrt") & (t.seed == 2)
    t["config_mismatch"] = np.where(at, "accum_steps 1 passed, 2 observed", None)
    t.loc[at, "val_acc"] = 0.9
    _halves_said(study, "the true batch (b = 128, k = 1) under sqrt did not run as it was asked to (accum_steps 1 "
                        "passed, 2 observed) in seed 2")
