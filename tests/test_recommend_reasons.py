"""A reason the report gives is the true one: why no time to the target is given, why a half of a B is missing in
a seed, why a configuration has no time of its own, and over how many seeds each comparison was paired."""
import numpy as np

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
