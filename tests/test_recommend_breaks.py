"""The recommendation's sentences that said more than the measurements show, each reproduced on a small trial
table: a pick pooled over twins that differ, a front ranked on other seeds than the best, bitwise copies counted
as configurations, a margin that moves with the metric's zero, lines missing where a B diverged, an LR search at
one B, a best over two models, and values read back as strings."""
import numpy as np
import pandas as pd

from batchsweep.analysis.recommend import recommend
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
