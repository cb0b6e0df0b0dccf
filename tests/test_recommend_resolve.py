"""The report says only what its statistics resolve: a mean is ranked as it is printed, a slope of zero is no
fall, a reason given is the true one, and a missing half or a seed that never reached a target is said, not
mixed in."""
import math
import re

import numpy as np

from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.space import memory_front
from tests.test_recommend_edges import _study

RULES = ("physical_batch", "accum_steps", "lr_rule")


def test_the_best_is_ranked_by_its_own_seeds_mean_not_moved_by_another_configuration_missing_a_seed():
    """B = 32 averages 97.3% over its 3 seeds, b = 32, k = 2, none 97.0%, but higher in seeds 1 and 2; a crash of
    b = 512, k = 1, sqrt in seed 0 must not make the latter the best by ranking over seeds 1 and 2 alone."""
    rng, rows = np.random.default_rng(1), []
    own = {(32, 1): (0.980, 0.970, 0.970), (32, 2, "none"): (0.960, 0.975, 0.975)}
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 2), (64, 1), (512, 1)):
                v = own.get((b, k), own.get((b, k, rule)))
                v = v[seed] if v else 0.95 - 0.01 * np.log2(b * k / 32) + rng.normal(0, 0.002)
                crash = (b, rule, seed) == (512, "sqrt", 0)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if crash else "FINISHED",
                                 reason="error" if crash else None, val_acc=np.nan if crash else round(v, 3),
                                 peak_memory_bytes=1000.0 * b))
    study = _study(rows, RULES)
    [line] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    assert line.startswith("The best accuracy: b = 32, k = 1, every LR rule (B = base_batch) (97.3%"), line
    front = memory_front(study)
    assert "was b = 32, k = 1, every LR rule (B = base_batch) (97.3%" in front.finding, front.finding


def _lr_search(best_at):
    """An LR search over B = 32 to 256, 3 seeds, the best LR at B being best_at(B)."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(3):
        for b in (32, 64, 128, 256):
            for lr in (5e-4, 1.4e-3, 4e-3, 1.1e-2, 3.2e-2, 9e-2):
                rows.append(dict(seed=seed, physical_batch=32, accum_steps=b // 32, effective_batch=b, base_lr=lr,
                                 lr=lr, lr_rule="none", base_batch=32, status="FINISHED",
                                 val_acc=round(0.95 - abs(np.log(lr / best_at(b))) * 0.02 + rng.normal(0, 0.002), 3)))
    [line] = recommend(_study(rows, ("physical_batch", "accum_steps", "base_lr")))
    return line


def test_a_best_lr_at_the_grids_top_at_every_b_does_not_fall_nor_stay():
    """Every seed's best LR is the grid's top at every B: polyfit's slope of a constant (-1e-16) is no fall, and a
    best beyond the LRs tried at every B is not known to stay either."""
    line = _lr_search(lambda b: 9e-2 * b / 32)
    assert "only falls" not in line and "did not move" not in line, line
    assert "so whether the best LR moves with B is not known: widen the LR grid" in line, line


def test_a_wiggle_the_seeds_do_not_resolve_is_no_move_against_the_slope():
    """The best LR is 0.011 at every B: its geometric means wiggle (0.0111 to 0.011) inside the seeds' spread, so
    no move against the slope is read; the slope's interval spans the rounding of LRs tried 2.8 times apart (-0.59
    to 0.59, not the seeds' -0.02 to 0.02), so it holds square-root scaling as well as none."""
    line = _lr_search(lambda b: 1.1e-2)
    assert "moved against" not in line and "(the interval holds 0 and 0.5)" in line, line


def _timed(fused=(), never=(), objective=("val_acc", "maximize")):
    """Three rules at (b, k) in (32, 1), (32, 2), (64, 1), (128, 1); two epochs, each run reaching 0.95 at its
    second; `fused` configurations log only their group's time; `never` (configuration, seed) never reach it."""
    import pandas as pd

    seconds = {(32, 1): 10.0, (32, 2): 12.0, (64, 1): 6.0, (128, 1): 4.0}
    rows, history = [], []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for (b, k), sec in seconds.items():
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=0.95, val_loss=0.2, run_id=f"r{len(rows)}"))
                sec = sec + seed * 0.5 + {"none": 0.0, "sqrt": 0.3, "linear": 0.6}[rule] * (b * k > 32)
                late = ((b, k, rule), seed) in never
                clock = "group_epoch_time_s" if (b, k, rule) in fused or (b, k) in fused else "epoch_time_s"
                history += [dict(run_id=rows[-1]["run_id"], epoch=e, val_acc=(0.5 if late else 0.95) * e / 2,
                                 val_loss=0.2, **{clock: sec / 2}) for e in (1, 2)]
    study = _study(rows, RULES, objective)
    study.history = pd.DataFrame(history)
    return study


def _time_line(study):
    return [s for s in recommend(study) if s.startswith(("The shortest", "No configuration was resolved", "No time"))]


def test_a_minimized_objective_says_why_it_has_no_time_line_and_fusing_is_not_it():
    [line] = _time_line(_timed(fused=((32, 2), (64, 1)), objective=("val_loss", "minimize")))
    assert "minimizes val_loss" in line and "fused" not in line and "--no-fuse" not in line, line


def test_every_trial_fused_is_said_so_not_as_a_rest_too_few_to_compare():
    [line] = _time_line(_timed(fused=tuple((b, k) for b, k in ((32, 1), (32, 2), (64, 1), (128, 1)))))
    assert "every one of the 36 trials trained fused" in line and "the rest" not in line, line


def test_the_time_lines_name_the_configurations_not_timed_alone_and_how_to_time_them():
    """b = 128 is fastest among those timed alone; b = 32, k = 2 and b = 64 trained fused: left out, said so."""
    study = _timed(fused=((32, 2), (64, 1)))
    [line] = _time_line(study)
    assert "6 configurations not timed" in line and "b = 64, k = 1, none" in line and "--no-fuse" in line, line
    from batchsweep.analysis.space import time_front
    assert "6 configurations not timed" in time_front(study).finding


def test_a_seed_that_never_reached_the_target_counts_as_slower_in_the_median():
    """b = 128, k = 1, none took 4.0, 4.5 and 5.0 s; in seed 0 it never reached the target: its median is 5.0 s
    (the never-reached seed beyond both others), not 4.75 s (the mean of the two that reached it)."""
    from batchsweep.analysis.space import times

    points = times(_timed(never=(((128, 1, "none"), 0),)))[2]
    [seconds] = points[(points.physical_batch == 128) & (points.lr_rule == "none")]["seconds"]
    assert seconds == 5.0, seconds


def test_a_configuration_that_never_reached_the_target_in_most_seeds_is_named_not_dropped():
    """b = 128, k = 1, none never reached the target in seeds 0 and 1: its median is beyond the training, so it has
    no time to rank; the time line and the time front name it with its count, not leave it out unsaid."""
    from batchsweep.analysis.space import time_front

    study = _timed(never=(((128, 1, "none"), 0), ((128, 1, "none"), 1)))
    said = ("1 configuration has no median time, having never reached the target in at least half its timed seeds: "
            "b = 128, k = 1, none (in 2 of 3 seeds)")
    [line] = _time_line(study)
    assert said in line, line
    assert said in time_front(study).finding, time_front(study).finding


def test_a_configuration_never_timed_is_not_said_left_out_of_the_times_as_diverged():
    """b = 64, k = 1, linear trained fused and diverged in seed 2: it is among those not timed, not 'left out as
    diverged' from times it never had."""
    study = _timed(fused=((32, 2), (64, 1)))
    t = study.trials
    at = (t.physical_batch == 64) & (t.lr_rule == "linear") & (t.seed == 2)
    t["reason"] = None
    t.loc[at, ["status", "reason", "val_acc"]] = ["FAILED", "diverged", np.nan]
    [line] = _time_line(study)
    assert "left out as diverged" not in line and "b = 64, k = 1, linear" in line.split("not timed")[1], line


def test_a_b_shown_to_cost_little_above_one_that_was_not_is_named_beside_the_largest():
    """sqrt costs nothing at B = 64 and 256 but 3 points at 128: the largest B is 64, and 256 is named as shown to
    cost little above a B that was not. The headline says the run of Bs it means (every B below it too), or 'the
    largest B shown to cost less: B = 64' read as contradicting 'B = 256 ... shown to cost less' after it."""
    rng, rows = np.random.default_rng(2), []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for k in (1, 2, 4, 8):
                drop = 0.03 * np.log2(k) if rule == "none" else 0.03 * (k == 4)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status="FINISHED",
                                 val_acc=round(0.95 - drop + rng.normal(0, 0.001), 4)))
    [line] = [s for s in recommend(_study(rows, RULES)) if s.startswith("The largest B")]
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: B = 64"), \
        line
    assert "above a B of its rule that was not: B = 256 under the sqrt LR rule" in line, line


def test_a_half_that_ended_with_an_error_in_a_seed_is_said_in_the_per_b_line_and_the_findings():
    """The true batch at B = 128 under sqrt ended with an error in seed 2: that seed's value at B = 128 is the
    accumulated half alone, which both the per-B line and the findings say (for an out-of-memory only the
    recommendation did)."""
    from batchsweep.analysis.findings import summarize
    from tests.test_recommend_review import _drop

    study = _drop(oom_true_batch=False)
    t = study.trials
    t["reason"] = t["reason"].astype(object)
    at = (t.physical_batch == 128) & (t.accum_steps == 1) & (t.lr_rule == "sqrt") & (t.seed == 2)
    t.loc[at, ["status", "reason", "val_acc"]] = ["FAILED", "error", np.nan]
    said = "the true batch (b = 128, k = 1) under sqrt ended with an error in seed 2"
    [at_128] = [s for s in recommend(study) if s.startswith("At B = 128")]
    assert said + ", so that seed's value at B is the accumulated half alone" in at_128, at_128
    [halves] = [s for s in summarize(study.trials, study.history) if s.startswith("The LR rules are compared")]
    assert said + " at B = 128, that seed counts the accumulated half alone" in halves, halves


def _critical(never):
    """Steps to the target about 100 (1 + 128 / B); the runs (B, seed) in `never` never reach it; each run's noise
    scale at the target is its B."""
    import pandas as pd

    from batchsweep.analysis.findings import summarize
    from tests.test_analysis import flat, reaching, synthetic

    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"]).assign(lr_rule="sqrt")
    history = reaching(trials, lambda r: 99 if (r.effective_batch, r.seed) in never else
                       round(100 * (1 + 128 / r.effective_batch) * r.effective_batch / 4000))
    history = history.merge(trials[["run_id", "effective_batch"]], on="run_id")
    history = history.assign(noise_scale=history.pop("effective_batch").astype(float), noise_scale_reliable=1.0)
    [sentence] = [s for s in summarize(trials, pd.DataFrame(history)) if s.startswith("Over every run")]
    return sentence


def test_a_b_where_one_run_never_reached_the_target_is_left_out_of_the_fit_not_fitted_from_the_rest():
    """Seed 0 never reached the target at B = 512: the two runs there that did would enter the fit as if they were
    all, the slowest left out, so B = 512 is left out of the fit (and of the noise scale beside it) and said; the
    doublings still count it, the run that never reached it as slower than the rest."""
    sentence = _critical({(512, 0)})
    assert "from 12 runs at B = 32 to 256)" in sentence, sentence
    assert ("B = 512 left out of the fit, as some runs there never reached it (1 of 3 at B = 512)") in sentence, sentence
    assert "(a run that never reached it counted as slower than every run that did: 1 run at B = 512)" in sentence
    assert "was 96 (median of the 12 runs" in sentence, sentence


def test_the_noise_scale_beside_the_fit_is_the_fitted_runs_median_not_a_left_out_bs():
    """B = 512 reached the target in seed 2 only, so it is left out of the fit; its run's noise scale (512) is
    left out of the median beside the fit too: 96 over the 12 fitted runs, not 128 over 13."""
    sentence = _critical({(512, 0), (512, 1)})
    assert "left out of the fit" in sentence and "was 96 (median of the 12 runs" in sentence, sentence


def test_an_exact_tie_at_equal_peak_memory_is_named_by_the_order_not_for_less_memory():
    """B = 32 and b = 64, none tie the best mean and both measured 1.28 MB of peak memory: neither needs less, so
    the first is named by the order of the fields, in the best line and the memory line alike."""
    from tests.test_recommend_review import _default_like

    study = _default_like(memory_at_32=64 * 20000.0)
    [best] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    assert ("tied for the highest mean with b = 64, k = 1, none, and named first in the order of b, then k, then "
            "lr_rule; both") in best, best
    memory = memory_front(study).finding
    assert "named first in the order of b, then k, then lr_rule; both" in memory and "least peak memory" not in \
        memory.split("picked as")[0], memory


def test_the_twin_pairs_shown_equivalent_are_named_as_the_open_ones_are():
    """Accumulation matches its twin exactly at B = 128 under each rule and differs by seed noise elsewhere: the
    sentence names each equivalent pair, not only their count."""
    from batchsweep.analysis.findings import summarize

    rng, rows = np.random.default_rng(6), []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                v = 0.95 if b * k == 128 else 0.95 + rng.normal(0, 0.02)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=round(v, 3)))
    study = _study(rows, RULES)
    [twins] = [s for s in summarize(study.trials, study.history) if s.startswith("Accumulation and its")]
    assert "equivalent within ±1 point in 2 (none at B = 128; sqrt at B = 128)" in twins, twins


def test_the_rule_picked_at_a_b_is_ranked_by_its_own_seeds_mean_not_moved_by_another_rules_crash():
    """At B = 64 none averages 97.3% over its 3 seeds, sqrt 97.0% but higher in seeds 1 and 2; linear's error in
    seed 0 must not make sqrt the pick by ranking over seeds 1 and 2 alone (the line prints each rule's own mean)."""
    own = {"none": (0.980, 0.970, 0.970), "sqrt": (0.960, 0.975, 0.975), "linear": (0.950, 0.950, 0.950)}
    rows = []
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for k in (1, 2):
                crash = (k, rule, seed) == (2, "linear", 0)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status="FAILED" if crash else "FINISHED",
                                 reason="error" if crash else None,
                                 val_acc=np.nan if crash else 0.97 if k == 1 else own[rule][seed]))
    [at_64] = [s for s in recommend(_study(rows, RULES)) if s.startswith("At B = 64")]
    assert at_64.startswith("At B = 64: the none LR rule (97.3%; it had the highest mean"), at_64


def test_a_run_that_never_reached_the_target_counts_as_slowest_in_the_median_steps():
    """At B = 512 seed 0 never reached the target and seeds 1 and 2 took 112 and 140 steps: the median counts seed
    0 beyond both (140, a doubling to 0.58 of B = 256's 240), not the median of the two that reached it (126,
    0.53), which leaves the slowest run out and reads as better scaling than was measured."""
    import pandas as pd

    from batchsweep.analysis.findings import summarize
    from tests.test_analysis import flat, reaching, synthetic

    reach = {32: (10, 10, 10), 64: (12, 12, 12), 128: (14, 14, 14), 256: (14, 16, 18), 512: (99, 16, 20)}
    trials = synthetic(flat)
    trials = trials[trials.physical_batch == 32].drop_duplicates(["seed", "effective_batch"]).assign(lr_rule="sqrt")
    history = reaching(trials, lambda r: reach[r.effective_batch][r.seed])
    [sentence] = [s for s in summarize(trials, pd.DataFrame(history)) if s.startswith("Over every run")]
    assert ("each doubling of B took the median steps to 0.60, 0.58, 0.55, 0.58 of the B before (a run that never "
            "reached it counted as slower than every run that did: 1 run at B = 512)") in sentence, sentence


def test_the_lr_tuned_per_b_for_steps_to_target_counts_a_run_that_never_reached_it_as_slowest():
    """At B = 128, base_lr 0.2 reached the target in every seed (150-160 steps) and 0.4 in one seed of three (100
    steps): the median over the runs that reached it picked 0.4, and then B = 128 read 'most runs never reached
    it: left out of the fit' and B_crit 'could not be fitted'. 0.2 is the LR that reaches it, and B = 128 is fitted."""
    import pandas as pd

    from batchsweep.analysis.targets import steps

    reach = {(32, 0.1): [400, 420, 410], (32, 0.2): [300, 310, 320], (64, 0.1): [250, 260, 255],
             (64, 0.2): [180, 190, 185], (128, 0.2): [150, 160, 155], (128, 0.4): [100, None, None]}
    trials, history = [], []
    for (B, lr), per_seed in reach.items():
        for seed, at in enumerate(per_seed):
            run = f"r{len(trials)}"
            trials.append(dict(run_id=run, seed=seed, effective_batch=B, physical_batch=B, accum_steps=1,
                               base_lr=lr, val_acc=0.95 if at else 0.80, status="FINISHED", reason=None))
            history += [dict(run_id=run, steps=s, val_acc=0.96 if at and s >= at else 0.80) for s in range(50, 501, 50)]
    said = " ".join(steps(pd.DataFrame(trials), pd.DataFrame(history)))
    assert "left out of the fit" not in said and "could not be fitted" not in said, said
    assert "from 9 runs at B = 32 to 128" in said and "never did counted as slower" in said, said


def _tuned(reach: dict) -> list[str]:
    """Steps to 0.9 with base_lr searched at each B: reach[(B, base_lr)] per seed, the step a run reached it at,
    None where it never did, or ("pruned", step) where it was pruned at that step without reaching it."""
    import pandas as pd

    from batchsweep.analysis.targets import steps

    trials, history = [], []
    for (B, lr), per_seed in reach.items():
        for seed, at in enumerate(per_seed):
            run, cut = f"r{len(trials)}", at[1] if isinstance(at, tuple) else None
            trials.append(dict(run_id=run, seed=seed, effective_batch=B, physical_batch=B, accum_steps=1, base_lr=lr,
                               val_acc=math.nan if cut else 0.95 if at else 0.80,
                               status="PRUNED" if cut else "FINISHED", reason="pruned" if cut else None))
            history += [dict(run_id=run, steps=s, val_acc=0.96 if at and not cut and s >= at else 0.80)
                        for s in range(50, (cut or 500) + 1, 50)]
    return steps(pd.DataFrame(trials), pd.DataFrame(history))


SEARCHED = {(32, 0.1): [400, 420, 410], (32, 0.2): [300, 310, 320], (64, 0.1): [250, 260, 255],
            (64, 0.2): [180, 190, 185], (128, 0.2): [150, 160, 155]}


def test_a_run_pruned_before_the_target_is_slower_only_than_runs_that_reached_it_before_its_pruning():
    """At B = 128 base_lr 0.4 reached the target at 100 and 150 steps and its third seed was pruned at 100: that
    run is slower than the one at 100, but against the one at 150 where it stands is not known, so the median (100
    to 150) is not known; it read 'a run that never reached it counted as slower than every run that did: 1 run at
    B = 128', a median of 150."""
    said = " ".join(_tuned({**SEARCHED, (128, 0.4): [100, 150, ("pruned", 100)]}))
    assert "never reached it counted as slower than every run that did: 1 run at B = 128" not in said, said
    assert ("1 run pruned before it reached it left out of the median steps (1 at B = 128): where it would stand "
            "against the runs that reached it later is not known") in said, said
    assert "one pruned before it did as slower only than those that reached it before it was pruned" in said, said


def test_runs_pruned_where_they_could_turn_the_pick_of_the_lr_leave_the_ranking_and_are_said():
    """At B = 128 base_lr 0.4 reached the target at 100 steps in seed 0 and was pruned at 100 in seeds 1 and 2: had
    they reached it by 150, 0.4 was faster than 0.2 (155), so the pick turns on where they stand. They were ranked
    as never reaching it, and 0.2 picked, unsaid."""
    said = " ".join(_tuned({**SEARCHED, (128, 0.4): [100, ("pruned", 100), ("pruned", 100)]}))
    assert ("2 runs pruned before they reached it left out of the base_lr ranking (2 at B = 128): where they would "
            "stand against the runs that reached it later is not known") in said, said
