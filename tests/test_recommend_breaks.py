"""The recommendation's sentences that said more than the measurements show, each reproduced on a small trial
table: a pick pooled over twins that differ, a front ranked on other seeds than the best, bitwise copies counted
as configurations, a margin that moves with the metric's zero, lines missing where a B diverged, an LR search at
one B, a best over two models, and values read back as strings."""
import numpy as np
import pandas as pd
import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.render import _table
from batchsweep.analysis.runs import AnalysisError
from batchsweep.analysis.space import memory_front
from tests.test_recommend_edges import _rows, _study

VARIED = ("physical_batch", "accum_steps", "lr_rule")


def test_where_the_twins_differ_each_half_of_a_b_is_picked_on_its_own():
    """BatchNorm makes accumulation 2 to 7 points worse than its true-batch twin at B = 128. In the true-batch half
    sqrt is best (97%, none 95%), in the accumulated half none (93%, sqrt 90%): pooled, none read as the rule to use
    at B = 128 while the best line named b = 128, k = 1, sqrt."""
    level = {("none", 1): 0.95, ("sqrt", 1): 0.97, ("linear", 1): 0.92,
             ("none", 4): 0.93, ("sqrt", 4): 0.90, ("linear", 4): 0.92}
    rows = _rows(lambda s, rule, b, k: 0.94 + 0.001 * s if b * k == 32 else level[(rule, k)] + 0.001 * s)
    lines = recommend(_study(rows, VARIED))
    [at_128] = [line for line in lines if line.startswith("At B = 128")]
    assert not at_128.startswith("At B = 128: the none LR rule"), at_128
    assert at_128.startswith("At B = 128, accumulation and the true batch were resolved apart (below), so each half is "
                             "picked on its own: accumulated (b = 32, k = 4): the none LR rule (93."), at_128
    assert "; true batch (b = 128, k = 1): the sqrt LR rule (97." in at_128, at_128
    assert "against B = 32 (this half alone): 3.0 points higher" in at_128, at_128
    [best] = [line for line in lines if line.startswith("The best")]
    assert best.startswith("The best accuracy: b = 128, k = 1, sqrt ("), best


def _starred_top(study) -> str:
    [best] = [line for line in recommend(study) if line.startswith("The best")]
    return best.removeprefix("The best accuracy: ").split(" (9")[0]


def test_the_memory_front_ranks_on_every_seed_as_the_best_line_does():
    """sqrt at B = 128 reads 96% in seeds 0 and 1 and 90% in seed 2, where its peak memory was not measured; B = 32
    reads 95% in every seed. Over the 3 seeds the best is B = 32; the front dropped the trial with no memory, ranked
    on seeds 0 and 1 and named sqrt at B = 128 best."""
    def values(seed, rule, b, k):
        if b * k == 32:
            return 0.95 + 0.001 * seed
        return (0.96 if seed < 2 else 0.90) if rule == "sqrt" and b == 128 else 0.93 + 0.001 * seed

    rows = [{**r, "peak_memory_bytes": np.nan if (r["lr_rule"], r["physical_batch"], r["seed"]) == ("sqrt", 128, 2)
             else 1e5 * r["physical_batch"]} for r in _rows(values)]
    study = _study(rows, VARIED)
    top = _starred_top(study)
    assert top == "b = 32, k = 1, every LR rule (B = base_batch)", top
    finding = memory_front(study).finding
    assert finding.startswith(f"Against peak memory, the best mean of the 7 configurations was {top} ("), finding
    rows = [{**r, "peak_memory_bytes": np.nan} if r["effective_batch"] == 32 else r for r in rows]
    finding = memory_front(_study(rows, VARIED)).finding  # (no memory at all for the best: left out, and said)
    assert finding.endswith("Left out, no peak memory measured in any seed: b = 32, k = 1, every LR rule "
                            "(B = base_batch)."), finding


def _bn_rows(values) -> list[dict]:
    """bn_momentum's design: b = 32 at k = 1, 4, 16 under three BN momentum rules, and the true-batch twins."""
    rows = []
    for seed in range(3):
        for bn in ("default", "scaled", "matched"):
            for b, k in ((32, 1), (32, 4), (32, 16), (128, 1), (512, 1)):
                rows.append(dict(seed=seed, bn_momentum_rule=bn, physical_batch=b, accum_steps=k,
                                 effective_batch=b * k, base_batch=32, lr_rule="sqrt", status="FINISHED",
                                 val_acc=round(values(seed, bn, b, k), 3)))
    return rows


def test_bn_momentum_rules_at_k_1_are_one_configuration():
    """At k = 1 every BN momentum rule is the default momentum: the three runs per seed are bitwise copies. They
    were three configurations: in the best's ties, in its Benjamini-Hochberg family (14 comparisons for 9
    configurations) and in the trials table's ★."""
    rows = _bn_rows(lambda s, bn, b, k: 0.96 + 0.001 * s if b * k == 32 else 0.95 - 0.01 * (k > 1) + 0.001 * s)
    study = _study(rows, ("physical_batch", "accum_steps", "bn_momentum_rule"))
    [best] = [line for line in recommend(study) if line.startswith("The best")]
    assert best.startswith("The best accuracy: b = 32, k = 1, every BN momentum rule (k = 1) (96.1% over 3 seeds, "
                           "the highest of 9 configurations"), best
    assert best.endswith("Benjamini-Hochberg at 5% over 8 comparisons."), best
    assert "k = 1, BN " not in best, best


def _loss_study(offset: float):
    """linear loses 0.004 in val_loss per doubling of B, none 0.03; `offset` is added to every value."""
    rng, rows = np.random.default_rng(7), []
    for seed in range(3):
        for rule in ("none", "linear"):
            for k in (1, 2, 4, 8):
                loss = 0.3 + (0.004 if rule == "linear" else 0.03) * np.log2(k) + rng.normal(0, 0.001)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=32, accum_steps=k, effective_batch=32 * k,
                                 base_batch=32, status="FINISHED", val_loss=offset + loss))
    return _study(rows, VARIED, ("val_loss", "minimize"))


def test_the_margin_of_a_metric_of_its_own_is_1_percent_of_the_reference_and_a_rise_inside_it_is_said():
    """The same losses, and the same losses plus 10: δ is 1% of B = 32's mean, 0.003 and 0.103, as the last line
    says. With the offset none's resolved 0.09 rise at B = 256 lies inside δ: the line gives the rise with its
    interval, never 'equivalent' alone."""
    lines = {offset: recommend(_loss_study(offset)) for offset in (0.0, 10.0)}
    free = {offset: next(line for line in said if "shown to cost less than" in line) for offset, said in lines.items()}
    assert free[0.0].startswith("No B above the smallest was shown to cost less than 0.003 in val_loss"), free[0.0]
    assert free[10.0].startswith("The largest B shown to cost less than 0.1 in val_loss together with every B below "
                                 "it: B = 256 under the none LR rule, val_loss 0.0900 higher, 95% CI +0.0878 to "
                                 "+0.0922 over 3 seeds;"), free[10.0]
    assert "inside the ±0.1 in val_loss equivalence margin" in free[10.0] and "equivalent within" not in free[10.0]
    for offset, said in lines.items():
        assert said[-1].startswith(f"In these lines ±{0.003 + offset / 100:.1g} in val_loss is the equivalence margin "
                                   f"δ: 1% of B = 32's mean {0.3 + offset:.2g} (the smallest B"), said[-1]
    findings = summarize(_loss_study(10.0).trials, None, None, ("val_loss", "minimize"))
    assert any("is the equivalence margin δ: 1% of B = 32's mean 10" in s for s in findings), findings


def test_a_b_where_every_rule_diverged_and_a_pick_at_its_rules_smallest_b_each_get_their_line():
    """At B = 512 none diverged in every seed, sqrt in seed 2 and linear in seeds 1 and 2; linear ran from B = 64
    up, and is picked at B = 64, 1 point above sqrt. Neither B had a line in the block."""
    def status(seed, rule, b, k):
        lost = {"none": (0, 1, 2), "sqrt": (2,), "linear": (1, 2)}[rule]
        return "diverged" if b * k == 512 and seed in lost else None

    rows = []
    for seed in range(3):
        for rule, bs in (("none", ((32, 1), (32, 4), (128, 1), (32, 16), (512, 1))),
                         ("sqrt", ((32, 1), (64, 1), (32, 4), (128, 1), (32, 16), (512, 1))),
                         ("linear", ((64, 1), (32, 4), (128, 1), (32, 16), (512, 1)))):
            for b, k in bs:
                why = status(seed, rule, b, k)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if why else "FINISHED", reason=why,
                                 val_acc=np.nan if why else round(0.95 - 0.002 * np.log2(b * k) + 0.001 * seed
                                                                  + 0.01 * (rule == "linear"), 3)))
    lines = recommend(_study(rows, VARIED))
    [at_512] = [line for line in lines if line.startswith("At B = 512")]
    assert at_512 == ("At B = 512: every LR rule diverged in a seed (none diverged in 3 of 3 seeds, sqrt diverged in 1 "
                      "of 3 seeds and linear diverged in 2 of 3 seeds), so none is picked there."), at_512
    [at_64] = [line for line in lines if line.startswith("At B = 64")]
    assert at_64.startswith("At B = 64: the linear LR rule (") and "B = 64 is the smallest B the linear LR rule ran, so " \
        "what it costs against a smaller B is not measured" in at_64, at_64


def _lr_search(seeds=range(3)):
    rng, rows = np.random.default_rng(0), []
    for seed in seeds:
        for lr in (0.0125, 0.025, 0.05, 0.1, 0.2):
            rows.append(dict(seed=seed, physical_batch=128, accum_steps=1, effective_batch=128, base_lr=lr, lr=lr,
                             lr_rule="none", base_batch=128, status="FINISHED",
                             val_acc=round(0.95 - 0.02 * abs(np.log2(lr / 0.05)) + rng.normal(0, 0.002), 3)))
    return _study(rows, ("base_lr",))


def test_an_lr_search_at_one_b_says_what_it_can():
    """A search of the LR at B = 128 alone: the block was empty (the LR against B needs 2 Bs)."""
    [line] = recommend(_lr_search())
    assert line.startswith("This LR search ran one B (B = 128), so it cannot say how the learning rate should change "
                           "with B: that needs the search at 2 Bs or more. At B = 128: the best accuracy: base_lr = "
                           "0.05 (94.9% over 3 seeds, the highest of 5 configurations"), line
    [line] = recommend(_lr_search(seeds=(0,)))
    assert line.startswith("This LR search ran one B (B = 128)") and "--seeds 3`" in line, line


def test_the_trials_table_stars_each_models_best():
    """On mlp every configuration is near 97%; on cnn sqrt at b = 128 leads at 90%, the rest at 80%. The block speaks
    per model, but the ★ was computed over the pooled study: cnn's best, below every mlp configuration, had none."""
    rng, rows = np.random.default_rng(4), []
    for seed in range(3):
        for model in ("cnn", "mlp"):
            for rule in ("sqrt", "linear"):
                for b, k in ((32, 1), (32, 4), (128, 1)):
                    v = 0.97 if model == "mlp" else 0.90 if (rule, b) == ("sqrt", 128) else 0.80
                    rows.append(dict(seed=seed, model=model, lr_rule=rule, physical_batch=b, accum_steps=k,
                                     effective_batch=b * k, base_batch=32, status="FINISHED",
                                     val_acc=round(v + rng.normal(0, 0.002), 3)))
    study = _study(rows, ("model", "physical_batch", "accum_steps", "lr_rule"))
    table = _table(study)
    marked = study.trials.loc[table.index[table["best or not told apart"] == "★"]]
    cnn = {(r.lr_rule, r.physical_batch, r.accum_steps) for r in marked[marked["model"] == "cnn"].itertuples()}
    assert cnn == {("sqrt", 128, 1)}, cnn
    [best] = [line for line in recommend(study) if line.startswith("On cnn: the best")]
    assert best.startswith("On cnn: the best accuracy: b = 128, k = 1, sqrt ("), best
    assert set(marked.loc[marked["model"] == "mlp", "lr_rule"]) and len(marked) < len(study.trials)


def test_numbers_read_back_as_text_are_converted_and_a_metric_that_is_not_a_number_is_refused_in_one_line():
    """MLflow gives params back as strings, and a trials.csv read as text holds its metrics as strings: the block
    and the findings raised TypeError ("dtype 'str' does not support operation 'mean'")."""
    rows = _rows(lambda s, rule, b, k: 0.95 + 0.001 * s - 0.01 * (b * k > 32))
    typed = recommend(_study(rows, VARIED))
    text = [{**r, **{f: str(r[f]) for f in ("val_acc", "physical_batch", "seed")}} for r in rows]
    assert recommend(_study(text, VARIED)) == typed
    assert summarize(pd.DataFrame(text)) == summarize(pd.DataFrame(rows))
    text[0]["val_acc"] = "n/a"
    with pytest.raises(AnalysisError) as refused:
        _study(text, VARIED)
    assert str(refused.value) == ("val_acc holds values that are not numbers (such as 'n/a'): log val_acc as a number "
                                  "(mlflow.log_metric), then make the report again")


def test_the_largest_b_shown_free_is_not_a_pool_of_two_halves_that_differ():
    """none at B = 128 is 1 point below B = 32 accumulated and 1 point above it as the true batch: pooled, it read
    "shown to cost less than 1 point" (+0.0 ± 0.1), which holds for neither half."""
    level = {("none", 1): 0.95, ("sqrt", 1): 0.97, ("linear", 1): 0.92,
             ("none", 4): 0.93, ("sqrt", 4): 0.90, ("linear", 4): 0.92}
    rows = _rows(lambda s, rule, b, k: 0.94 + 0.001 * s if b * k == 32 else level[(rule, k)] + 0.001 * s)
    [free] = [line for line in recommend(_study(rows, VARIED)) if "cost less than" in line]
    assert "B = 128 under the none LR rule, equivalent" not in free, free
    assert free.startswith("No B above the smallest was shown to cost less than 1 point"), free
    assert "(in its accumulated half: accumulation and the true batch were resolved apart there)" in free, free


def test_a_b_whose_twins_differ_with_no_half_to_pick_from_says_so():
    """Only none ran B = 128, where accumulation is 2 points below its twin: no rule to pick in either half."""
    rows = [r for r in _rows(lambda s, rule, b, k: 0.95 + 0.001 * s - 0.02 * (k > 1))
            if r["lr_rule"] != "linear" and (r["lr_rule"] == "none" or r["effective_batch"] == 32)]
    [at_128] = [line for line in recommend(_study(rows, VARIED)) if line.startswith("At B = 128")]
    assert at_128.startswith("At B = 128: accumulation and the true batch were resolved apart, and neither half has "
                             "2 LR rules finished in 2 shared seeds to pick from; accumulating (b = 32, k = 4"), at_128


def test_a_fused_study_says_why_it_gives_no_time_to_the_target():
    """Fused trials log their group's time (group_epoch_time_s), not their own: the block left the time line out
    without a word."""
    rows = _rows(lambda s, rule, b, k: 0.95 + 0.001 * s)
    for i, r in enumerate(rows):
        r["run_id"] = f"r{i}"
    study = _study(rows, VARIED)
    study.history = pd.DataFrame([dict(run_id=r["run_id"], epoch=e, val_acc=0.95 * e / 2, group_epoch_time_s=3.0)
                                  for r in rows for e in (1, 2)])
    [line] = [line for line in recommend(study) if "time to the target" in line]
    assert line.startswith("No time to the target is given: every one of the 27 trials trained fused (several "
                           "configurations at once in one process), each with its group's time, not its own"), line
    assert line.endswith("--study s --no-fuse` in a new folder times each trial alone."), line


def test_the_throughput_figure_draws_only_trials_timed_alone_and_says_how_many():
    """79 of 81 trials of a fused study log their group's samples/s: the figure drew two points under the caption
    "81 trials", with a legend of k values that had none."""
    from batchsweep.analysis.figures import throughput

    rows = _rows(lambda s, rule, b, k: 0.95)
    for r in rows:
        r["samples_per_s"] = 1e4 * r["physical_batch"] / 128 if r["accum_steps"] == 1 and r["seed"] == 0 else np.nan
    figure = throughput(pd.DataFrame(rows))
    assert figure.title.endswith("(6 of 27 finished trials timed alone; fused trials have only their group's time)")
    assert figure.context.endswith("; 6 trials"), figure.context
    for r in rows:
        r["samples_per_s"] = np.nan if r["physical_batch"] == 128 else r["samples_per_s"]
    assert throughput(pd.DataFrame(rows)) is None  # (one b measured: nothing against b)
