"""A reason the report gives is the true one: why no time to the target is given, why a half of a B is missing in
a seed, why a configuration has no time of its own, and over how many seeds each comparison was paired."""
from tests.test_recommend_resolve import _time_line, _timed


def test_fused_trials_beside_configurations_timed_alone_that_never_reached_the_target_say_so():
    """b = 32, k = 2 and b = 64 trained fused; the 4 configurations timed alone (B = 32 and b = 128 under each
    rule) never reached the target in seeds 0 and 1: the line says that of those, none reached it in most seeds,
    not that the rest are too few to compare."""
    alone = [((32, 1, rule), seed) for rule in ("none", "sqrt", "linear") for seed in (0, 1)]
    alone += [((128, 1, rule), seed) for rule in ("none", "sqrt", "linear") for seed in (0, 1)]
    [line] = _time_line(_timed(fused=((32, 2), (64, 1)), never=tuple(alone)))
    assert line.startswith("No time to the target is given: 18 of the 36 trials trained fused"), line
    assert ("of the 4 configurations timed alone, none reached val_acc 90.2% in most of their seeds" in line
            and "too few" not in line), line
