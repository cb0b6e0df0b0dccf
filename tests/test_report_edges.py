"""The report where a comparison points the unexpected way or a seed is missing for a reason other than divergence:
a B resolved above the smallest B, a comparison inside the margin that is also resolved."""
import numpy as np

from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _rows, _study

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
    assert line.startswith("The largest B shown to cost less than 1 point: B = 512 under the linear LR rule, "), line
    assert "points higher" in line and line.endswith("against B = 32, and every B between them too."), line


def test_a_resolved_difference_inside_the_margin_is_shown_to_cost_less_than_it():
    """sqrt at B = 128 is 0.6 points below B = 32 in every seed (95% CI about -0.7 to -0.5): inside the ±1 point
    margin, so it is shown to cost less than 1 point, not quoted as the nearest of none that was."""
    rng = np.random.default_rng(1)

    def value(s, rule, b, k):
        return 0.95 - (0 if b * k == 32 else {"none": 0.02, "sqrt": 0.006, "linear": 0.015}[rule]) \
            + rng.normal(0, 0.001)
    line = _free_line(_study(_rows(value), GRID))
    assert line.startswith("The largest B shown to cost less than 1 point: B = 128 under the sqrt LR rule, "), line
    assert "inside the ±1 point equivalence margin" in line, line
