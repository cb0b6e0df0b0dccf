"""The report says only what its statistics resolve: a mean is ranked as it is printed, a slope of zero is no
fall, a reason given is the true one, and a missing half or a seed that never reached a target is said, not
mixed in."""
import re

import numpy as np

from batchsweep.analysis.recommend import recommend
from batchsweep.analysis.space import memory_front
from tests.test_recommend_edges import _study

RULES = ("physical_batch", "accum_steps", "lr_rule")


def test_the_best_is_ranked_by_its_own_seeds_mean_not_moved_by_another_configuration_missing_a_seed():
    """B = 32 averages 97.3% over its 3 seeds, b = 32, k = 2, none 97.0%, but higher in seeds 1 and 2; a crash of
    b = 512, k = 1, sqrt in seed 0 must not make the latter the best by ranking over seeds 1 and 2 alone."""
    rng, rows = np.random.default_rng(1), []
    own = {(32, 1): (0.980, 0.970, 0.970), (32, 2, "none"): (0.960, 0.975, 0.975)}
    for seed in range(3):
        for rule in ("none", "sqrt", "linear"):
            for b, k in ((32, 1), (32, 2), (64, 1), (512, 1)):
                v = own.get((b, k), own.get((b, k, rule)))
                v = v[seed] if v else 0.95 - 0.01 * np.log2(b * k / 32) + rng.normal(0, 0.002)
                crash = (b, rule, seed) == (512, "sqrt", 0)
                rows.append(dict(seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k, effective_batch=b * k,
                                 base_batch=32, status="FAILED" if crash else "FINISHED",
                                 reason="error" if crash else None, val_acc=np.nan if crash else round(v, 3),
                                 peak_memory_bytes=1000.0 * b))
    study = _study(rows, RULES)
    [line] = [s for s in recommend(study) if s.startswith("The best accuracy")]
    assert line.startswith("The best accuracy: b = 32, k = 1, every LR rule (B = base_batch) (97.3%"), line
    front = memory_front(study)
    assert "was b = 32, k = 1, every LR rule (B = base_batch) (97.3%" in front.finding, front.finding


def _lr_search(best_at):
    """An LR search over B = 32 to 256, 3 seeds, the best LR at B being best_at(B)."""
    rng, rows = np.random.default_rng(0), []
    for seed in range(3):
        for b in (32, 64, 128, 256):
            for lr in (5e-4, 1.4e-3, 4e-3, 1.1e-2, 3.2e-2, 9e-2):
                rows.append(dict(seed=seed, physical_batch=32, accum_steps=b // 32, effective_batch=b, base_lr=lr,
                                 lr=lr, lr_rule="none", base_batch=32, status="FINISHED",
                                 val_acc=round(0.95 - abs(np.log(lr / best_at(b))) * 0.02 + rng.normal(0, 0.002), 3)))
    [line] = recommend(_study(rows, ("physical_batch", "accum_steps", "base_lr")))
    return line


def test_a_best_lr_the_same_at_every_b_did_not_move_and_does_not_fall():
    """Every seed's best LR is the grid's top at every B: polyfit's slope of a constant (-1e-16) is no fall."""
    line = _lr_search(lambda b: 9e-2 * b / 32)
    assert "only falls" not in line and "The best LR did not move with B from 32 to 256" in line, line


def test_a_wiggle_the_seeds_do_not_resolve_is_no_move_against_the_slope():
    """The best LR is 0.011 at every B: its geometric means wiggle (0.0111 to 0.011) inside the seeds' spread, so
    the slope's interval (-0.02 to 0.02) reads as no scaling, not as a move against it."""
    line = _lr_search(lambda b: 1.1e-2)
    assert "moved against" not in line and "It reads as no scaling" in line, line
