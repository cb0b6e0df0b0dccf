"""A best LR is known only to the LRs tried: the report reads no more from it than their grid resolves. A best at
the grid's edge at every B gives no slope at all, and a best the seeds agree on gives no interval narrower than
the grid's spacing allows."""
import math

import numpy as np
import pandas as pd

from batchsweep.analysis.best_lr import best_lr_against_b
from batchsweep.analysis.findings import lr_exponent
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study

LRS = (5e-4, 1.4e-3, 4e-3, 1.1e-2, 3.2e-2, 9e-2)  # about 2.8x apart: half a step is 0.52 in log


def _search(best_at, noise=0.0):
    """An LR search over B = 32 to 256, 3 seeds, the best LR of seed s at B being best_at(s, B)."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(3):
        for b in (32, 64, 128, 256):
            for lr in LRS:
                value = 0.95 - abs(np.log(lr / best_at(seed, b))) * 0.02 + rng.normal(0, noise)
                rows.append(dict(seed=seed, physical_batch=32, accum_steps=b // 32, effective_batch=b, base_lr=lr,
                                 lr=lr, lr_rule="none", base_batch=32, status="FINISHED", val_acc=round(value, 3)))
    study = _study(rows, ("physical_batch", "accum_steps", "base_lr"))
    [line] = recommend(study)
    return best_lr_against_b(study.trials, "val_acc", "maximize"), line


def test_a_best_lr_at_the_grids_top_at_every_b_gives_no_slope_and_says_to_raise_the_top():
    """The true best is 0.09 * B / 32, above every LR tried but 0.09 at B = 32: the best tried is the top at every
    B, so the report must not say it did not move, nor print a slope interval of 0.00 to 0.00."""
    found, line = _search(lambda s, b: 9e-2 * b / 32, noise=0.002)
    assert found.shape == "beyond the LRs tried", found.shape
    assert "did not move" not in line and "slope" not in line and "0.00 to 0.00" not in line, line
    assert ("every seed's best LR was the highest LR tried, so whether the best LR moves with B is not "
            "known: widen the LR grid: raise the highest base_lr tried (0.09;") in line, line


def test_a_best_lr_at_the_grids_bottom_at_every_b_says_to_lower_the_bottom():
    found, line = _search(lambda s, b: 5e-4 / 10 / (b / 32), noise=0.002)
    assert found.shape == "beyond the LRs tried", found.shape
    assert "every seed's best LR was the lowest LR tried, so" in line, line
    assert "lower the lowest base_lr tried (0.0005;" in line, line


def test_every_seed_on_one_grid_point_gives_a_slope_interval_as_wide_as_the_grid_allows():
    """Each seed's best is 0.004 at B = 32 and 0.011 above (one grid step up, then flat, in every seed): the seeds
    agree exactly, so their spread is 0, yet each best is known only to half a step of the grid either side. The
    interval was 0.45 to 0.45 ('holds none of 0, 0.5 and 1'); the step of one grid point read as resolved."""
    found, line = _search(lambda s, b: 4e-3 if b == 32 else 1.1e-2)
    weights = np.log([32, 64, 128, 256]) - np.log([32, 64, 128, 256]).mean()
    grid = np.abs(weights / (weights ** 2).sum()).sum() * np.log(1.1e-2 / 4e-3) / 2  # the slope rounding can move
    assert found.slope_low <= found.slope - grid + 1e-9 and found.slope_high >= found.slope + grid - 1e-9, found
    assert "0.45 to 0.45" not in line and "holds none of" not in line, line
    (_, _, _, low, high) = found.steps[0]
    assert low <= 0 <= high, found.steps[0]  # one grid point, taken by every seed, is no resolved step


def test_seeds_that_keep_their_own_grid_lr_at_every_b_give_no_zero_width_interval():
    """Seeds 0, 1, 2 keep 0.004, 0.011, 0.032 at every B: each seed's slope is exactly 0, but the slope's interval
    must span the grid's rounding (it was 0.00 to 0.00, read as 'no scaling' alone)."""
    found, line = _search(lambda s, b: (4e-3, 1.1e-2, 3.2e-2)[s])
    assert found.slope_low < -0.5 and found.slope_high > 0.5, (found.slope_low, found.slope_high)
    assert "It reads as no scaling" not in line and "(the interval holds 0 and 0.5)" in line, line


def _edges(best_index, grids):
    """Three seeds at each B, trials on grids[B]; each seed's value peaks at grids[B][best_index[B, seed]]."""
    rows = []
    for (b, seed), i in best_index.items():
        for j, lr in enumerate(grids[b]):
            rows.append(dict(seed=seed, effective_batch=b, lr=lr, base_lr=lr, status="FINISHED",
                             val_acc=0.9 - 0.05 * abs(j - i) - 0.001 * seed))
    return pd.DataFrame(rows)


G = (0.01, 0.02, 0.04, 0.08, 0.16)


def test_a_step_from_a_best_at_the_grids_edge_toward_beyond_it_is_not_resolved():
    """At B = 64 every seed's best is the lowest LR tried, and B = 128's grid sits lower still: the fall from 64 to
    128 read as resolved, yet the true best at 64 may lie below 128's. The fall into the edge (32 to 64) and the rise
    out of B = 128 into the top of 256's grid stay resolved: the edge could only make them larger."""
    grids = {32: [x * 4 for x in G], 64: G, 128: [x / 64 for x in G], 256: [x / 16 for x in G]}
    where = {32: 1, 64: 0, 128: 2, 256: 4}
    found = best_lr_against_b(_edges({(b, s): where[b] for b in grids for s in range(3)}, grids), "val_acc",
                              "maximize")
    assert "from B = 32 to 64." in found.sentence() and "64 to 128" not in found.sentence(), found.sentence()
    steps = {(a, b): (mean, low, high) for a, b, mean, low, high in found.steps}
    assert steps[64, 128][0] < 0 and steps[64, 128][2] == math.inf, steps  # the mean falls; no bound above
    assert steps[32, 64][2] < 0 and steps[128, 256][1] > 0, steps
    # A rise out of the top of the grid is no resolved rise either.
    grids = {32: G, 64: [x * 8 for x in G]}
    found = best_lr_against_b(_edges({(b, s): {32: 4, 64: 2}[b] for b in grids for s in range(3)}, grids),
                              "val_acc", "maximize")
    [(_, _, mean, low, high)] = found.steps
    assert mean > 0 and low == -math.inf and high < math.inf, found.steps


def test_seeds_at_the_grids_edge_leave_the_slopes_interval_unbounded_and_say_so_once():
    """Two seeds of three have their best at the top of the LRs tried at every B: the sentence gave 'the slope's 95%
    interval is -0.50 to 0.50' and the rule reading beside it called that interval no bound from either side."""
    found = best_lr_against_b(_edges({(b, s): 4 if s < 2 else 3 for b in (32, 64, 128) for s in range(3)},
                                     {b: G for b in (32, 64, 128)}), "val_acc", "maximize")
    assert found.slope_low == -math.inf and found.slope_high == math.inf, found
    assert found.shape != "did not move", found.shape
    text = found.sentence()
    assert "-0.50 to 0.50" not in text and "did not move" not in text, text
    assert "the slope's 95% interval is not bounded on either side" in text, text
    [line] = lr_exponent(_edges({(b, s): 4 if s < 2 else 3 for b in (32, 64, 128) for s in range(3)},
                                {b: G for b in (32, 64, 128)}).assign(lr_rule="none", physical_batch=32))
    assert "-0.50 to 0.50" not in line and line.count("not bounded") == 1, line
    assert "No LR rule is read from the slope while a best sits at the edge" in line, line
