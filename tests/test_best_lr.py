"""The best LR against B (analysis/best_lr.py): on a real study's MLflow store, and its shapes on surfaces whose
best LR is known."""
import math

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from batchsweep.analysis import best_lr
from batchsweep.analysis.findings import lr_exponent, lr_rule_reading, summarize
from batchsweep.analysis.runs import load_studies
from tests.test_sweeps import sweep

STUDY = """
name = "{name}"
seeds = 2
[fixed]
model = "mlp"
dataset = "tests.factories:blobs1k"
epochs = 2
warmup_epochs = 0
[grid]
"physical_batch+accum_steps" = [[8, 2], [32, 2], [128, 2]]
base_lr = {lrs}
"""
STUDIES = ["lr_grid", "lr_grid_high"]  # one search of 4 LRs run as two studies, read as one


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real search, 3 Bs x 4 LRs x 2 seeds x 2 epochs, run as two studies in one SQLite store (its 2 lower LRs,
    then its 2 higher), read back as the report reads them: one frame of trials and their histories."""
    cwd = tmp_path_factory.mktemp("lr_grid")
    for name, lrs in zip(STUDIES, ([0.003, 0.03], [0.3, 3.0])):
        (cwd / f"{name}.toml").write_text(STUDY.format(name=name, lrs=lrs))
        proc = sweep(cwd, "--study", f"{name}.toml", "--workers", "1", "--log-models", "none", "--no-report")
        assert proc.returncode == 0, proc.stderr
    uri = f"sqlite:///{cwd}/mlruns/mlflow.db"
    runs = load_studies(STUDIES, uri)
    return uri, SimpleNamespace(trials=pd.concat([r.trials for r in runs], ignore_index=True),
                                history=pd.concat([r.history for r in runs], ignore_index=True))


@pytest.mark.slow
def test_each_seeds_best_is_its_best_trial_refined_between_its_neighbours(store):
    uri, runs = store
    result = best_lr.best_lr_against_b(runs.trials, "val_acc", "maximize")
    client = MlflowClient(uri)
    experiments = [client.get_experiment_by_name(name).experiment_id for name in STUDIES]
    trials = {}  # (B, seed) -> [(lr, val_acc)], read straight from MLflow; a diverged LR was tried, and lost
    for run in client.search_runs(experiments):
        if "effective_batch" not in run.data.params:
            continue
        key = int(run.data.params["effective_batch"]), int(run.data.params["seed"])
        if run.data.tags.get("reason") == "diverged":
            trials.setdefault(key, []).append((float(run.data.params["lr"]), -math.inf))
        elif run.info.status == "FINISHED" and math.isfinite(run.data.metrics.get("val_acc", math.nan)):
            trials.setdefault(key, []).append((float(run.data.params["lr"]), run.data.metrics["val_acc"]))
    assert [p.batch for p in result.points] == [16, 64, 256]
    for point in result.points:
        edges = 0
        for seed, found in zip((0, 1), point.seeds):
            tried = sorted(trials[point.batch, seed])
            i = max(range(len(tried)), key=lambda j: tried[j][1])
            if i in (0, len(tried) - 1):
                edges += 1
                assert found == pytest.approx(tried[i][0])
            elif -math.inf in (tried[i - 1][1], tried[i + 1][1]):  # no parabola through a diverged LR
                assert found == pytest.approx(tried[i][0])
            else:
                assert tried[i - 1][0] <= found <= tried[i + 1][0]
        assert point.at_edge == edges and len(tried) == 4  # (both studies' LRs at every B and seed)
        assert point.lr == pytest.approx(math.exp(np.mean(np.log(point.seeds))))
        assert point.low <= point.lr <= point.high
    assert result == best_lr.best_lr_against_b(runs.trials, "val_acc", "maximize")  # the bootstrap is seeded
    assert result.noise_trials == 6 and result.noise_range[0] <= result.noise_scale <= result.noise_range[1]
    assert f"median of 6, range {result.noise_range[0]:.0f} to {result.noise_range[1]:.0f}" in result.sentence()


@pytest.mark.slow
def test_the_command_prints_the_table_and_draws_the_figure(store, tmp_path, capsys):
    uri, _ = store
    assert best_lr.main([*STUDIES, "--tracking-uri", uri, "--figure", str(tmp_path / "f.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| B | best LR | 95% interval |") and "\n| 256 | " in out
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert best_lr.main(["nope", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.strip().startswith("error: no study 'nope' in ")


@pytest.mark.slow
def test_the_best_lr_after_each_epoch_ends_where_the_search_ends(store, capsys):
    """--by-epoch: a table after each epoch, read from the history; after the last epoch it is the search's own
    (each trial's final value is its last epoch's)."""
    uri, runs = store
    epochs = best_lr.over_training(runs.trials, runs.history, "val_acc", "maximize")
    assert [e for e, _ in epochs] == [1, 2]
    assert epochs[-1][1] == best_lr.best_lr_against_b(runs.trials, "val_acc", "maximize")
    assert best_lr.main([*STUDIES, "--tracking-uri", uri, "--by-epoch"]) == 0
    out = capsys.readouterr().out
    assert "\nAfter epoch 1:\n\n| B | best LR |" in out and "\nAfter epoch 2:\n\n| B | best LR |" in out
    assert out.rstrip().splitlines()[-1] == best_lr.moved(epochs)
    [line] = [s for s in summarize(runs.trials, runs.history) if s.startswith("The best learning rate went")]
    assert line.endswith(" " + best_lr.moved(epochs)), line  # the report's finding says it too


def _moving(seeds: int, second_peak: float = 256) -> list:
    """An LR search after epochs 1 and 2 whose best LR peaks (in B) at 64 after epoch 1 and at `second_peak` after
    epoch 2, each seed's optimum moved a little."""
    rng, rows, history = np.random.default_rng(0), [], []
    for b in (8, 16, 64, 256, 1024):
        for s in range(seeds):
            shift = rng.normal(0, 0.05)
            for lr in 0.0125 * 2.0 ** np.arange(7):
                run = f"b{b}s{s}lr{lr}"
                for epoch, peak in ((1, 64), (2, second_peak)):
                    best = 0.05 * math.exp(-math.log2(b / peak) ** 2 / 4 + shift)
                    history.append(dict(run_id=run, epoch=epoch, val_loss=0.5 + 0.02 * math.log2(lr / best) ** 2,
                                        noise_scale=10.0 * epoch))
                rows.append(dict(run_id=run, seed=s, effective_batch=b, lr=lr, status="FINISHED",
                                 val_loss=history[-1]["val_loss"]))
    return best_lr.over_training(pd.DataFrame(rows), pd.DataFrame(history), "val_loss", "minimize")


def test_a_peak_that_moves_during_training_is_said_to_move_only_where_the_seeds_resolve_it():
    """Li et al.: Adam's peak moves to larger B as training goes on. With 5 seeds whose peaks lie apart, the move
    is said; with 3 seeds no interval is put on a peak, so no move is said; a peak that stays is no move."""
    five = _moving(5)
    assert 48 < five[0][1].peak < 100 and 190 < five[1][1].peak < 340, five  # (Li et al.'s curve fitted to a grid)
    assert all(r.shape == "rises then falls" for _, r in five)
    assert [r.noise_scale for _, r in five] == [10.0, 20.0]  # each epoch's own, from the history
    said = best_lr.moved(five)
    assert "the highest at B = 64 after epoch 1, 256 after epoch 2." in said and said.endswith(
        "it moved beyond the seeds' spread."), said
    assert best_lr.moved(_moving(3)).endswith("too few seeds to tell a move from their spread.")
    assert best_lr.moved(_moving(5, second_peak=64)).endswith("the resampled ranges overlap: no move is resolved.")


def surface(best_at, batches=(8, 16, 32, 64, 128, 256, 512), seeds=3, spread=0.05, noise=0.0, step=1.0):
    """Trials whose metric is a parabola in log LR around best_at(B), each seed's optimum moved by `spread`
    (in log LR, a fixed draw), on a grid of LRs a factor of 2 ** step apart, with `noise` on each value."""
    rng = np.random.default_rng(1)
    lrs = 2.0 ** np.arange(-14, 2, step)
    rows = []
    for seed in range(seeds):
        shift = rng.normal(0, spread)
        for b in batches:
            centre = math.log(best_at(b)) + shift
            for lr in lrs:
                rows.append(dict(effective_batch=b, seed=seed, lr=lr, status="FINISHED",
                                 val_loss=(math.log(lr) - centre) ** 2 + rng.normal(0, noise)))
    return pd.DataFrame(rows)


def test_li_et_als_rise_and_fall_is_found_with_its_peak():
    def adam(b, peak=64):  # Li et al. 2024: lr_max / (sqrt(P/B) + sqrt(B/P)) * 2
        return 0.01 * 2 / (math.sqrt(peak / b) + math.sqrt(b / peak))

    # (the peak's LR is 1.6 times the ends': on a grid of doublings it is within the grid's rounding)
    result = best_lr.best_lr_against_b(surface(adam, step=0.25), "val_loss", "minimize")
    assert result.shape == "rises then falls"
    assert result.peak_low <= result.peak <= result.peak_high and 48 < result.peak < 86
    assert "rises and then falls with B: Li et al.'s curve peaks at B ≈ " in result.sentence()
    assert [p.lr for p in result.points] == pytest.approx([adam(b) for b in (8, 16, 32, 64, 128, 256, 512)],
                                                          rel=0.1)


def test_sgds_rise_is_only_a_rise():
    result = best_lr.best_lr_against_b(surface(lambda b: 0.5 / (1 + 100 / b)), "val_loss", "minimize")
    assert result.shape == "only rises" and result.slope_low > 0
    assert "only rises with B from 8 to 512" in result.sentence() and "no peak in the range" in result.sentence()


def test_a_rise_that_levels_off_is_not_called_a_peak():
    """Li et al.'s curve fitted to a rise and a plateau peaks inside the range; the shape still needs a fall."""
    result = best_lr.best_lr_against_b(surface(lambda b: 0.5 / (1 + 64 / b), batches=(8, 32, 128, 512, 2048)),
                                       "val_loss", "minimize")
    assert 8 < result.peak < 2048 and result.shape != "rises then falls"


def test_seeds_that_disagree_resolve_nothing():
    result = best_lr.best_lr_against_b(surface(lambda b: 1e-3, spread=2.0, noise=3.0), "val_loss", "minimize")
    assert result.shape == "not resolved"
    assert result.sentence().startswith("No peak is resolved between B = 8 and 512 with 3 seeds")


def test_a_best_at_the_edge_of_the_lrs_tried_is_said():
    trials = surface(lambda b: 10.0)  # beyond the largest LR tried, 2
    result = best_lr.best_lr_against_b(trials, "val_loss", "minimize")
    assert all(p.at_edge == 3 and p.lr == pytest.approx(2.0) for p in result.points)
    assert result.shape == "beyond the LRs tried" and "slope" not in result.sentence()
    assert ("every seed's best LR was the highest LR tried, so whether the best LR moves with B is not known"
            in result.sentence()), result.sentence()
    # One seed's best inside the LRs tried at one B: the slope is read, and the edges said.
    one = (trials.seed == 0) & (trials.effective_batch == 8)
    moved = trials.assign(val_loss=trials.val_loss.where(~one, np.log(trials.lr / 0.5) ** 2))
    result = best_lr.best_lr_against_b(moved, "val_loss", "minimize")
    assert result.shape != "beyond the LRs tried" and result.points[0].at_edge == 2
    assert "some seed's best LR is the edge of the LRs tried: the true best may lie beyond it" in result.sentence()
    diverged = trials[trials.lr == 2.0].assign(lr=4.0, val_loss=math.nan, status="FAILED", reason="diverged")
    result = best_lr.best_lr_against_b(pd.concat([trials, diverged], ignore_index=True), "val_loss", "minimize")
    assert all(p.at_edge == 0 and p.lr == pytest.approx(2.0) for p in result.points)  # the next LR was tried
    assert "edge" not in result.sentence()


def test_a_rise_with_a_resolved_fall_inside_is_no_peak_and_no_clean_rise():
    result = best_lr.best_lr_against_b(surface(lambda b: 1e-3 * b / (64 if b == 128 else 8)), "val_loss", "minimize")
    assert result.shape == "not resolved" and result.slope_low > 0
    assert result.sentence().startswith("The best LR rises with B from 8 to 512 overall (slope ")
    assert "but not at every step; no peak is resolved with 3 seeds. It falls, beyond the seeds' spread and the LR " \
           "grid's spacing, from B = 64 to 128." in result.sentence()


def test_trials_that_differ_in_more_than_the_lr_are_refused_in_one_line():
    trials = surface(lambda b: 1e-3).assign(beta2=lambda t: np.where(t.lr > 1e-3, 0.8, 0.95))
    with pytest.raises(ValueError, match=r"^at B = 8 the trials differ in more than the LR \(beta2\): the best LR "
                                         r"against B needs trials that differ only in the LR at each B"):
        best_lr.best_lr_against_b(trials, "val_loss", "minimize")


def test_a_mean_that_falls_at_the_last_b_unresolved_is_no_clean_rise_and_leaves_the_peak_open():
    """The best LR doubles from B = 32 to 256, then its mean falls at B = 512 where the seeds spread (0.07, 0.12,
    0.22): the rise is resolved overall and no fall is, but "only rises ... no peak in the range" denied what the
    means show."""
    tops, rows = {32: 0.025, 64: 0.05, 128: 0.1, 256: 0.2, 512: 0.12}, []
    for seed in range(3):
        for b, top in tops.items():
            centre = math.log(top * (2 ** ((seed - 1) * 0.8) if b == 512 else 1))
            rows += [dict(effective_batch=b, seed=seed, lr=lr, status="FINISHED", val_loss=(math.log(lr) - centre) ** 2)
                     for lr in 0.0125 * 2 ** (np.arange(12) / 2)]
    result = best_lr.best_lr_against_b(pd.DataFrame(rows), "val_loss", "minimize")
    assert result.slope_low > 0 and result.shape == "not resolved", result
    assert "only rises" not in result.sentence() and "no peak in the range" not in result.sentence()
    assert "but its mean falls from B = 256 to 512, which 3 seeds do not resolve: whether it has a peak in the " \
           "range is not resolved." in result.sentence(), result.sentence()


def _search(best_of, seeds_of, lrs=tuple(0.0125 * 2 ** i for i in range(6)), noise=0.002,
            batches=(32, 64, 128, 256, 512)):
    """An LR search in val_acc at B = 32 to 512 (or `batches`): a parabola in log2 LR around best_of(B, seed)."""
    rng, rows = np.random.default_rng(0), []
    for b in batches:
        for s in seeds_of(b):
            rows += [dict(seed=s, lr_rule="none", physical_batch=b, accum_steps=1, effective_batch=b, base_batch=32,
                          base_lr=lr, lr=lr, status="FINISHED", val_acc=round(
                              0.95 - 0.02 * np.log2(lr / best_of(b, s)) ** 2 + rng.normal(0, noise), 3)) for lr in lrs]
    return pd.DataFrame(rows)


def test_one_seed_at_each_b_puts_no_interval_on_the_exponent_and_reads_no_rule():
    """Each B ran one seed of its own: the fallback bootstrapped the LR grid's trials (not seeds) and printed a 95%
    interval and "reads as square-root scaling"; a seed moves the best LR by more than that interval knows."""
    [line] = lr_exponent(_search(lambda b, s: 0.05 * np.sqrt(b / 32), lambda b: [b]))
    assert "bootstrap" not in line and "95%" not in line and "reads as" not in line, line
    assert "each B's best from one seed of its own" in line and "no LR rule is read from it" in line


def test_a_best_lr_at_the_edge_of_the_grid_bounds_the_slope_from_one_side_and_reads_no_rule():
    """The true best LR is linear in B, but the grid tops out at 0.4: at B = 256 and 512 every seed's best is 0.4,
    so the slope's interval (0.79 to 0.82, "holds none of 0, 0.5, 1") is a lower bound at most."""
    [line] = lr_exponent(_search(lambda b, s: 0.05 * b / 32, lambda b: range(3)))
    assert "or more, not bounded above: a seed's best sat at the edge of the LRs tried" in line, line
    assert "No LR rule is read from the slope while a best sits at the edge" in line, line
    assert "singles out" not in line and "reads as" not in line


def test_the_rule_is_read_from_the_interval_as_printed():
    """0.5036 prints as 0.504 (two decimals would show 0.50, which holds 0.5), so the reading of the interval as
    printed is the reading of its value: it holds 1 and not 0.5."""
    assert best_lr.shown(0.5036) == "0.504" and best_lr.shown(0.4961) == "0.496"
    assert lr_rule_reading(0.5036, 1.2).startswith("It is consistent with linear scaling (the interval holds 1)")
    assert lr_rule_reading(0.4961, 1.2).startswith("It is consistent with square-root scaling and linear scaling")


def test_seeds_that_do_not_pair_across_the_bs_put_no_interval_on_the_exponent():
    """Three seeds at each B, but other seeds at each B: the fallback resampled each B's trials (its seeds' LR grids
    mixed) and printed a 95% interval and a rule; no seed has a slope of its own, so none is said."""
    [line] = lr_exponent(_search(lambda b, s: 0.05 * np.sqrt(b / 32), lambda b: [3 * b + i for i in range(3)]))
    assert "bootstrap" not in line and "95%" not in line and "reads as" not in line, line
    assert "none run at every B" in line and "no LR rule is read from it" in line, line


def test_a_best_lr_that_rises_then_dips_unresolved_reads_no_rule():
    """The best LR doubles from B = 8 to 64 and dips at 256 within the seeds' spread (adam_lr_search's shape): the
    slope's interval may hold 0 alone, but "reads as no scaling" would tell a user to keep an LR that doubled."""
    def best_of(b, s):
        return {8: 0.012, 16: 0.017, 64: 0.024, 256: 0.022}[b] * (1.0, 1.3, 0.75)[s] ** (b == 256)

    # (LRs 2 ** 0.25 apart: on a grid of doublings a step of 1.4 times is within the grid's rounding)
    [line] = lr_exponent(_search(best_of, lambda b: range(3), tuple(0.003 * 2 ** (i / 4) for i in range(21)),
                                 batches=(8, 16, 64, 256)))
    assert "reads as" not in line and "its interval holds 0, but the best LR moved from B = 8 to 16" in line, line
    assert line.endswith("use each B's best LR."), line
