"""Steps and times to the target count to one target, said with what it is of (targets.target)."""
import re

import pandas as pd

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.runs import StudyRuns
from batchsweep.analysis.space import time_front


def _two_rules(objective: str) -> StudyRuns:
    """Two LR rules at B = 32 to 128 (accumulated and true batch), 3 seeds: the true batch at B = 64 under none
    ends at 99% and its accumulated twin at 93%, the rest at 95%; `score` = 100 x val_acc, each epoch."""
    finals = {(64, 1, "none"): 0.99, (32, 2, "none"): 0.93}
    rows, history = [], []
    for seed in range(3):
        for rule in ("none", "sqrt"):
            for b, k in ((32, 1), (32, 2), (64, 1), (32, 4), (128, 1)):
                run, final = f"{seed}-{rule}-{b}-{k}", finals.get((b, k, rule), 0.95)
                rows.append(dict(run_id=run, seed=seed, lr_rule=rule, physical_batch=b, accum_steps=k,
                                 effective_batch=b * k, base_batch=32, status="FINISHED", val_acc=final,
                                 score=100 * final, batch="accumulated" if k > 1 else "true batch"))
                history += [dict(run_id=run, epoch=e, steps=e * 4000 // (b * k), val_acc=final * min(1, e / 6),
                                 score=100 * final * min(1, e / 6), epoch_time_s=1.0 + 0.01 * seed)
                            for e in range(1, 11)]
    return StudyRuns("s", pd.DataFrame(rows), pd.DataFrame(history), None, "",
                     varied=("physical_batch", "accum_steps", "lr_rule"), objectives=((objective, "maximize"),),
                     run_as="--study s")


def test_steps_and_times_to_the_target_count_to_one_target():
    """The true batch at B = 64 under none ends at 99% and its accumulated twin at 93%: the best configuration's mean
    is 99%, the best mean of an LR rule at a B (both halves) 96%. Steps said 95% of the latter (91.2%) and times 95% of
    the former (94.0%); both count to 91.2% now, and the steps sentence says what it is of."""
    study = _two_rules("val_acc")
    [steps] = [s for s in summarize(study.trials, study.history) if s.startswith("Steps to reach")]
    assert steps.startswith("Steps to reach 91.2% validation accuracy (95% of the highest mean final accuracy of an "
                            "LR rule at a B, over the seeds, every run there counted;"), steps
    times = time_front(study).finding
    assert re.findall(r"to reach val_acc (\d+\.\d)%", times) and \
        set(re.findall(r"to reach val_acc (\d+\.\d)%", times)) == {"91.2"}, times


def test_an_objective_of_its_own_is_timed_to_the_target_the_steps_count_to():
    """A [program]-style objective, score = 100 x val_acc, logged each epoch: times counted to 95% of the best
    configuration's mean score (95.0, of (64, 1, none) at 99%) while steps counted to 95% of the highest mean of an
    LR rule at a B (91.2%); both count to the one target now, on the score's own scale (91.2)."""
    times = time_front(_two_rules("score")).finding
    assert set(re.findall(r"to reach score (\d+\.\d+)", times)) == {"91.2"}, times


def test_an_objective_with_no_per_epoch_values_says_no_time_to_reach_it_can_be_read():
    """score = 100 x val_acc logged once, at the end, the trials timed alone: the time line said 'no configurations
    were timed alone' (of 30 timed alone) where no time to reach a score can be read from its history."""
    from batchsweep.analysis.recommend import fastest

    rows, history = [], []
    for seed in range(3):
        for b in (32, 64, 128):
            run = f"{seed}-{b}"
            rows.append(dict(run_id=run, seed=seed, lr_rule="none", physical_batch=b, accum_steps=1,
                             effective_batch=b, base_batch=32, status="FINISHED", val_acc=0.95, score=95.0))
            history += [dict(run_id=run, epoch=e, steps=e * 4000 // b, val_acc=0.95 * e / 4, epoch_time_s=1.0)
                        for e in range(1, 5)]
    study = StudyRuns("s", pd.DataFrame(rows), pd.DataFrame(history), None, "",
                      varied=("physical_batch",), objectives=(("score", "maximize"),), run_as="--study s")
    assert fastest(study) == ["No time to the target is given: score has no per-epoch values, so no time to reach "
                              "it can be read."]
