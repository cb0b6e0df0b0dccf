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
    ties = best.split("cannot be told from it")[1].split("resolved worse than it")[0]
    assert "every LR rule" not in ties and "3 resolved worse than it: b = 32, k = 1, every LR rule (B = base_batch); " \
        in best, best  # resolved below the pick: no tie, and counted where it went


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


def _free(linear_at_128: str, gap: float = 0.0, one_seed_at_128: bool = False) -> list[str]:
    """linear loses 0.05 points per doubling of B, none 1 point; `linear_at_128` is the status of linear's trials
    at B = 128; `gap` is linear's constant cost at every B above 32."""
    rng, rows = np.random.default_rng(7), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for k in (1, 2, 4, 8):
                v = 0.97 - (0.0005 if rule == "linear" else 0.01) * np.log2(k) - (gap if k > 1 else 0)
                status = linear_at_128 if rule == "linear" and k == 4 and (seed or not one_seed_at_128) else \
                    "FINISHED"
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status=status,
                                 val_acc=round(v + rng.normal(0, 0.0015), 3) if status == "FINISHED" else np.nan))
    return [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
            if "shown to cost" in line]


def test_a_b_that_finished_no_trial_ends_the_run_of_bs_shown_free():
    """Every linear trial at B = 128 failed; B = 64 and 256 are equivalent to B = 32: the largest B shown within
    the margin through every B the rule ran is 64, and the line says why it stops there."""
    [line] = _free("FAILED")
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 64 under the linear LR rule, "), line
    assert ("against B = 32; B = 128 finished no trial to compare; shown to cost less than 1 point, but above a B of "
            "its rule that was not: B = 256 under the linear LR rule (equivalent within ±1 point") in line, line
    [line] = _free("FINISHED")
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 256 under the linear LR rule, ") and \
        line.endswith("against B = 32, and every B between them too."), line


def test_equivalence_is_worded_as_a_cost_below_the_margin_never_as_nothing():
    """linear costs 0.4 points at every B above 32: equivalent within ±1 point shows a cost below 1 point, which
    is what the line says (an interval such as -0.6 ± 0.4 excludes 0: "nothing" would be false)."""
    [line] = _free("FINISHED", gap=0.004)
    assert "cost nothing" not in line, line
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: B = "), line
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
    # (the twins resolved apart at B = 128: each half is picked on its own, and every LR rule's verdicts named)
    assert re.search(r"against the true batch \(b = 128, k = 1\): under the none LR rule, BN default: [23]\.\d points "
                     r"lower, 95% CI", at_128), at_128
    assert re.search(r"; under the (none|sqrt) LR rule, BN scaled: equivalent within ±1 point \(", at_128), at_128
    assert "b: the largest that fits your memory" not in at_128


def _rows(values, bs=((32, 1), (32, 4), (128, 1)), seeds=range(3), **fixed) -> list[dict]:
    """One finished trial per (seed, rule, (b, k)) of `values(seed, rule, b, k)` (None: not run)."""
    rows = []
    for seed in seeds:
        for rule in ("none", "sqrt", "linear"):
            for b, k in bs:
                v = values(seed, rule, b, k)
                if v is not None:
                    rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                     base_batch=32, status="FINISHED", val_acc=round(v, 3), **fixed))
    return rows


def test_a_per_b_line_says_it_pools_the_bn_momentum_rules():
    """LR rule crossed with BN momentum rule: the pick and its cost at a B average each seed's runs over the BN
    rules; the line says so (it read as if it held for each)."""
    rows = [{**r, "bn_momentum_rule": bn} for bn in ("default", "scaled")
            for r in _rows(lambda s, rule, b, k: 0.95 - (0.01 if b * k > 32 else 0) + 0.001 * s)]
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule", "bn_momentum_rule"))
    [at_128] = [line for line in recommend(study) if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128 (over the BN momentum rules default and scaled, each seed's runs averaged): ")
    rows = [{**r, "weight_decay": wd} for wd in (0.0, 5e-4)
            for r in _rows(lambda s, rule, b, k: 0.95 - (0.01 if b * k > 32 else 0) + 0.001 * s)]
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule", "weight_decay"))
    [at_128] = [line for line in recommend(study) if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128 (over weight_decay 0.0 and 0.0005, each seed's runs averaged): "), at_128


def test_the_accumulation_verdict_names_the_b_and_k_that_ran():
    """B = 128 was accumulated as b = 64, k = 2; no trial ran b = 32, k = 4 (the smallest b is 32, at B = 32)."""
    rng = np.random.default_rng(1)
    rows = _rows(lambda s, rule, b, k: 0.95 + rng.normal(0, 0.001), bs=((32, 1), (64, 2), (128, 1)))
    [at_128] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
                if line.startswith("At B = 128")]
    assert re.search(r"accumulating under the \w+ LR rule \(b = 64, k = 2\) against the true batch "
                     r"\(b = 128, k = 1\): ", at_128), at_128
    assert "k = 4" not in at_128


def test_no_b_is_advised_where_the_twins_were_not_resolved_either_way():
    """Accumulation and the true batch 2 points apart in seed noise (neither equivalent within ±1 point nor
    resolved): "b: the largest that fits your memory" would be advice from absence of evidence."""
    noise = {0: 0.02, 1: -0.02, 2: 0.0}
    rows = _rows(lambda s, rule, b, k: 0.95 + (noise[s] if k > 1 else 0))
    [at_128] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
                if line.startswith("At B = 128")]
    assert "b: the largest that fits your memory" not in at_128 and "plan --target-batch" not in at_128
    rule = at_128.split("the ")[1].split(" LR rule")[0]  # (the picked rule, whose twins the line reads)
    assert at_128.endswith(f"accumulation under the {rule} LR rule was neither shown equivalent to the true batch "
                           f"nor resolved from it with 3 seeds, so no b is advised."), at_128
    rows = _rows(lambda s, rule, b, k: 0.95 + 0.001 * s)  # (the twins equal in every seed: equivalent)
    [at_128] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
                if line.startswith("At B = 128")]
    assert "; b: the largest that fits your memory (`" in at_128


def test_an_accuracy_logged_in_percent_reads_in_percent_with_a_margin_of_one_point():
    """A script logs val_acc as 0-100: the best read "9611.7%", and the 1-point margin was 0.01 on that scale, so
    nothing was ever equivalent."""
    rng = np.random.default_rng(7)
    rows = [dict(seed=s, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k, base_batch=32,
                 status="FINISHED", val_acc=round(97 - (0.05 if rule == "linear" else 1) * np.log2(k)
                                                  + rng.normal(0, 0.15), 1))
            for s in range(3) for rule in ("none", "linear") for k in (1, 2, 4, 8)]
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"))
    lines = recommend(study)
    findings = summarize(study.trials, study.history, None, study.objectives[0])
    assert not any("compared in the study's objective" in s for s in findings), findings  # (it is accuracy)
    [best] = [line for line in lines if line.startswith("The best accuracy: ")]
    assert re.search(r"\(9\d\.\d% over 3 seeds", best) and "9611" not in best and "%" in best, best
    [free] = [line for line in lines if "cost less than" in line]
    assert free.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 256 under the linear LR rule"), free
    assert re.search(r"equivalent within ±1 point \([-+]0\.\d ± 0\.\d points over 3 seeds\)", free), free


def test_ties_for_the_shortest_time_are_named_and_none_is_crowned():
    """Times to the target of one configuration under three names (B = base_batch under each rule) came 2 s apart;
    B = 64 and 128 reached it within 2 s of the fastest: no configuration is resolved fastest, and each within the
    spread is named."""
    seconds = {(32, 1): 10.0, (32, 2): 11.0, (64, 1): 9.5, (32, 4): 30.0, (128, 1): 8.0}
    spread = {"none": 0.0, "sqrt": 1.0, "linear": 2.0}
    rows = _rows(lambda s, rule, b, k: 0.95, bs=tuple(seconds))
    history = []
    for i, r in enumerate(rows):
        r["run_id"] = f"r{i}"
        t = seconds[(r["physical_batch"], r["accum_steps"])] + (spread[r["lr_rule"]] if r["effective_batch"] == 32
                                                                else 0)
        history += [dict(run_id=r["run_id"], epoch=e, val_acc=0.95 * e / 2, epoch_time_s=t / 2) for e in (1, 2)]
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"))
    study.history = pd.DataFrame(history)
    [line] = [line for line in recommend(study) if "fastest" in line or "shortest" in line]
    assert line.startswith("No configuration was resolved fastest to val_acc 90.2%: "), line
    assert "within 2.0 s of the shortest median (8.0 s)" in line
    assert "b = 128, k = 1, none (8.0 s)" in line and "b = 64, k = 1, sqrt (9.5 s)" in line
    assert "b = 32, k = 4" not in line


def test_per_b_contrasts_are_controlled_over_the_whole_block():
    """At B = 512 none is 3 points below sqrt in every seed (p 0.009); every other contrast of the block's 8 is
    nothing. Controlled within B = 512 alone (2 comparisons) it read "resolved worse"; over the block it is not."""
    bs = ((32, 1), (32, 2), (32, 4), (32, 8), (32, 16))
    drop = {0: 0.025, 1: 0.030, 2: 0.035}
    wiggle = {"none": 0.0, "sqrt": 0.001, "linear": 0.0}

    def values(seed, rule, b, k):
        v = 0.95 + (wiggle[rule] if seed == 0 else -wiggle[rule] if seed == 1 else 0)
        return v - (drop[seed] if rule == "none" and k == 16 else 0)

    [at_512] = [line for line in recommend(_study(_rows(values, bs), ("physical_batch", "accum_steps", "lr_rule")))
                if line.startswith("At B = 512")]
    assert "resolved worse than it" not in at_512 and "none cannot be told from it" in at_512.replace(
        "linear and none", "none"), at_512


def test_a_pick_overturned_by_a_resolved_contrast_says_so():
    """none ran 10 seeds, sqrt seeds 2 to 9, linear seeds 2 and 3. Above B = 32 none has the highest mean over its
    own seeds (95.0%: 97.0% in seeds 0 and 1), sqrt 94.7%; on the 8 seeds the two share, sqrt is 0.2 points above
    none in each, resolved. The pick at B = 128 is sqrt, said overturned, and so is the best."""
    def values(seed, rule, b, k):
        if (rule == "sqrt" and seed < 2) or (rule == "linear" and seed not in (2, 3)):
            return None
        if b * k == 32:
            return 0.94
        return {"none": 0.970 if seed < 2 else 0.945, "sqrt": 0.947, "linear": 0.90}[rule]

    study = _study(_rows(values, seeds=range(10)), ("physical_batch", "accum_steps", "lr_rule"))
    lines = recommend(study)
    [at_128] = [line for line in lines if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: the sqrt LR rule (94.7%; it was resolved better than none on the seeds the "
                             "two share (none had the highest mean)"), at_128
    [largest] = [s for s in summarize(study.trials, study.history) if s.startswith("At the largest batch")]
    assert "the sqrt rule was resolved better than none on the seeds the two share" in largest, largest
    [best] = [line for line in lines if line.startswith("The best accuracy: ")]
    assert best.startswith(("The best accuracy: b = 32, k = 4, sqrt (94.7%", "The best accuracy: b = 128, k = 1, "
                            "sqrt (94.7%")) and "resolved above" in best, best


def test_one_seed_advice_gives_a_command_that_works_for_the_study():
    """At seed 5, `--seeds 3` from the default seed 0 would run seeds 0-2: the command keeps the study's seed and
    names the seeds it adds. batch_memory's measurements are for the planner; critical_batch has no choice to pick,
    its findings want seeds."""
    from tests.test_recommend import built_in

    rows = _rows(lambda s, rule, b, k: 0.95, seeds=(5,))
    [line] = recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
    assert "--study s --seed 5 --seeds 3` (it keeps these trials and adds seeds 6 and 7)" in line, line
    memory = built_in("batch_memory")
    memory.trials = memory.trials[memory.trials["seed"] == 0]
    [line] = recommend(memory)
    assert "plan --target-batch B --memory-budget SIZE" in line and "--seeds" not in line, line
    branches = built_in("critical_batch")
    branches.trials = branches.trials[branches.trials["seed"] == 0]
    [line] = recommend(branches)
    assert line.startswith("Nothing here is a choice to recommend") and "--study critical_batch --seeds 3`" in line


def test_an_exactness_study_says_per_model_whether_to_accumulate_and_ranks_no_k():
    """equivalence's objective is the parameter difference between accumulation and its twin: a measurement of
    exactness, per model. Its block read "The best param_rel_diff: k = 4 ... 2 others cannot be told from it",
    a mean over mlp (float rounding) and cnn1d (BatchNorm) that ranks k by nothing a user chooses."""
    rng, rows = np.random.default_rng(3), []
    for seed in range(3):
        for model, diff, ghost in (("mlp", 1e-6, np.nan), ("cnn1d", 0.1, 1e-3)):
            for k in (2, 4, 8):
                rows.append(dict(seed=seed, model=model, dataset="mnist1d", physical_batch=32, accum_steps=k,
                                 effective_batch=32 * k, status="FINISHED", acc_gap=rng.normal(0, 0.002),
                                 param_rel_diff=diff * (1 + 0.1 * rng.random()), ghost_rel_diff=ghost))
    lines = recommend(_study(rows, ("model", "dataset", "physical_batch", "accum_steps"),
                             ("param_rel_diff", "minimize")))
    assert not any(line.startswith("The best ") for line in lines), lines
    assert lines[0].startswith("On cnn1d: accumulation is not the true batch (BatchNorm normalizes each micro-batch")
    assert "--study bn_momentum` measures" in lines[0]
    assert lines[1].startswith("On mlp: accumulate to reach a B that does not fit; it trains as the true batch does")
    # No sentence compares configurations in param_rel_diff there: none says they are compared in it.
    t = _study(rows, ()).trials
    assert not any("compared in the study's objective" in s for s in summarize(
        t.assign(val_acc=0.9, memory_source="saved_tensors"), None, None, ("param_rel_diff", "minimize")))
