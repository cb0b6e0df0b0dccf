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
