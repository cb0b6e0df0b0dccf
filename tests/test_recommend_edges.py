"""The recommendation's edges: a study's own objective ranks even where val_acc is logged too, rules with
different seeds are compared on the seeds they share, a pick's seeds are its own, and equivalence is worded as
what its interval shows."""
import re

import numpy as np
import pandas as pd

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.runs import StudyRuns


def _study(rows, varied, objective=("val_acc", "maximize")) -> StudyRuns:
    t = pd.DataFrame(rows)
    if "batch" not in t:
        t["batch"] = np.where(t["accum_steps"] > 1, "accumulated", "true batch")
    return StudyRuns("s", t, pd.DataFrame(), None, "", varied=varied, objectives=(objective,), run_as="--study s")


def test_an_lr_search_minimizing_val_loss_recommends_the_lr_of_the_least_val_loss_not_of_the_best_accuracy():
    """adam_lr_search's objective is val_loss; its trials log val_acc too. val_loss is least at LR 0.011 at every
    B, val_acc highest at 0.0005: the LR to use is 0.011."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(3):
        for b in (8, 16, 64, 256):
            for lr in (5e-4, 1.4e-3, 4e-3, 1.1e-2, 3.2e-2):
                rows.append(dict(seed=seed, physical_batch=b, accum_steps=1, effective_batch=b, base_lr=lr, lr=lr,
                                 lr_rule="none", base_batch=32, status="FINISHED",
                                 val_loss=2.0 + abs(np.log(lr / 1.1e-2)) * 0.1 + rng.normal(0, 0.01),
                                 val_acc=0.34 - abs(np.log(lr / 5e-4)) * 0.01 + rng.normal(0, 0.001)))
    [line] = recommend(_study(rows, ("physical_batch", "accum_steps", "base_lr"), ("val_loss", "minimize")))
    went = re.search(r"the best learning rate went from ([\d.]+) at B = 8 to ([\d.]+) at B = 256", line)
    assert went and all(0.008 < float(lr) < 0.016 for lr in went.groups()), line  # 0.011's neighbours: 4e-3, 3.2e-2


def test_a_study_minimizing_val_loss_picks_each_b_by_val_loss_where_val_acc_disagrees():
    """linear is 0.05 lower in val_loss at every B above 32 and lower in val_acc: the pick at each B is linear, in
    val_loss, and the findings compare in val_loss and say so."""
    rng, rows = np.random.default_rng(3), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for k in (1, 4, 16):
                acc = 0.97 - (0.001 if rule == "none" else 0.004) * np.log2(k)
                loss = 0.3 - (0.05 if rule == "linear" and k > 1 else 0)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status="FINISHED", val_acc=round(acc + rng.normal(0, 0.001), 3),
                                 val_loss=loss + rng.normal(0, 0.002)))
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"), ("val_loss", "minimize"))
    per_b = [line for line in recommend(study) if line.startswith("At B = ")]
    assert [line.split(" LR rule")[0] for line in per_b] == ["At B = 128: the linear", "At B = 512: the linear"]
    assert all("(val_loss 0.2" in line for line in per_b), per_b
    findings = summarize(study.trials, study.history, None, study.objectives[0])
    assert any(s.startswith("Configurations are compared in the study's objective, val_loss") for s in findings)
    assert not any("No finished trial has an accuracy" in s for s in findings)


def _unbalanced(sqrt_ahead: float) -> StudyRuns:
    """none ran 5 seeds, sqrt 3; seeds 3 and 4 are 2 points above the others, so none's own mean at B = 128 is
    lifted by seeds sqrt never ran; on the 3 seeds both ran, sqrt is `sqrt_ahead` above none at B = 128."""
    rng, rows = np.random.default_rng(2), []
    lifted = {0: 0, 1: -0.002, 2: 0.001, 3: 0.02, 4: 0.021}
    for rule, seeds in (("none", range(5)), ("sqrt", range(3))):
        for seed in seeds:
            for b, k in ((32, 1), (32, 4), (128, 1)):
                v = (0.95 + lifted[seed] - (0.01 if b * k > 32 else 0) + (sqrt_ahead if rule == "sqrt" and b * k > 32
                                                                          else 0) + rng.normal(0, 0.0007))
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FINISHED", val_acc=round(v, 3)))
    return _study(rows, ("physical_batch", "accum_steps", "lr_rule"))


def test_a_rule_resolved_above_on_the_seeds_both_ran_is_the_pick_not_resolved_below_it():
    study = _unbalanced(0.005)
    [at_128] = [line for line in recommend(study) if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: the sqrt LR rule ("), at_128
    assert re.search(r"resolved worse than it: none 0\.4 points lower", at_128)
    assert "higher" not in at_128.split("against B = 32")[0]
    findings = summarize(study.trials, study.history)
    [largest] = [s for s in findings if s.startswith("At the largest batch")]
    assert "sqrt is resolved as the best there" in largest and "none is resolved as the best" not in largest


def test_a_configuration_resolved_above_the_best_is_the_best_not_its_tie():
    """sqrt at B = 128 is 0.5 points above B = 32 on the 3 seeds both ran (resolved); B = 32's own mean over 5
    seeds is higher only by the 2 seeds sqrt never ran."""
    [best] = [line for line in recommend(_unbalanced(0.015)) if line.startswith("The best accuracy: ")]
    assert best.startswith("The best accuracy: b = 128, k = 1, sqrt (95.5% over 3 seeds, "), best
    assert "every LR rule (B = base_batch)" not in best  # resolved below the pick: no tie


def test_a_configuration_finished_in_one_seed_is_never_crowned():
    """sqrt at (b = 32, k = 16) failed in seeds 1 and 2 and read 99% in seed 0; every other configuration finished
    in 3 seeds."""
    rng, rows = np.random.default_rng(5), []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                v, status = 0.97 - 0.005 * np.log2(b * k / 32) + rng.normal(0, 0.002), "FINISHED"
                if rule == "sqrt" and (b, k) == (32, 16):
                    v, status = (0.99, "FINISHED") if seed == 0 else (np.nan, "FAILED")
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status=status, val_acc=round(v, 3)))
    [best] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
              if line.startswith("The best accuracy: ")]
    assert not best.startswith("The best accuracy: b = 32, k = 16, sqrt"), best
    assert " over 3 seeds, " in best


def test_the_best_is_named_over_its_own_finished_seeds():
    """B = 32 is 5 points above the rest and lost seed 2 (both its copies, one per rule, failed): it is the best
    over its own 2 seeds, not over the study's 3."""
    rng, rows = np.random.default_rng(5), []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for b, k in ((32, 1), (32, 4), (128, 1)):
                v = 0.95 + (0.05 if b * k == 32 else 0) + rng.normal(0, 0.002)
                failed = seed == 2 and b * k == 32
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if failed else "FINISHED",
                                 val_acc=np.nan if failed else round(v, 3)))
    [best] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
              if line.startswith("The best accuracy: ")]
    assert best.startswith("The best accuracy: b = 32, k = 1, every LR rule (B = base_batch) (") and \
        " over 2 seeds, " in best, best


def _free(linear_at_128: str, gap: float = 0.0) -> list[str]:
    """linear loses 0.05 points per doubling of B, none 1 point; `linear_at_128` is the status of linear's trials
    at B = 128; `gap` is linear's constant cost at every B above 32."""
    rng, rows = np.random.default_rng(7), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for k in (1, 2, 4, 8):
                v = 0.97 - (0.0005 if rule == "linear" else 0.01) * np.log2(k) - (gap if k > 1 else 0)
                status = linear_at_128 if rule == "linear" and k == 4 else "FINISHED"
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status=status,
                                 val_acc=round(v + rng.normal(0, 0.0015), 3) if status == "FINISHED" else np.nan))
    return [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
            if "shown to cost" in line]


def test_a_b_that_finished_no_trial_ends_the_run_of_bs_shown_free():
    """Every linear trial at B = 128 failed; B = 64 and 256 are equivalent to B = 32: the largest B shown within
    the margin through every B the rule ran is 64, and the line says why it stops there."""
    [line] = _free("FAILED")
    assert line.startswith("The largest B shown to cost less than 1 point: B = 64 under the linear LR rule, "), line
    assert line.endswith("against B = 32; B = 128 finished no trial to compare.")
    [line] = _free("FINISHED")
    assert line.startswith("The largest B shown to cost less than 1 point: B = 256 under the linear LR rule, ") and \
        line.endswith("against B = 32, and every B between them too."), line


def test_equivalence_is_worded_as_a_cost_below_the_margin_never_as_nothing():
    """linear costs 0.4 points at every B above 32: equivalent within ±1 point shows a cost below 1 point, which
    is what the line says (an interval such as -0.6 ± 0.4 excludes 0: "nothing" would be false)."""
    [line] = _free("FINISHED", gap=0.004)
    assert "cost nothing" not in line and line.startswith("The largest B shown to cost less than 1 point: B = "), line
    assert re.search(r"equivalent within ±1 point \(-0\.\d ± 0\.\d points over 3 seeds\) against B = 32", line), line


def test_each_bn_rules_twin_verdict_is_named_none_overwritten():
    """LR rule crossed with BN momentum rule: accumulation is 3 points behind its true-batch twin under BN default
    and equal under scaled. The per-B line gives both verdicts, each with its BN rule, not the last one alone."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for bn in ("default", "scaled"):
                for b, k in ((32, 1), (32, 4), (128, 1)):
                    v = 0.97 - (0.01 if b * k > 32 else 0) - (0.03 if k > 1 and bn == "default" else 0)
                    rows.append(dict(seed=seed, lr_rule=rule, bn_momentum_rule=bn, physical_batch=b, accum_steps=k,
                                     effective_batch=b * k, base_batch=32, status="FINISHED",
                                     val_acc=round(v + rng.normal(0, 0.001), 3)))
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule", "bn_momentum_rule"))
    [at_128] = [line for line in recommend(study) if line.startswith("At B = 128")]
    assert re.search(r"against the true batch \(b = 128, k = 1\): under BN default: [23]\.\d points lower, 95% CI",
                     at_128)
    assert "; under BN scaled: equivalent within ±1 point (" in at_128, at_128
    assert "b: the largest that fits your memory" not in at_128
