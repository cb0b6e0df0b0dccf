"""The LR rule a slope's interval reads as, and its bounds shown so that rounding never crosses what the words
compare them with (best_lr.rule_reading, best_lr.shown)."""
import numpy as np
import pandas as pd
import pytest

from batchsweep.analysis.best_lr import best_lr_against_b, rule_reading


def _search(slopes, batches=(32, 64, 128, 256), base=0.05):
    """Each seed's best LR moving as B^slope from `base` at B = 32, on a grid of LRs a quarter-octave apart."""
    rows = []
    for seed, slope in enumerate(slopes):
        for b in batches:
            best = np.log2(base) + slope * np.log2(b / batches[0])
            for j in range(-8, 48):
                lr = base * 2 ** (j / 4)
                rows.append(dict(effective_batch=b, seed=seed, lr=lr, base_lr=lr, status="FINISHED",
                                 val_acc=0.9 - 0.02 * (np.log2(lr) - best) ** 2))
    return best_lr_against_b(pd.DataFrame(rows), "val_acc", "maximize")


def test_an_interval_that_holds_linear_but_reaches_far_past_it_reads_no_rule():
    """Seeds' slopes 1.25, 1.5, 1.75: the interval 0.88 to 2.12 holds 1, and read 'linear scaling' (0.4 at B = 256
    where the best measured is 1.13); it is consistent with linear and no rule is read."""
    found = _search([1.25, 1.5, 1.75])
    reading = rule_reading(found.slope_low, found.slope_high)
    assert not reading.startswith("It reads as"), reading
    assert reading == ("It is consistent with linear scaling (the interval holds 1), but does not lie within 0.25 of "
                       "one exponent (halfway to the neighbouring ones), so no rule is read from it: use each B's "
                       "best LR")


@pytest.mark.parametrize("low, high, reading", [
    (0.8, 1.2, "It reads as linear scaling"), (0.3, 0.7, "It reads as square-root scaling"),
    (-0.1, 0.2, "It reads as no scaling"), (0.6, 1.2, "It is consistent with linear scaling (the interval holds 1)"),
    (-0.5, 0.6, "It is consistent with no scaling and square-root scaling (the interval holds 0 and 0.5)"),
    (1.45, 1.95, "It is consistent with no rule: the interval holds none of the exponents"),
    (1.02, 1.22, "It is consistent with no rule: the interval holds none of the exponents")])
def test_a_rule_is_read_only_where_the_interval_lies_within_a_quarter_of_its_exponent(low, high, reading):
    assert rule_reading(low, high).startswith(reading), rule_reading(low, high)


def test_a_bound_is_shown_with_the_digits_that_keep_it_on_its_side_of_zero():
    """Seeds' slopes 0.3, 0.5, 0.7: the interval runs from 0.0032 to 0.9968 and 'only rises'; two decimals showed
    '0.00 to 1.00', an interval that holds 0 and 1 beside the words that it excludes them."""
    found = _search([0.3, 0.5, 0.7])
    assert found.shape == "only rises" and 0 < found.slope_low < 0.005, found
    assert "(slope 0.50 in log-log, 95% interval 0.003 to 0.997;" in found.sentence(), found.sentence()


def test_an_interval_near_an_exponent_that_excludes_it_reads_no_rule_and_says_where_it_lies():
    """Seeds' slopes 1.10, 1.12, 1.14: the interval 1.02 to 1.22 lies within 0.25 of 1 but excludes it, and read
    'linear scaling ... the interval holds 1'; it is steeper than linear."""
    found = _search([1.10, 1.12, 1.14])
    reading = rule_reading(found.slope_low, found.slope_high)
    assert not reading.startswith("It reads as"), reading
    assert reading.endswith("lies above 1 (steeper than linear: 1.02 to 1.22 excludes 1); use each B's best LR"), \
        reading


@pytest.mark.parametrize("low, high, lies", [
    (0.8, 0.95, "lies between 0.5 and 1 (between the square root and linear: 0.80 to 0.95 excludes both)"),
    (0.1, 0.3, "lies between 0 and 0.5 (between LR unchanged and the square root: 0.10 to 0.30 excludes both)"),
    (-0.2, -0.1, "lies below 0 (the best LR falls as B grows: -0.20 to -0.10 excludes 0)")])
def test_an_interval_that_holds_no_exponent_says_where_it_lies(low, high, lies):
    reading = rule_reading(low, high)
    assert reading.startswith("It is consistent with no rule") and lies in reading, reading


@pytest.mark.parametrize("low, high, reading", [
    (1.0000000000000002, 1.2, "It reads as linear scaling"), (0.8, 0.9999999999999998, "It reads as linear scaling"),
    (0.9, 1.2500000000000002, "It reads as linear scaling"),
    (-0.2500000000000001, 0.4999999999999999, "It is consistent with no scaling and square-root scaling")])
def test_an_end_within_float_noise_of_a_mark_is_read_as_it_is_shown(low, high, reading):
    """shown() prints an end within 1e-9 of an exponent (or its margin) as it: (1.0000000000000002, 1.2) read 'lies
    above 1 (... 1.00 to 1.20 excludes 1)' where the interval is printed holding 1."""
    assert rule_reading(low, high).startswith(reading), rule_reading(low, high)


def test_an_interval_with_no_ends_reads_no_rule():
    """A slope with no interval (NaN ends) raised IndexError."""
    assert rule_reading(float("nan"), float("nan")) == ("No LR rule can be read: the slope has no interval over the "
                                                        "seeds; use each B's best LR")
