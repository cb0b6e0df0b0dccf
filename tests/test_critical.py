"""The critical batch's interval: a t-interval on log B_crit over each seed's own fit, worded by which side of the Bs
fitted it passes (critical.py)."""
import numpy as np
import pandas as pd
import pytest

from batchsweep.analysis import critical

NONE_NOISE = pd.DataFrame(columns=["run_id", "seed", "noise"])


def _points(b_crits, sizes=(32, 64, 128, 256), s_min=80.0, runs=2, jitter=0.0, rng=None) -> pd.DataFrame:
    """Steps to the target S_min (1 + B_crit / B) per seed, each seed with its own B_crit, `runs` runs at each B."""
    rows = []
    for seed, b_crit in enumerate(b_crits):
        for b in sizes:
            for r in range(runs):
                noise = np.exp(rng.normal(0, jitter)) if rng is not None else 1.0
                rows.append(dict(seed=seed, effective_batch=b, steps=s_min * (1 + b_crit / b) * noise,
                                 run_id=f"{seed}-{b}-{r}"))
    return pd.DataFrame(rows)


def test_a_b_crit_whose_seeds_spread_past_the_bs_fitted_is_not_bounded_and_gives_no_point_estimate():
    """The default study's none: the seeds' own fits 358, 191 and 172 (their geometric mean about 225, inside the Bs
    fitted) have a 95% t-interval of about 85 to 615, past B = 256: B_crit is not bounded above, and no 'B_crit ≈'
    is printed as a finding (it read 'B_crit ≈ 225 (no interval ...)')."""
    said = critical.reading(_points([358, 191, 172]), NONE_NOISE)
    assert "B_crit ≈" not in said, said
    assert ("B_crit is not bounded above by the Bs fitted: its interval reaches past the largest B fitted (256) "
            "(each seed's own fit 358, 191, 172, 95% t-interval over the 3 seeds (on log B_crit) 85 to 609") in said, \
        said


def test_series_whose_seeds_fits_overlap_are_worded_alike():
    """Three series whose pooled fits are 225, 375 and 343 (about the default study's none, sqrt, linear) and whose
    seeds' intervals all pass B = 256: each reads 'not bounded above' (one read 'B_crit ≈ 225', the others 'the fit
    cannot bound it')."""
    for seeds in ([358, 191, 172], [477, 281, 401], [456, 382, 247]):
        said = critical.reading(_points(seeds), NONE_NOISE)
        assert "B_crit is not bounded above by the Bs fitted: its interval reaches past the largest B fitted" in said, \
            said


def test_a_b_crit_inside_the_bs_fitted_is_given_with_its_seeds_interval():
    said = critical.reading(_points([100, 110, 120], sizes=(32, 64, 128, 256, 512)), NONE_NOISE)
    assert "B_crit ≈ 110 (each seed's own fit 100, 110, 120, 95% t-interval over the 3 seeds (on log B_crit) 87 " \
           "to 138; S_min ≈ 80 steps over every run; from 30 runs at B = 32 to 512)" in said, said


def test_the_interval_of_b_crit_covers_95_percent_with_five_seeds():
    """Each seed's B_crit drawn around 150 (log sd 0.25), steps with 5% noise, 5 seeds: the 95% interval must hold
    150 in about 95% of studies; a bootstrap over the 5 seeds held it in about 84%."""
    rng = np.random.default_rng(7)
    held = 0
    for _ in range(200):
        points = _points(150 * np.exp(rng.normal(0, 0.25, size=5)), sizes=(32, 64, 128, 256, 512), s_min=50,
                         jitter=0.05, rng=rng)
        f = critical.critical(points)
        held += f.lo <= 150 <= f.hi
    assert 0.92 <= held / 200 <= 0.98, held


def test_a_b_where_half_the_runs_never_reached_the_target_gives_their_count():
    """At B = 512 two of four seeds never reached the target: the sentence counts them ('2 of 4'), where it said
    'most runs never reached it' of half."""
    from batchsweep.analysis.targets import steps

    rows, history = [], []
    for seed in range(4):
        for b in (32, 64, 128, 256, 512):
            run = f"r{len(rows)}"
            rows.append(dict(run_id=run, seed=seed, lr_rule="sqrt", physical_batch=32, accum_steps=b // 32,
                             effective_batch=b, base_batch=32, status="FINISHED", val_acc=0.95))
            never = b == 512 and seed < 2
            history += [dict(run_id=run, epoch=e, steps=e * 32000 // b, noise_scale=100.0, noise_scale_reliable=1.0,
                             val_acc=0.5 if never else min(0.95, 0.5 + 0.45 * e / (2 + b / 64)))
                        for e in range(1, 11)]
    [_, line] = steps(pd.DataFrame(rows), pd.DataFrame(history))
    assert line.startswith("Over every run (at B = 512, 2 of 4 runs never reached it: half or more, left out of the "
                           "fit)"), line
    assert "most runs" not in line, line
    # The 2 runs at B = 512 that reached it are no part of the noise scale's median: said so.
    assert "(median of the 16 runs at the Bs not left out that measured it there" in line, line


def _reaching(b_crits, sizes=(32, 64, 128, 256)):
    """Trials and a history in which each seed's run at B first reaches 95% at 80 (1 + B_crit / B) steps."""
    trials, history = [], []
    for seed, b_crit in enumerate(b_crits):
        for b in sizes:
            run = f"{seed}-{b}"
            trials.append(dict(run_id=run, seed=seed, lr_rule="sqrt", physical_batch=b, accum_steps=1,
                               effective_batch=b, base_batch=32, status="FINISHED", val_acc=0.95))
            history += [dict(run_id=run, epoch=1, steps=round(80 * (1 + b_crit / b)), val_acc=0.95),
                        dict(run_id=run, epoch=2, steps=round(160 * (1 + b_crit / b)), val_acc=0.95)]
    return pd.DataFrame(trials), pd.DataFrame(history)


@pytest.mark.parametrize("b_crits, drawn", [([358, 191, 172], False), ([100, 110, 120], True)])
def test_the_figure_draws_the_fit_only_where_the_sentence_gives_b_crit(b_crits, drawn):
    """The seeds' fits 358, 191, 172 leave B_crit unbounded above B = 256, so the figure draws no fitted curve (it
    drew the pooled fit, 225, inside the Bs); 100, 110, 120 bound it, and the curve is drawn."""
    import matplotlib.pyplot as plt

    from batchsweep.analysis.figures import steps_vs_batch

    figure = steps_vs_batch(*_reaching(b_crits))
    dotted = [line for line in figure.figure.axes[0].get_lines() if line.get_linestyle() == ":"]
    plt.close(figure.figure)
    assert bool(dotted) == drawn, dotted


def test_an_end_of_b_crits_interval_is_never_shown_on_a_b_fitted_it_lies_past():
    """An interval ending at 256.3 reaches past B = 256: shown as '256' it would read as ending on it."""
    assert critical._beside(256.3, [32, 256]) == "256.3" and critical._beside(31.96, [32, 256]) == "31.96"
    assert critical._beside(609.2, [32, 256]) == "609" and critical._beside(256.0, [32, 256]) == "256"


def test_a_seed_whose_own_fit_lies_at_the_search_bound_gives_no_interval_and_no_number_from_the_bound():
    """Seeds 100, 120 and one whose steps fall as 1/B at every B (its own fit at the search's upper bound, 64 x the
    largest B): it entered the t-interval as a measurement ('above 32,768 ... 95% t-interval ... 0 to 2,591,350');
    that seed's fit is not bounded above, so neither is B_crit, and no interval or number from the bound is said."""
    said = critical.reading(_points([100, 120, 1e7], sizes=(32, 64, 128, 256, 512)), NONE_NOISE)
    assert "t-interval" not in said and "32,768" not in said and "B_crit ≈" not in said, said
    assert ("B_crit is not bounded above: seed 2's own fit lies at the search's bound (B_crit past 64 times the "
            "largest B it ran), so it is not bounded above, and neither is B_crit (each seed's own fit 100, 120, not "
            "bounded above; from 30 runs at B = 32 to 512)") in said, said
    f = critical.critical(_points([100, 120, 1e7], sizes=(32, 64, 128, 256, 512)))
    assert f.sides == [0, 0, 1] and np.isnan(f.lo) and np.isnan(f.hi), f


def test_a_seed_whose_own_fit_lies_at_the_lower_bound_leaves_b_crit_not_bounded_below():
    """A seed whose steps do not fall with B at all fits at the search's lower bound (the smallest B / 64)."""
    rows = _points([100, 120], sizes=(32, 64, 128, 256, 512))
    flat = _points([0.0], sizes=(32, 64, 128, 256, 512)).assign(seed=2)
    said = critical.reading(pd.concat([rows, flat]), NONE_NOISE)
    assert "t-interval" not in said and "0.5" not in said, said
    assert "seed 2's own fit lies at the search's bound (B_crit below the smallest B it ran / 64), so it is not " \
           "bounded below, and neither is B_crit" in said, said


def test_an_end_of_the_interval_below_one_is_shown_with_significant_digits():
    """A low end of 0.21 printed '0', which on a log scale is no value."""
    assert critical._beside(0.2099, [32, 512]) == "0.21"
    assert critical._beside(0.00757, [32, 512]) == "0.0076"
    assert critical._beside(5.34, [32, 512]) == "5.3"
    assert critical._beside(256.3, [32, 256]) == "256.3"
    assert critical._beside(609.4, [32, 256]) == "609"


def _diverging(b_crits, diverged=4, sizes=(32, 64, 128, 256, 512)):
    """_reaching over `sizes`, with the first `diverged` seeds' runs at the largest B diverged (no run reached the
    target there before it did)."""
    trials, history = _reaching(b_crits, sizes)
    top = (trials["effective_batch"] == max(sizes)) & (trials["seed"] < diverged)
    trials["reason"] = None
    trials.loc[top, ["status", "reason", "val_acc"]] = ["FAILED", "diverged", float("nan")]
    history = history[~history["run_id"].isin(trials.loc[top, "run_id"])]
    return trials, history


def test_runs_that_diverged_are_counted_apart_and_argue_nothing_of_b_crit():
    """At B = 512 4 of 6 runs diverged: they were read as censored, 'runs beyond it never reached the target in their
    epochs (4 of 6 at B = 512), which argues against a B_crit far above 256'; a divergence says nothing of B_crit."""
    from batchsweep.analysis.targets import steps

    [_, line] = steps(*_diverging([400, 300, 500, 350, 450, 380]))
    assert line.startswith("Over every run (at B = 512, 4 of 6 runs diverged: half or more, left out of the fit)"), \
        line
    assert "argues against" not in line and "never reached the target in their epochs" not in line, line
    assert "B_crit is not bounded above" in line, line


def test_the_steps_figure_counts_the_runs_the_sentence_counts():
    """With 4 of 6 runs at B = 512 diverged, the sentence leaves B = 512 out of the fit and gives no point there; the
    figure drew a B = 512 point from the 2 finished runs and fitted 32 to 512."""
    import matplotlib.pyplot as plt

    from batchsweep.analysis.figures import steps_vs_batch

    figure = steps_vs_batch(*_diverging([100, 110, 120, 100, 110, 120]))
    lines = figure.figure.axes[0].get_lines()
    plt.close(figure.figure)
    [points] = [line for line in lines if line.get_marker() == "o"]
    assert max(points.get_xdata()) == 256, points.get_xdata()
    [dotted] = [line for line in lines if line.get_linestyle() == ":"]
    assert max(dotted.get_xdata()) == pytest.approx(256), dotted.get_xdata()


def test_a_last_doubling_outside_the_fit_is_named_as_such():
    """A run at B = 512 never reached the target: 512 counts in the doublings but not in the fit (32 to 256), and
    'the last doubling took the steps to ...' quoted the 256 to 512 doubling as if it were the fit's last."""
    points = _points([400, 300, 500], sizes=(32, 64, 128, 256, 512)).iloc[:-1]  # (its run at 512 is censored)
    said = critical.reading(points, NONE_NOISE, censored=[512])
    assert "from 24 runs at B = 32 to 256" in said and "(1 of 6 at B = 512)" in said and "B_crit is not bounded above" in said, said
    assert ": the last doubling (from 256 to 512, outside the fit) took the steps to " in said, said


def _one_diverged(b=256):
    """Six seeds whose runs all reach the target from B = 32 to 512 but seed 0's at `b`, which diverged first."""
    trials, history = _reaching([100, 110, 120, 100, 110, 120], (32, 64, 128, 256, 512))
    gone = (trials["effective_batch"] == b) & (trials["seed"] == 0)
    trials["reason"] = None
    trials.loc[gone, ["status", "reason", "val_acc"]] = ["FAILED", "diverged", float("nan")]
    return trials, history[~history["run_id"].isin(trials.loc[gone, "run_id"])]


def test_a_run_that_diverged_where_most_reached_the_target_is_counted_apart_and_keeps_its_b_in_the_fit():
    """One of 6 runs at B = 256 diverged: it was read as a run that ran out of epochs ('a run that never reached it
    counted as slower than every run that did: 1 run at B = 256', 'B = 256 left out of the fit'). A divergence says
    nothing of the steps to the target: it is counted apart, out of the median, and B = 256 stays in the fit."""
    from batchsweep.analysis.targets import steps, to_target

    [_, line] = steps(*_one_diverged())
    assert line.startswith("Over every run (1 of 6 at B = 256 diverged, left out of the median and the fit: a "
                           "divergence says nothing of the steps to the target)"), line
    assert "never reached" not in line and "left out of the fit, as" not in line, line
    assert "from 29 runs at B = 32 to 512" in line and "B_crit ≈ " in line, line
    [series] = to_target(*_one_diverged()).series
    assert series.medians("steps")[256] == round(80 * (1 + 110 / 256)), series.medians("steps")
    assert series.fit().sizes == [32, 64, 128, 256, 512] and series.out_of_fit == [], series.out_of_fit


def test_the_steps_figure_leaves_a_run_that_diverged_out_of_its_median():
    """The figure's median at B = 256 counted the diverged run as slowest (between the 3rd and 4th of 6 runs); it is
    the median of the 5 runs that did not diverge, as the sentence reads it."""
    import matplotlib.pyplot as plt

    from batchsweep.analysis.figures import steps_vs_batch

    figure = steps_vs_batch(*_one_diverged())
    lines = figure.figure.axes[0].get_lines()
    plt.close(figure.figure)
    [points] = [line for line in lines if line.get_marker() == "o"]
    assert list(points.get_xdata()) == [32, 64, 128, 256, 512], points.get_xdata()
    assert points.get_ydata()[3] == round(80 * (1 + 110 / 256)), points.get_ydata()
    [dotted] = [line for line in lines if line.get_linestyle() == ":"]
    assert max(dotted.get_xdata()) == pytest.approx(512), dotted.get_xdata()


def test_bs_two_doublings_apart_are_said_so_with_the_share_over_them():
    """bn_momentum's only Bs reached, 32 and 128: 'each doubling of B took the median steps to 0.55 of the B
    before', where 625 -> 192 steps is 0.31 over two doublings."""
    said = critical.reading(_points([100, 110, 120], sizes=(32, 128)), NONE_NOISE)
    assert "each doubling" not in said, said
    assert said.startswith("from B = 32 to 128 (two doublings) the median steps went to 0.42 of B = 32's (0.65 a "
                           "doubling); "), said


def test_a_last_step_of_two_doublings_past_the_fit_is_said_so():
    """B_crit not bounded above, the last Bs 128 and 512: 'the last doubling took the steps to 0.74 of the B
    before' named a per-doubling share as the step from 128 to 512."""
    said = critical.reading(_points([358, 191, 172], sizes=(32, 64, 128, 512)), NONE_NOISE)
    assert "the last doubling" not in said, said
    assert ("from B = 128 to 512 (two doublings) the median steps went to 0.55 of B = 128's (0.74 a doubling); "
            in said), said
    assert (": from B = 128 to 512 (two doublings) the steps went to 0.55 of B = 128's (0.74 a doubling; 0.50 is "
            "perfect scaling, 1 none)") in said, said


def _steps(per_b: dict, before: dict | None = None) -> pd.DataFrame:
    """One run per seed at each B with the steps given (`before`: the steps at the evaluation before, per B)."""
    return pd.DataFrame([dict(seed=seed, effective_batch=b, steps=s, run_id=f"{seed}-{b}",
                              before=(before or {}).get(b, [s - 1] * len(steps))[seed])
                         for b, steps in per_b.items() for seed, s in enumerate(steps)])


def test_the_share_over_bs_not_a_power_of_2_apart_is_the_medians_own_ratio():
    """From B = 32 to 96 the medians 330 -> 163 are 0.494 of B = 32's: it read 0.50, the per-doubling rate raised back
    to 1.58 (a rounded log2 3) instead of the medians' ratio; likewise in the mixed sentence and the last step past
    the fit."""
    plain = critical.reading(_steps({32: [330] * 3, 96: [163] * 3, 288: [108] * 3}), NONE_NOISE)
    assert plain.startswith("from B = 32 to 96 (1.58 doublings) the median steps went to 0.49 of B = 32's (0.64 a "
                            "doubling); "), plain
    mixed = critical.reading(_steps({32: [330] * 3, 96: [163] * 3, 288: [108] * 3}, before={288: [20] * 3}),
                             NONE_NOISE)
    assert "0.64 at B = 96 (a doubling's share from B = 32, 1.58 doublings: 0.49 over them)" in mixed, mixed
    beyond = critical.reading(_steps({32: [800, 700, 900], 64: [500, 420, 560], 96: [330, 390, 300],
                                      288: [163, 210, 150]}), NONE_NOISE)
    assert ("B_crit is not bounded above by the Bs fitted: its interval reaches past the largest B fitted (288)"
            in beyond), beyond
    assert (": from B = 96 to 288 (1.58 doublings) the steps went to 0.49 of B = 96's (0.64 a doubling; 0.50 is "
            "perfect scaling, 1 none)") in beyond, beyond
