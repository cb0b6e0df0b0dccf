"""What a sentence says it would take, and what it says at all, only as far as the study settles it: the seeds
that would show equivalence where the difference seen lies inside the margin, a margin set by the reference
alone, a half that never ran said, a model without BatchNorm, one seed, and a metric that never moved."""
import math

from scipy import stats

from batchsweep.analysis.measures import ACCURACY
from batchsweep.analysis.runs import Difference
from batchsweep.analysis.verdicts import judge
from batchsweep.analysis.wording import stated


def _seeds_inside(mean: float, sd: float, margin: float) -> int:
    n = 2
    while abs(mean) + stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) >= margin:
        n += 1
    return n


def test_a_difference_inside_the_margin_gives_the_seeds_that_would_show_equivalence_not_those_that_resolve_it():
    """0.05 ± 1.7 points over 3 seeds: resolving 0.05 points from 0 takes thousands of seeds, showing it within
    ±1 point about 5; the sentence gives the second and says which."""
    d = Difference(0.0005, 0.017, 3)
    said = stated(d, m=ACCURACY)
    n = _seeds_inside(d.mean, d.sd, ACCURACY.margin)
    assert f"about {n} seeds would show equivalence within ±1 point at this spread" in said, said
    assert n == 5 and "resolve" not in said.split(";")[-1], said


def test_a_difference_beyond_the_margin_gives_the_seeds_that_would_resolve_it_from_0():
    d = Difference(-0.04, 0.05, 3)
    [v] = judge([d], ACCURACY.margin)
    assert not v.shows_equivalence
    assert "seeds would resolve a difference this size from 0 at this spread" in stated(d, m=ACCURACY, v=v)
