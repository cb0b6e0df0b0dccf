"""The report where a comparison points the unexpected way or a seed was lost: a B resolved above the smallest B,
a comparison inside the margin that is also resolved, a BN rule or a branch that diverged in a seed, a pruned
trial."""
import numpy as np
import pandas as pd

from batchsweep.analysis import branching
from batchsweep.analysis.findings import lr_exponent, summarize
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.targets import steps
from tests.test_recommend_edges import _rows, _study
from tests.test_recommend_gaps import _branches

GRID = ("physical_batch", "accum_steps", "lr_rule")


def _free_line(study) -> str:
    [line] = [line for line in recommend(study) if "shown to cost" in line]
    return line


def test_a_b_resolved_above_the_smallest_b_costs_nothing_either():
    """linear at B = 128 and 512 is 2 points above B = 32 in every seed, none and sqrt 2 points below: the largest
    B shown to cost less than the margin is linear's 512 (it read "No B above the smallest was shown to cost
    less")."""
    rng = np.random.default_rng(9)

    def value(s, rule, b, k):
        gain = 0 if b * k == 32 else {"none": -0.02, "sqrt": -0.02, "linear": 0.02}[rule]
        return 0.93 + 0.001 * s + gain + rng.normal(0, 0.001)
    study = _study(_rows(value, bs=((32, 1), (32, 4), (128, 1), (32, 16), (512, 1))), GRID)
    line = _free_line(study)
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 512 under the linear LR rule, "), line
    assert "points higher" in line and line.endswith("against B = 32, and every B between them too."), line


def test_a_resolved_difference_inside_the_margin_is_shown_to_cost_less_than_it():
    """sqrt at B = 128 is 0.6 points below B = 32 in every seed (95% CI about -0.7 to -0.5): inside the ±1 point
    margin, so it is shown to cost less than 1 point, not quoted as the nearest of none that was."""
    rng = np.random.default_rng(1)

    def value(s, rule, b, k):
        return 0.95 - (0 if b * k == 32 else {"none": 0.02, "sqrt": 0.006, "linear": 0.015}[rule]) \
            + rng.normal(0, 0.001)
    line = _free_line(_study(_rows(value), GRID))
    assert line.startswith("The largest B shown to cost less than 1 point together with every B below it: "
                           "B = 128 under the sqrt LR rule, "), line
    assert "inside the ±1 point equivalence margin" in line, line


def _bn_diverged() -> tuple:
    """scaled at k = 16 diverged in seed 2 and matched the true batch in seeds 0 and 1; matched is 0.3 points
    below the true batch, default 3 points below."""
    rng, rows = np.random.default_rng(5), []
    for seed in range(3):
        for bn in ("default", "scaled", "matched"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                div = bn == "scaled" and k == 16 and seed == 2
                v = 0.93 - ({"default": 0.03, "scaled": 0.0, "matched": 0.003}[bn] if k > 1 else 0) \
                    + rng.normal(0, 0.0015)
                rows.append(dict(seed=seed, lr_rule="sqrt", bn_momentum_rule=bn, physical_batch=b, accum_steps=k,
                                 effective_batch=b * k, base_batch=32, status="FAILED" if div else "FINISHED",
                                 reason="diverged" if div else None, val_acc=np.nan if div else round(v, 3)))
    study = _study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule"))
    return recommend(study), summarize(study.trials, study.history)


def test_a_bn_momentum_rule_paired_in_one_seed_is_named_in_the_recommendation():
    """scaled at k = 16 ran in seed 2 only: the line read "matched shown to match it (...)", scaled left out unsaid."""
    rng, rows = np.random.default_rng(5), []
    for seed in range(3):
        for bn in ("default", "scaled", "matched"):
            for b, k in ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)):
                if bn == "scaled" and k == 16 and seed < 2:
                    continue
                v = 0.93 - ({"default": 0.03, "scaled": 0.0, "matched": 0.003}[bn] if k > 1 else 0) \
                    + rng.normal(0, 0.0015)
                rows.append(dict(seed=seed, lr_rule="sqrt", bn_momentum_rule=bn, physical_batch=b, accum_steps=k,
                                 effective_batch=b * k, base_batch=32, status="FINISHED", reason=None,
                                 val_acc=round(v, 3)))
    [k16] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule")))
             if line.startswith("BN momentum at k = 16")]
    assert k16.endswith("; scaled 0.0 points below in one seed, which cannot be told from seed noise."), k16
    # Where every other rule diverged in a seed, scaled's one-seed comparison is no comparison over the seeds.
    rows = [dict(r, status="FAILED", reason="diverged", val_acc=np.nan) if r["accum_steps"] == 16 and r["seed"] == 0
            and r["bn_momentum_rule"] != "scaled" else r for r in rows]
    [k16] = [line for line in recommend(_study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule")))
             if line.startswith("BN momentum at k = 16")]
    assert k16.startswith("BN momentum at k = 16 (B = 512): no rule compared with the true batch over two seeds or "
                          "more; scaled 0.0 points below in one seed, which cannot be told from seed noise; "), k16


def test_one_twin_pair_is_one_pair():
    from tests.test_analysis import flat, synthetic
    t = synthetic(flat)
    said = " ".join(summarize(t[(t["lr_rule"] == "none") & (t["effective_batch"] <= 64)]))
    assert "Accumulation and its true-batch twin at the same B were compared in 1 pair, paired by seed" in said, said


def test_a_bn_momentum_rule_that_diverged_in_a_seed_is_not_shown_to_match_the_true_batch():
    """It read "scaled and matched shown to match it (scaled … over 2 seeds)": a pick among the seeds that
    survived."""
    block, found = _bn_diverged()
    [k16] = [line for line in block if line.startswith("BN momentum at k = 16")]
    assert ": matched shown to match it (" in k16 and "scaled diverged in 1 of 3 seeds, not compared" in k16, k16
    [final] = [s for s in found if s.startswith("Final accuracy at k = 16")]
    assert "scaled diverged in 1 of 3 seeds, not compared over the seeds that finished" in final, final
    assert "over 2 seeds" not in final + k16


def test_a_pruned_trial_is_stopped_for_doing_worse_not_a_missing_seed():
    """linear at B = 128 was pruned in seed 2 (both (b, k)): it was still the pick at B = 128 over the 2 seeds
    left, and a tie of the best."""
    rng = np.random.default_rng(1)
    rows = _rows(lambda s, rule, b, k: 0.95 - (0 if b * k == 32 else {"none": 0.02, "sqrt": 0.006, "linear": 0.001}
                                               [rule]) + rng.normal(0, 0.001))
    for r in rows:
        if r["lr_rule"] == "linear" and r["effective_batch"] == 128 and r["seed"] == 2:
            r.update(status="KILLED", reason="pruned", val_acc=np.nan)
    study = _study(rows, GRID)
    block = recommend(study)
    [at_128] = [line for line in block if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: the sqrt LR rule (") and "linear was pruned in 1 of 3 seeds" in at_128
    [best] = [line for line in block if line.startswith("The best")]
    assert "left out as pruned in a seed: b = 32, k = 4, linear; b = 128, k = 1, linear" in best, best
    found = summarize(study.trials, study.history)
    [linear] = [s for s in found if s.startswith("The linear LR rule")]
    assert linear.endswith("at B = 128 was pruned in 1 of 3 seeds, not compared over the seeds that finished."), linear
    [twin] = [s for s in found if s.startswith("Accumulation and")]
    assert "Not compared where a run was pruned in a seed: linear at B = 128" in twin, twin


def test_a_branch_that_diverged_in_a_seed_did_not_keep_up_there():
    """B = 256 branched after epoch 2 kept up in seeds 0 and 1 and diverged in seed 2: it read "at least 256 …
    Each verdict is over 2 seeds, each of which agrees with it" over the seeds that survived."""
    trials, history = _branches([{64: 1.0, 128: 1.01, 256: 1.01}] * 3)
    trials.loc[trials["run_id"] == "b256s2", ["status", "reason"]] = ["FAILED", "diverged"]
    history = history[history["run_id"] != "b256s2"]
    [line] = branching.finding(trials, history)
    assert "at least 256" not in line and "between 128 and 256" in line, line
    assert line.endswith("Each verdict is over 3 seeds; the seeds part where a mean kept up or not (B = 256 after "
                         "epoch 2, 2 of 3 seeds kept up on their own)."), line


def test_one_twin_pair_of_one_seed_is_said_apart_and_the_others_are_judged():
    """linear's true batch at B = 128 failed (an error) in seeds 1 and 2: that pair shares one seed, the other 5
    share 3. The whole sentence read "in one seed: no pair can be told from seed noise", hiding none's 2-point
    gap."""
    rng = np.random.default_rng(0)
    rows = _rows(lambda s, rule, b, k: 0.95 - {"none": 0.01, "sqrt": 0.004, "linear": 0.0}[rule] * np.log2(b * k / 32)
                 - (0.02 if rule == "none" and k > 1 else 0) + rng.normal(0, 0.001),
                 bs=((32, 1), (32, 4), (128, 1), (32, 16), (512, 1)))
    for r in rows:
        if r["lr_rule"] == "linear" and r["physical_batch"] == 128 and r["seed"] > 0:
            r.update(status="FAILED", reason="error", val_acc=np.nan)
    study = _study(rows, GRID)
    [line] = [s for s in summarize(study.trials, study.history) if s.startswith("Accumulation and")]
    assert line.startswith("Accumulation and its true-batch twin at the same B were compared in 5 pairs, paired by "
                           "seed over 3 seeds"), line
    assert "resolved in 2: none at B = 128: 2.1 points true batch ahead" in line, line
    assert line.endswith("Shared one seed only: linear at B = 128: 0.2 points accumulated ahead in one seed, which "
                         "cannot be told from seed noise."), line


def test_a_best_lr_at_the_top_of_the_grid_above_the_middle_b_makes_the_slope_a_lower_bound():
    """The best LR rises as B^0.5; at B = 512 seed 0's best is the highest LR tried (its true best lies above the
    grid), seeds 1 and 2 peak inside. The slope's true value is at least the one measured: it read "an upper bound"
    (the geometric mean over the seeds was checked against the grid's top, which it is not)."""
    rows, grid = [], [0.0125 * 2 ** i for i in range(6)]
    for seed in range(3):
        for b in (32, 128, 512):
            star = 0.025 * (b / 32) ** 0.5 * (4.0 if (b == 512 and seed == 0) else 1.0) * (1 + 0.1 * (seed - 1))
            rows += [dict(seed=seed, lr_rule="none", physical_batch=b, accum_steps=1, effective_batch=b, base_batch=32,
                          base_lr=lr, lr=lr, status="FINISHED", val_acc=round(0.95 - 0.01 * np.log(lr / star) ** 2, 4))
                     for lr in grid]
    [line] = lr_exponent(_study(rows, ("physical_batch", "base_lr")).trials)
    assert "At B = 512 some seed's best LR is the edge of the LRs tried" in line, line
    assert "or more, not bounded above: a seed's best sat at the edge of the LRs tried" in line, line


def _base() -> list[dict]:
    rng = np.random.default_rng(0)
    return _rows(lambda s, rule, b, k: 0.95 - 0.003 * np.log2(b * k / 32) + rng.normal(0, 0.002))


def test_the_report_reads_a_frame_with_no_seed_a_trial_with_no_lr_rule_and_memory_with_no_source():
    """Each raised (KeyError 'seed'; IndexError; KeyError 'memory_source')."""
    study = _study([{k: v for k, v in r.items() if k != "seed"} for r in _base()], GRID)
    assert not [s for s in summarize(study.trials, study.history) if s.startswith("The none LR rule")]
    rows = [{**r, "lr_rule": np.nan if i == 5 else r["lr_rule"]} for i, r in enumerate(_base())]
    study = _study(rows, GRID)
    assert any(line.startswith("At B = 128: the ") for line in recommend(study))
    assert any(s.startswith("The none LR rule against B = 32") for s in summarize(study.trials, study.history))
    rows = [{**r, "peak_memory_bytes": 2.0 ** 20 * (1 + (r["physical_batch"] == 128)) if r["seed"] else np.nan}
            for r in _base()]
    study = _study(rows, GRID)
    [memory] = [s for s in summarize(study.trials, study.history) if "peak memory" in s]
    assert memory.startswith("At b = 32, peak memory (its source not logged) stayed at 1.00 MiB from k = 1 to k = 4, "
                             "while the true batch of 128 needed 2.00 MiB (2.0x)."), memory


def test_a_b_where_most_seeds_diverged_is_left_out_of_the_steps_to_the_target():
    """At B = 512 two of three seeds diverged and the third reached the target: "most runs reached it" counted
    the one survivor of one."""
    rows, history = [], []
    for seed in range(3):
        for b in (32, 64, 128, 256, 512):
            div, run = b == 512 and seed > 0, f"r{len(rows)}"
            rows.append(dict(run_id=run, seed=seed, lr_rule="sqrt", physical_batch=32, accum_steps=b // 32,
                             effective_batch=b, base_batch=32, status="FAILED" if div else "FINISHED",
                             reason="diverged" if div else None, val_acc=np.nan if div else 0.95))
            history += [dict(run_id=run, epoch=e, steps=e * 32000 // b,
                             val_acc=min(0.95, 0.5 + 0.45 * e / (2 + b / 64))) for e in range(1, 11)]
    [_, line] = steps(pd.DataFrame(rows), pd.DataFrame(history))
    assert line.startswith("Over every run (at B = 512, 2 of 3 runs diverged: half or more, left out of the fit)"), line
    assert "from 12 runs at B = 32 to 256" in line, line


def test_a_study_where_every_trial_ended_at_one_value_compares_nothing():
    """Every run stuck at chance (10.0%): the block read "the largest B shown to cost less than 1 point: B = 512",
    every rule "equivalent within ±1 point (+0.0 ± 0.0 points)": intervals of no width. Nothing differed: the block
    says so instead, and the findings say so first."""
    study = _study(_rows(lambda s, rule, b, k: 0.1, bs=((32, 1), (32, 4), (128, 1))),
                   ("physical_batch", "accum_steps", "lr_rule"))
    said = ("Every finished trial ended at the same accuracy (10.0%): no configuration differed from another in it (a "
            "model that learned nothing, or a metric that does not move), so none is compared or recommended.")
    assert recommend(study) == [said]
    found = summarize(study.trials, study.history, None, study.objectives[0])
    assert found[0] == said, found
    assert not any("equivalent within" in s or "± 0.0" in s for s in found), found  # (no comparison follows it)


def test_a_command_a_sentence_marks_with_backticks_is_a_code_span_not_escaped_text():
    """The report's Markdown showed '\\`python sweeps/run.py --study accum_lr --no-fuse\\`': the sentence's own
    backticks escaped as if they were data. Paired, they make a code span (<code> in the HTML), whose content
    Markdown shows as it is; a stray backtick, or markup around the span, is still escaped."""
    from batchsweep.analysis.render import code, md

    said = "`python sweeps/run.py --study accum_lr --no-fuse` in a new folder times each trial alone"
    assert md(said) == said
    assert str(code(said)) == ("<code>python sweeps/run.py --study accum_lr --no-fuse</code> in a new folder times "
                               "each trial alone")
    assert md("a `x*y*` and <i>y</i>") == "a `x*y*` and \\<i\\>y\\</i\\>"
    assert str(code("a `x*y*` and <i>y</i>")) == "a <code>x*y*</code> and &lt;i&gt;y&lt;/i&gt;"
    assert md("a `<b>x</b>`") == "a \\`\\<b\\>x\\</b\\>\\`"  # (markup in a span stays escaped text)
    assert str(code("a `<b>x</b>`")) == "a `&lt;b&gt;x&lt;/b&gt;`"
    assert md("one ` stray and *this*") == "one \\` stray and \\*this\\*"
    assert md("`a | b`") == "\\`a \\| b\\`"  # (a '|' in a span would still split a table cell)


def test_the_runs_that_never_reached_the_target_are_counted_of_the_same_total_as_those_that_diverged():
    """At B = 256 of 6 runs, 1 diverged and 1 never reached the target: '1 of 6 at B = 256 diverged', then 'never
    reached it (1 of 5 at B = 256)', the diverged run left out of the second total unsaid."""
    from tests.test_critical import _one_diverged

    trials, history = _one_diverged()
    never = trials.loc[(trials["effective_batch"] == 256) & (trials["seed"] == 1), "run_id"]
    history = history.assign(val_acc=history["val_acc"].where(~history["run_id"].isin(never), 0.5))
    trials.loc[trials["run_id"].isin(never), "val_acc"] = 0.5
    [_, line] = steps(trials, history)
    assert line.startswith("Over every run (1 of 6 at B = 256 diverged, left out of the median and the fit"), line
    assert "never reached it (1 of 6 at B = 256, where 1 other diverged)" in line and "of 5" not in line, line


def test_the_bs_left_out_of_the_fit_are_told_apart_by_semicolons():
    """B = 256 with 1 run that diverged and 1 that never reached the target, B = 512 with 1 that never reached it:
    '(1 of 6 at B = 256, where 1 other diverged, 1 of 6 at B = 512)' read as one list of three."""
    from tests.test_critical import _one_diverged

    trials, history = _one_diverged()
    for b, seed in ((256, 1), (512, 2)):
        never = trials.loc[(trials["effective_batch"] == b) & (trials["seed"] == seed), "run_id"]
        history = history.assign(val_acc=history["val_acc"].where(~history["run_id"].isin(never), 0.5))
        trials.loc[trials["run_id"].isin(never), "val_acc"] = 0.5
    [_, line] = steps(trials, history)
    assert "never reached it (1 of 6 at B = 256, where 1 other diverged; 1 of 6 at B = 512)" in line, line
