"""Steps to the target per BN momentum rule (targets.py): at k = 1 every rule is the default momentum, which the
grid runs under default alone, so the runs at B = 32 count in every rule's series, once a seed, and the true
batches at every B are a series of their own, not blended into one rule's."""
import pandas as pd

from batchsweep.analysis.figures import steps_vs_batch
from batchsweep.analysis.targets import steps
from tests.test_report_no_batchnorm import _bn_grid, _history
from tests.test_report_zipped import _zipped


def _lines(rows: list[dict]) -> dict[str, str]:
    said = steps(pd.DataFrame(rows), _history(rows))
    return {s.removeprefix("For ").split(",")[0].split(" (")[0]: s for s in said if s.startswith("For ")}


def test_the_runs_at_k_1_count_in_every_bn_rule_s_series():
    """bn_momentum: 'For scaled (...), only B = 128 reached it; B_crit could not be fitted', where B = 32 (under
    default) is scaled's start as much as default's; and default's series blended its accumulated runs with the
    true batches at 128 and 512, scaled's not."""
    lines = _lines(_bn_grid("cnn1d", "batch", False, measured=True))
    assert set(lines) == {"default", "scaled", "matched", "true batch"}, lines
    for rule, line in lines.items():
        assert "from 9 runs at B = 32 to 512" in line, line


def test_a_bn_rule_s_series_is_its_own_runs_not_a_blend_with_the_true_batch_s():
    """scaled's accumulated runs took twice the steps: its medians (298 and 194 at B = 128 and 512) read 219.5 and
    145.5, each the mean of its runs' and the shared true batch's middle values. Where the grid ran k = 1 under
    every rule's label, each run counts once (it counted 3 times: 'from 33 runs')."""
    from batchsweep.analysis.targets import to_target
    from tests.test_report_no_batchnorm import _history

    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    history = _history(rows)
    slow = {r["run_id"] for r in rows if r["bn_momentum_rule"] == "scaled" and r["accum_steps"] > 1}
    history.loc[history["run_id"].isin(slow), "steps"] *= 2
    series = {s.group[0]: s for s in to_target(pd.DataFrame(rows), history).series}
    assert dict(series["scaled"].medians("steps"))[128] == 2 * dict(series["default"].medians("steps"))[128]
    assert list(series["true batch"].medians("steps").index) == [32, 128, 512]
    every = [{**r, "bn_momentum_rule": rule, "run_id": r["run_id"] + rule} if r["accum_steps"] == 1 else r
             for r in rows for rule in (("default", "scaled", "matched") if r["accum_steps"] == 1 else (None,))]
    lines = _lines(every)
    assert all("from 9 runs at B = 32 to 512" in line for line in lines.values()), lines



def test_a_bn_rule_zipped_with_the_weight_decay_counts_the_runs_at_k_1_at_its_own():
    """Each rule with its own weight decay, every k = 1 run labelled default and no varied fields known: each
    rule's series holds the k = 1 runs at its weight decay alone (3 at B = 32), not every one's (9)."""
    lines = _lines([{**r, "val_acc": r["val_acc"] + 0.1 * (r["weight_decay"] > 0)} for r in _zipped()])
    assert set(lines) == {"default", "scaled", "matched", "true batch at default's settings",
                          "true batch at scaled's settings", "true batch at matched's settings"}, lines
    for rule, line in lines.items():
        assert "from 9 runs at B = 32 to 512" in line, line


def test_the_steps_figure_draws_every_bn_rule_from_b_32():
    """The figure drew scaled and matched from B = 128 (their k = 1 runs given to default alone)."""
    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    figure = steps_vs_batch(pd.DataFrame(rows), _history(rows))
    drawn = {line.get_label(): list(line.get_xdata()) for line in figure.figure.axes[0].get_lines()}
    for rule in ("default", "scaled", "matched", "true batch"):
        assert drawn[rule] == [32, 128, 512], drawn


def test_each_bn_rule_starts_at_its_own_b_and_a_true_batch_at_one_b_is_no_series():
    """matched accumulated from b = 128, default and scaled from b = 32: default's B = 128 read 219.5, its k = 4
    runs (298) blended with the true batch's there (149), and matched's series started at B = 32. Where k = 1 ran
    at B = 32 alone, 'For true batch, only B = 32 reached it' was said of a B no other true batch ran beside."""
    from batchsweep.analysis.targets import to_target
    from tests.test_report_no_batchnorm import _history

    rows = [r for r in _bn_grid("cnn1d", "batch", False, measured=True) if r["bn_momentum_rule"] != "matched"]
    for seed in (0, 1, 2):
        four = next(r for r in rows if r["seed"] == seed and r["accum_steps"] == 4)
        rows.append({**four, "physical_batch": 128, "effective_batch": 512, "bn_momentum_rule": "matched",
                     "run_id": f"m{seed}"})
    history = _history(rows)
    accumulated = {r["run_id"] for r in rows if r["accum_steps"] > 1}
    history.loc[history["run_id"].isin(accumulated), "steps"] *= 2
    series = {s.group[0]: s.medians("steps") for s in to_target(pd.DataFrame(rows), history).series}
    assert series["default"][128] == 2 * series["true batch"][128], series
    assert list(series["matched"].index) == [128, 512], series
    rows = [r for r in _bn_grid("cnn1d", "batch", False, measured=True)
            if r["effective_batch"] == 32 or r["accum_steps"] > 1]
    assert "true batch" not in _lines(rows), _lines(rows)


def test_the_steps_figure_draws_the_true_batches_apart_from_the_reference_line():
    """The true batches' series was drawn in the gray of 'perfect scaling', with its circles."""
    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    figure = steps_vs_batch(pd.DataFrame(rows), _history(rows))
    [true] = [line for line in figure.figure.axes[0].get_lines() if line.get_label() == "true batch"]
    [ideal] = [line for line in figure.figure.axes[0].get_lines() if line.get_label().startswith("perfect")]
    assert true.get_marker() == "s" and true.get_color() != ideal.get_color()


def test_runs_at_k_1_apart_in_a_field_crossed_with_the_rules_all_count():
    """The weight decay crossed with every rule (not tied to one): the 9 runs at k = 1 at the second weight decay,
    sharing seed and B with the first's, were counted once with them and dropped from every series."""
    from batchsweep.analysis.targets import to_target
    from tests.test_report_no_batchnorm import _history

    rows = [{**r, "weight_decay": wd, "run_id": f"w{wd}{r['run_id']}"} for wd in (0.0, 0.001)
            for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    for s in to_target(pd.DataFrame(rows), _history(rows)).series:
        at_one = s.rows[s.rows["accum_steps"] == 1]
        assert len(at_one) == (18 if s.group[0] == "true batch" else 6), (s.group, len(at_one))


def test_rules_with_no_run_at_k_1_where_they_start_are_said_to_stand_alone():
    """k = 1 ran only at B = 128 and 512: it read 'each BN momentum rule's accumulated runs beside the runs at k = 1
    where they start', none of which ran."""
    rows = [r for r in _bn_grid("cnn1d", "batch", False, measured=True)
            if r["accum_steps"] > 1 or r["effective_batch"] > 32]
    rows += [{**r, "accum_steps": 2, "effective_batch": 64, "run_id": r["run_id"] + "k2"} for r in rows
             if r["accum_steps"] == 4]  # (three Bs accumulated: 64, 128 and 512)
    said = steps(pd.DataFrame(rows), _history(rows))
    first = said[0]
    assert "each BN momentum rule's accumulated runs alone (no run at k = 1 at the b they accumulate from)" in first, \
        first
    # The true batches ran at 2 Bs, every run reaching the target: it read 'fewer than 3 Bs where every run reached'.
    [true] = [s for s in said if s.startswith("For true batch")]
    assert "B_crit could not be fitted (the runs are at 2 Bs; a fit takes 3)" in true, true
    # scaled alone accumulating from b = 64, where k = 1 never ran: named, not said to start beside one
    rows = _bn_grid("cnn1d", "batch", False, measured=True)
    rows = [{**r, "physical_batch": 64, "accum_steps": r["accum_steps"] // 2} if r["bn_momentum_rule"] == "scaled"
            and r["accum_steps"] > 1 else r for r in rows]
    first = steps(pd.DataFrame(rows), _history(rows))[0]
    assert "runs beside the runs at k = 1 where they start (scaled: none at its b), the true batches" in first, first


def test_the_true_batches_under_an_lr_rule_are_named_as_such():
    """The LR rule and the BN rule both varied: the true batches' series read 'For linear and true batch', as two
    rules."""
    rows = [{**r, "lr_rule": lr, "run_id": lr + r["run_id"]} for lr in ("linear", "sqrt")
            for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    said = [s for s in steps(pd.DataFrame(rows), _history(rows)) if "true batch" in s.split(",")[0]]
    assert sorted(s.split(",")[0].split(" (")[0] for s in said) == ["For the true batch under linear",
                                                                     "For the true batch under sqrt"], said
