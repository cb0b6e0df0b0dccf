"""The recommendation and the findings where trials are missing or mixed: a val_acc logged in percent, a rule that
diverged in a seed, a B finished in one seed, a pick with no seed shared with its smallest B, several models, ties
that the per-B contrasts resolve lower, and branches that do not bracket the critical batch."""
import re

import numpy as np
import pandas as pd

from batchsweep.analysis import branching
from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.render import _table
from batchsweep.analysis.rules import twins
from batchsweep.analysis.runs import StudyRuns
from batchsweep.analysis.space import memory_front
from tests.test_recommend_edges import _free, _rows, _study


def test_findings_and_block_read_alike_whether_val_acc_is_logged_in_percent_or_in_fraction():
    """The findings' rule sentences compared a percent-logged val_acc on the fraction's scale ("133.3 points
    lower", "9566.7%"), contradicting the block; the fastest line's target read "val_acc 91.55"."""
    def made(scale):
        rng = np.random.default_rng(3)
        rows = _rows(lambda s, rule, b, k: 0.96 - {"none": 0.01, "sqrt": 0.004, "linear": 0.001}[rule]
                     * np.log2(b * k / 32) + rng.normal(0, 0.002), bs=((32, 1), (32, 4), (128, 1), (32, 8), (256, 1)))
        history = []
        for i, r in enumerate(rows):
            r["run_id"], r["val_acc"] = f"r{i}", r["val_acc"] * scale
            history += [dict(run_id=r["run_id"], epoch=e, val_acc=r["val_acc"] * (1 - 0.3 / e ** 2),
                             epoch_time_s=2.0 / np.sqrt(r["effective_batch"] / 32)) for e in range(1, 6)]
        study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"))
        study.history = pd.DataFrame(history)
        return recommend(study), summarize(study.trials, study.history, None, study.objectives[0])
    (block, found), (block_100, found_100) = made(1), made(100)
    assert block_100 == block
    rules = [s for s in found if s.startswith("The ")]
    assert [s for s in found_100 if s.startswith("The ")] == rules and len(rules) >= 3, found_100
    assert not any(re.search(r"\d{3,}\.\d (points|%)", s) for s in found_100), found_100
    [fast] = [line for line in block_100 if "fastest" in line or "shortest" in line]
    assert re.search(r" to val_acc \d\d\.\d%", fast), fast


def _diverged_at_256() -> StudyRuns:
    """linear at B = 256 (b = 256, k = 1 and b = 32, k = 8) diverged in seed 2 and matched B = 32 in seeds 0 and 1;
    sqrt is 0.3 points below B = 32 at B = 256 in every seed and never diverged."""
    rng, rows = np.random.default_rng(11), []
    for seed in range(3):
        for rule in ("sqrt", "linear"):
            for b, k in ((32, 1), (32, 2), (64, 1), (32, 8), (256, 1)):
                div = rule == "linear" and b * k == 256 and seed == 2
                v = 0.95 - (0.003 if rule == "sqrt" and b * k > 32 else 0) + rng.normal(0, 0.0015)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if div else "FINISHED",
                                 reason="diverged" if div else None, val_acc=np.nan if div else round(v, 3)))
    return _study(rows, ("physical_batch", "accum_steps", "lr_rule"))


def test_a_rule_that_diverged_in_a_seed_is_neither_picked_nor_called_equivalent_there():
    study = _diverged_at_256()
    lines = recommend(study)
    [at_256] = [line for line in lines if line.startswith("At B = 256")]
    assert at_256.startswith("At B = 256: the sqrt LR rule (") and "linear diverged in 1 of 3 seeds" in at_256, at_256
    [best] = [line for line in lines if line.startswith("The best")]
    assert "left out as diverged in a seed: b = 32, k = 8, linear; b = 256, k = 1, linear" in best, best
    assert "256, k = 1, linear" not in best.split("left out")[0]
    findings = summarize(study.trials, study.history)
    [linear] = [s for s in findings if s.startswith("The linear LR rule")]
    assert linear.endswith("at B = 256 diverged in 1 of 3 seeds, not compared over the seeds that finished."), linear
    assert "256 (" not in linear
    [largest] = [s for s in findings if s.startswith("At the largest batch")]
    assert "sqrt is the only rule that did not diverge" in largest and "linear diverged in 1 of 3 seeds" in largest


def test_a_b_finished_in_one_seed_is_said_so_and_no_rule_is_picked_there_from_one_seed():
    """linear at B = 128 finished in seed 0 only: the run of Bs shown free stops there "finished in only 1 seed"
    (it read "finished no trial"), and B = 128's pick is not linear's one seed against none's 3-seed mean."""
    [line] = _free("FAILED", one_seed_at_128=True)
    assert ("against B = 32; B = 128 finished in only 1 seed of the 3 it ran, which cannot be told from seed noise; "
            "shown to cost less than 1 point, but above a B of its rule that was not: B = 256") in line, line
    rng, rows = np.random.default_rng(7), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for k in (1, 2, 4, 8):
                failed = rule == "linear" and k == 4 and seed > 0
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status="FAILED" if failed else "FINISHED",
                                 val_acc=np.nan if failed else round(0.97 - (0.0005 if rule == "linear" else 0.01)
                                                                     * np.log2(k) + rng.normal(0, 0.0015), 3)))
    [at_128] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "lr_rule")))
                if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: no LR rule is picked: the rules finished together in 1 seed there (each "
                             "finished in: none in 3 and linear in 1)"), at_128


def test_a_study_of_two_models_gets_a_block_per_model_never_one_pooled_pick():
    """On mlp linear is best at B = 256 (sqrt 3 points lower), on cnn sqrt (linear 3 points lower): a pick pooled
    over both ("over model cnn and mlp") held for neither and contradicted each model's findings."""
    rng, rows = np.random.default_rng(4), []
    for seed in range(3):
        for model in ("cnn", "mlp"):
            for rule in ("sqrt", "linear"):
                for b, k in ((32, 1), (32, 8), (256, 1)):
                    good = (model == "mlp") == (rule == "linear") or b * k == 32
                    rows.append(dict(seed=seed, model=model, lr_rule=rule, physical_batch=b, accum_steps=k,
                                     effective_batch=b * k, base_batch=32, status="FINISHED",
                                     val_acc=round(0.95 - (0 if good else 0.03) + rng.normal(0, 0.002), 3)))
    lines = recommend(_study(rows, ("model", "physical_batch", "accum_steps", "lr_rule")))
    assert all(line.startswith(("On cnn: ", "On mlp: ")) for line in lines) and "over model" not in " ".join(lines)
    assert [line.split(" LR rule")[0] for line in lines if "at B = 256: " in line] == \
        ["On cnn: at B = 256: the sqrt", "On mlp: at B = 256: the linear"], lines


def test_a_pick_that_shares_no_seed_with_its_smallest_b_says_its_cost_cannot_be_compared():
    """sqrt ran B = 32 in seeds 0 and 1 and B = 128 in seeds 2 and 3 only, and has the best mean at B = 128: the
    block crashed (AttributeError on the missing difference); the findings left sqrt out without a word."""
    rng, rows = np.random.default_rng(0), []
    for rule, plan in (("none", {32: range(4), 128: range(4)}), ("sqrt", {32: range(2), 128: range(2, 4)})):
        for b, seeds in plan.items():
            for seed in seeds:
                for pb, k in ((b, 1), (32, b // 32)) if b > 32 else ((32, 1),):
                    rows.append(dict(seed=seed, lr_rule=rule, physical_batch=pb, accum_steps=k, effective_batch=b,
                                     base_batch=32, status="FINISHED", val_acc=round(
                                         0.95 - (0.01 if b > 32 and rule == "none" else 0) + rng.normal(0, 0.001), 3)))
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"))
    [at_128] = [line for line in recommend(study) if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: the sqrt LR rule (") and \
        "; against B = 32: cannot be compared: the sqrt LR rule ran no seed at both Bs" in at_128, at_128
    findings = summarize(study.trials, study.history)
    assert "The sqrt LR rule ran no seed both at B = 32 and at a larger B: its Bs cannot be compared." in findings


def test_a_configuration_the_per_b_contrast_resolves_lower_is_no_tie_of_the_best():
    """none at B = 128 is 1 point below B = 32 in every seed once its two halves are averaged, while each half
    alone swings ±2 points with the seed: the best's contrast, one (b, k) at a time, cannot tell either half from
    B = 32, but the per-B contrast resolves none at B = 128 lower; the best line listed both as ties."""
    swing = {0: 0.02, 1: -0.02, 2: 0.0}
    rows = _rows(lambda s, rule, b, k: 0.95 + 0.001 * s - (0.01 + (swing[s] if k > 1 else -swing[s])
                                                           if rule == "none" and b * k == 128 else 0))
    study = _study(rows, ("physical_batch", "accum_steps", "lr_rule"))
    [best] = [line for line in recommend(study) if line.startswith("The best")]
    ties, _, below = best.partition("; 2 set apart, though each alone cannot be told from it: the per-B lines resolve each worse than its rule's "
                                    "smallest B (each B's (b, k) pooled), which is the best or cannot be told from "
                                    "it: ")
    assert below.startswith("b = 32, k = 4, none; b = 128, k = 1, none;"), best
    assert ", none" not in ties, best
    starred = _starred(study)  # the trials table marks what the line names, not the ties it resolved lower
    assert starred and not starred & {("none", 32, 4), ("none", 128, 1)}, starred


def _starred(study: StudyRuns) -> set[tuple]:
    """The configurations whose trials the trials table marks ★ (best or not told apart)."""
    table = _table(study)
    if "best or not told apart" not in table:
        return set()
    rows = study.trials.loc[table.index[table["best or not told apart"] == "★"]]
    return {(r.lr_rule, int(r.physical_batch), int(r.accum_steps)) for r in rows.itertuples()}


def test_the_trials_table_stars_no_configuration_that_diverged_in_a_seed():
    """linear at B = 256 diverged in seed 2 and tied the best over the two seeds that finished: the best line left
    it out, and the table's ★ marked it; where the best mean itself diverged in a seed, no best is named and no
    trial is marked."""
    study = _diverged_at_256()
    [best] = [line for line in recommend(study) if line.startswith("The best")]
    assert "left out as diverged in a seed: b = 32, k = 8, linear; b = 256, k = 1, linear" in best, best
    starred = _starred(study)
    assert starred and not starred & {("linear", 32, 8), ("linear", 256, 1)}, starred
    t = study.trials  # the diverged configuration on top in the seeds that finished: no best, no ★
    t.loc[(t["lr_rule"] == "linear") & (t["effective_batch"] == 256) & (t["seed"] < 2), "val_acc"] = 0.99
    assert any(line.startswith("No best accuracy is named: b = ") for line in recommend(study))
    assert _starred(study) == set()


def _branched(ratios: list[dict]) -> list[str]:
    return branching.finding(*_branches(ratios))


def _branches(ratios: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Branches at epoch 2 from B = 32 into 64, 128 and 256; `ratios`, one dict per seed: each B's final val_loss
    over the reference's."""
    rows, history = [], []
    for seed, per in enumerate(ratios):
        rows.append(dict(run_id=f"ref{seed}", seed=seed, effective_batch=32, batch_warmup="", epochs=6,
                         status="FINISHED", val_acc=0.9))
        history.append(dict(run_id=f"ref{seed}", epoch=6, val_loss=0.30, val_acc=0.9))
        for b, ratio in per.items():
            rows.append(dict(run_id=f"b{b}s{seed}", seed=seed, effective_batch=b, batch_warmup="32,32", epochs=6,
                             status="FINISHED", val_acc=0.9))
            history.append(dict(run_id=f"b{b}s{seed}", epoch=6, val_loss=0.30 * ratio, val_acc=0.9))
    return pd.DataFrame(rows), pd.DataFrame(history)


def test_branches_that_do_not_bracket_the_critical_batch_say_so_with_the_seeds_behind_them():
    """B = 64 did not keep up while B = 128 did: "between 128 and 256" ignored it. With 3 seeds, B = 128's mean kept
    up (ratios 0.95, 1.00, 1.08) while one seed did not: the sentence says how the seeds part."""
    [one] = _branched([{64: 1.03, 128: 1.01, 256: 1.05}])
    assert "the critical batch was not bracketed after epoch 2 (B = 64 did not keep up while B = 128 did)" in one
    assert "between 128 and 256" not in one and one.endswith("Each branch ran in one seed: how far its verdict "
                                                             "moves with the seed is not measured."), one
    # The figure drew B = 128 as the critical batch there; it marks the epoch as not bracketed instead.
    ax = branching.figure(*_branches([{64: 1.03, 128: 1.01, 256: 1.05}])).figure.axes[0]
    [line] = [line for line in ax.lines if line.get_label().startswith("critical batch by branching")]
    assert len(line.get_xdata()) == 0 and "not bracketed (a smaller B failed where a larger kept up)" in [
        text.get_text() for text in ax.get_legend().get_texts()]
    [three] = _branched([{64: 1.01, 128: 0.95, 256: 1.05}, {64: 1.0, 128: 1.00, 256: 1.06},
                         {64: 1.0, 128: 1.08, 256: 1.07}])
    assert "the critical batch was between 128 and 256 after epoch 2" in three, three
    assert three.endswith("Each verdict is over 3 seeds; the seeds part where a mean kept up or not (B = 128 after "
                          "epoch 2, 2 of 3 seeds kept up on their own)."), three


def test_the_memory_fronts_ties_say_which_comparison_they_use():
    """The front's ties compare each (b, k) with the best on its own; the LR-rule sentences pool a B's (b, k) and
    resolve two of them lower: the sentence counts those apart, as the best line does (it counted them among the
    ties and said the LR-rule sentences 'may resolve one of these lower')."""
    swing = {0: 0.02, 1: -0.02, 2: 0.0}
    rows = [{**r, "peak_memory_bytes": 1e5 * r["physical_batch"]}
            for r in _rows(lambda s, rule, b, k: 0.95 + 0.001 * s - (0.01 + (swing[s] if k > 1 else -swing[s])
                                                                     if rule == "none" and b * k == 128 else 0))]
    finding = memory_front(_study(rows, ("physical_batch", "accum_steps", "lr_rule"))).finding
    assert ("; 2 set apart, though each alone cannot be told from it: the per-B lines resolve each worse than its "
            "rule's smallest B (each B's (b, k) pooled), which is the best or cannot be told from it: b = 32, k = 4, "
            "none; b = 128, k = 1, none; paired by seed over 3 seeds") in finding and "may resolve" not in finding, \
        finding


def test_the_memory_front_leaves_out_a_configuration_that_diverged_in_a_seed():
    """linear at B = 256 diverged in seed 2: over its two surviving seeds it tied the best; the front's sentence
    counted it among the configurations, and would name it best where its survivors led."""
    study = _diverged_at_256()
    study.trials["peak_memory_bytes"] = 1e5 * study.trials["physical_batch"]
    t = study.trials
    t.loc[(t["lr_rule"] == "linear") & (t["effective_batch"] == 256) & (t["seed"] < 2), "val_acc"] = 0.99
    finding = memory_front(study).finding
    assert finding.startswith("Against peak memory, the best mean of the 7 configurations that diverged in no seed "
                              "was "), finding
    before = finding.split("; left out as diverged in a seed: ")[0]
    assert "k = 8, linear" not in before and "k = 1, linear" not in before, finding
    assert "left out as diverged in a seed: b = 32, k = 8, linear; b = 256, k = 1, linear)" in finding, finding


def test_a_twin_pair_in_which_a_run_diverged_is_not_compared_over_the_survivors():
    """linear at B = 256 diverged in seed 2, both its accumulated run and its true batch: the twins' sentence
    called the pair equivalent over the two seeds that finished; it is now not compared, and says why."""
    study = _diverged_at_256()
    t = study.trials
    t["batch"] = ["accumulated" if k > 1 else "true batch" for k in t["accum_steps"]]
    [said] = twins(t)
    assert said.startswith("Accumulation and its true-batch twin at the same B were compared in 3 pairs"), said
    assert said.endswith("Not compared where a run diverged in a seed: linear at B = 256: the accumulated run "
                         "diverged in 1 of 3 seeds and the true batch run diverged in 1 of 3 seeds."), said
