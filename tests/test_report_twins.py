"""The BN momentum rules against their true-batch twin: a twin that ran and did not finish (out of memory, still
running) is told apart from one that never ran, said once per k where the rules share it; where the rule is zipped
with another field, each rule's running means are held against its own twin's, and a rule with none is named."""
import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import VARIED, _bn_grid


def _said(rows: list[dict]) -> tuple[str, str]:
    """The final-accuracy finding and the recommendation's line at k = 16."""
    study = _study(rows, VARIED)
    found, lines = summarize(study.trials, study.history, None, None, study.varied), recommend(study)
    [final] = [s for s in found if s.startswith("Final accuracy at k = 16")]
    [line] = [s for s in lines if s.startswith("BN momentum at k = 16")]
    return final, line


@pytest.mark.parametrize("status, reason, how", [("FAILED", "oom", "ran out of memory in 3 of 3 seeds"),
                                                 ("RUNNING", None, "is still marked running in 3 of 3 seeds")])
def test_a_true_batch_that_ran_and_did_not_finish_is_said_so_once(status, reason, how):
    """bn_momentum whose true batch of 512 ran out of memory read 'default has no true-batch twin (b = 512, k = 1
    with its other settings), not compared; scaled has no ...; matched has no ...' beside '2 of 18 trials did not
    finish (2 oom)'."""
    rows = [{**r, "status": status, "reason": reason, "val_acc": None, "bn_mean_error": None}
            if r["effective_batch"] == 512 and r["accum_steps"] == 1 else r
            for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    final, line = _said(rows)
    said = f"the true batch (b = 512, k = 1) {how}"
    assert final == f"Final accuracy at k = 16 against the true batch: no rule compared; {said}.", final
    assert line == f"BN momentum at k = 16 (B = 512): no rule compared with the true batch; {said}.", line


def test_a_true_batch_that_never_ran_is_said_to_have_no_run_once():
    """With no run at b = 512, k = 1, every rule read 'has no true-batch twin (...) with its other settings', where
    no other field varies."""
    rows = [r for r in _bn_grid("cnn1d", "batch", False, measured=True)
            if not (r["effective_batch"] == 512 and r["accum_steps"] == 1)]
    final, line = _said(rows)
    said = "the true batch (b = 512, k = 1) has no run in this study"
    assert final == f"Final accuracy at k = 16 against the true batch: no rule compared; {said}.", final
    assert line == f"BN momentum at k = 16 (B = 512): no rule compared with the true batch; {said}.", line


def _running_means(rows: list[dict], k: int) -> str:
    from tests.test_report_zipped import ZIP

    study = _study(rows, (*VARIED, "weight_decay"))
    assert set(study.trials["weight_decay"]) == set(ZIP.values())
    [means] = [s for s in summarize(study.trials, study.history, None, None, study.varied)
               if s.startswith(f"At k = {k} ")]
    return means


def test_a_zipped_bn_rule_s_running_means_are_held_against_its_own_twin():
    """BN rule zipped with weight decay: '(true batch: 0.054)' was the mean over the twins at every weight decay,
    while each rule is paired with its own (0.011, 0.041, 0.11)."""
    from tests.test_report_zipped import _zipped

    rows = [{**r, "bn_mean_error": round(0.01 + r["weight_decay"] + 0.001 * r["seed"], 4)} for r in _zipped()]
    means = _running_means(rows, 16)
    assert "(each rule's true batch at its own weight decay: default 0.011, scaled 0.041, matched 0.11)" in means, \
        means


def test_a_zipped_bn_rule_without_a_twin_is_named_beside_the_running_means():
    """Without scaled's true batch at B = 128, the sentence read 'not resolved from the true batch's with 3 seeds:
    default, matched', scaled left out unsaid."""
    from tests.test_report_zipped import _zipped

    rows = [r for r in _zipped() if not (r["accum_steps"] == 1 and r["effective_batch"] == 128
                                         and r["weight_decay"] == 0.03)]
    means = _running_means(rows, 4)
    assert "scaled none" in means and means.endswith("no finished true-batch twin to compare with: scaled."), means


def test_a_bn_rule_and_its_true_batch_that_share_no_seed_are_said_so():
    """The true batch of 512 finished in seed 0 only, the rules' runs at k = 16 in seeds 1 and 2: the running means
    read '(true batch: 0.010); ... no finished true-batch twin to compare with: default, scaled, matched', and no
    final-accuracy line at k = 16 was given (zipped: 'default and matched shown to match it', scaled unsaid)."""
    from tests.test_report_zipped import ZIP, _zipped

    def failed(r):
        return {**r, "status": "FAILED", "reason": "oom", "val_acc": None, "bn_mean_error": None}
    rows = [failed(r) if (r["accum_steps"] == 1 and r["effective_batch"] == 512 and r["seed"] > 0)
            or (r["accum_steps"] == 16 and r["seed"] == 0) else r
            for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    final, line = _said(rows)
    said = "default, scaled and matched each finished in no seed that the true batch (b = 512, k = 1) finished in"
    assert final == f"Final accuracy at k = 16 against the true batch: no rule compared; {said}.", final
    assert line == f"BN momentum at k = 16 (B = 512): no rule compared with the true batch; {said}.", line
    study = _study(rows, VARIED)
    [means] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if s.startswith("At k = 16")]
    assert means.endswith("(true batch: 0.010); no seed in common with its true batch: default, scaled, matched."), \
        means

    rows = [failed(r) if r["effective_batch"] == 512 and r["weight_decay"] == ZIP["scaled"] and (
        (r["accum_steps"] == 1 and r["seed"] > 0) or (r["accum_steps"] == 16 and r["seed"] == 0)) else r
            for r in _zipped()]
    assert _running_means(rows, 16).endswith("no seed in common with its true batch: scaled."), _running_means(rows, 16)
    study = _study(rows, (*VARIED, "weight_decay"))
    apart = ("scaled's true batch (b = 512, k = 1 with its other settings) finished in no seed that scaled finished "
             "in, not compared")
    assert any(s.startswith("Final accuracy at k = 16") and apart in s
               for s in summarize(study.trials, study.history, None, None, study.varied))
    assert any(s.startswith("BN momentum at k = 16") and s.endswith(f"; {apart}.") for s in recommend(study))


def _failed(r: dict, status: str = "FAILED", reason: str | None = "oom") -> dict:
    return {**r, "status": status, "reason": reason, "val_acc": None, "bn_mean_error": None}


def _twin(r: dict, seeds) -> bool:
    return r["accum_steps"] == 1 and r["effective_batch"] == 512 and r["seed"] in seeds


def _own(r: dict, seeds) -> bool:
    return r["accum_steps"] == 16 and r["bn_momentum_rule"] == "scaled" and r["seed"] in seeds


@pytest.mark.parametrize("lost, said", [
    (lambda r: _twin(r, {0}), "not resolved from the true batch's, paired over 2 of 3 seeds (the true batch did not "
                              "finish in seed 0): default, scaled, matched."),
    (lambda r: _twin(r, {0, 1}), "cannot be told from the true batch's with one seed, paired over 1 of 3 seeds (the "
                                 "true batch did not finish in seeds 0 and 1): default, scaled, matched."),
    (lambda r: _own(r, {0, 1}), "not resolved from the true batch's with 3 seeds: default, matched; cannot be told "
                                "from the true batch's with one seed, paired over 1 of 3 seeds (scaled did not finish "
                                "in seeds 0 and 1): scaled.")], ids=["twin-lost-in-1", "twin-lost-in-2", "own-lost-in-2"])
def test_a_bn_rule_s_running_means_give_the_seeds_it_was_paired_over_with_its_twin(lost, said):
    """The true batch of 512 out of memory in seed 0 read 'not resolved from the true batch's with 2 seeds', the
    seed left out unsaid; in seeds 0 and 1 'with one seed no rule can be told from the true batch', the seeds that
    ran unsaid; scaled's own runs out of memory in seeds 0 and 1 read 'with 3 seeds: default, scaled, matched', as
    if scaled were paired over 3 seeds, not 1."""
    rows = [_failed(r) if lost(r) else r for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    study = _study(rows, VARIED)
    [means] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if s.startswith("At k = 16")]
    assert means.endswith(f"; {said}"), means


def test_a_zipped_bn_rule_s_running_means_give_the_seeds_its_own_twin_finished_in():
    """scaled's true batch (weight decay 0.03) out of memory in seed 0 read 'not resolved from the true batch's
    with 3 seeds: default, scaled, matched': scaled was paired over 2."""
    from tests.test_report_zipped import ZIP, _zipped

    rows = [_failed(r) if _twin(r, {0}) and r["weight_decay"] == ZIP["scaled"] else r for r in _zipped()]
    means = _running_means(rows, 16)
    assert means.endswith("; not resolved from the true batch's with 3 seeds: default, matched; not resolved from the "
                          "true batch's, paired over 2 of 3 seeds (scaled's true batch did not finish in seed 0): "
                          "scaled."), means


@pytest.mark.parametrize("status, state", [("RUNNING", "still marked running"), ("KILLED", "killed")])
def test_a_twin_with_no_reason_logged_is_named_as_the_count_of_unfinished_trials_names_it(status, state):
    """A true batch still marked running read 'is still marked running in 3 of 3 seeds' in its twin line and '(3
    unknown)' in the count of trials that did not finish: one state, two names."""
    rows = [_failed(r, status, None) if _twin(r, {0, 1, 2}) else r
            for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    study = _study(rows, VARIED)
    found = summarize(study.trials, study.history, None, None, study.varied)
    [final] = [s for s in found if s.startswith("Final accuracy at k = 16")]
    [count] = [s for s in found if "trials did not finish" in s]
    assert final.endswith(f" {state} in 3 of 3 seeds."), final
    assert f"(3 {state})" in count, count


def test_a_seed_with_no_run_is_told_apart_from_a_run_that_did_not_finish():
    """A true batch with no run logged in seed 0 read 'paired over 2 of 3 seeds (the true batch did not finish in
    seed 0)', as if it had started; given every run's status, a seed with none is said to have none."""
    from batchsweep.analysis.measures import finished
    from batchsweep.analysis.rules import unpaired

    rows = [_failed(r) if _own(r, {1}) else r for r in _bn_grid("cnn1d", "batch", False, measured=True)
            if not (_twin(r, {0}) or _own(r, {0}))]
    t = _study(rows, VARIED).trials
    mine = t[(t["accum_steps"] == 16) & (t["bn_momentum_rule"] == "scaled")]
    twin = t[(t["accum_steps"] == 1) & (t["effective_batch"] == 512)]
    said = unpaired([0, 1, 2], finished(mine), finished(twin), "bn_mean_error", "scaled", "the true batch",
                    (mine, twin))
    assert said == "scaled has no run and the true batch has no run in seed 0; scaled did not finish in seed 1", said


@pytest.mark.parametrize("gone, said", [
    (lambda r: _twin(r, {0}), "not resolved from the true batch's, paired over 2 of 3 seeds (the true batch has no "
                              "run in seed 0): default, scaled, matched."),
    (lambda r: _own(r, {0, 1}), "not resolved from the true batch's with 3 seeds: default, matched; cannot be told "
                                "from the true batch's with one seed, paired over 1 of 3 seeds (scaled has no run in "
                                "seeds 0 and 1): scaled.")], ids=["twin-absent-in-1", "own-absent-in-2"])
def test_a_bn_rule_s_running_means_say_a_seed_with_no_run_has_none(gone, said):
    """With no true batch of 512 logged in seed 0 the line read '(the true batch did not finish in seed 0)', as if
    it had run; with no run of scaled at k = 16 in seeds 0 and 1, '(scaled did not finish in seeds 0 and 1)'."""
    study = _study([r for r in _bn_grid("cnn1d", "batch", False, measured=True) if not gone(r)], VARIED)
    [means] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if s.startswith("At k = 16")]
    assert means.endswith(f"; {said}"), means


@pytest.mark.parametrize("lost, said", [
    (lambda r: False, "not resolved from the true batch's with 3 seeds: default, scaled, matched."),
    (lambda r: _twin(r, {0}), "not resolved from the true batch's, paired over 2 of 3 seeds (the true batch did not "
                              "finish in seed 0): default, scaled, matched.")], ids=["none-lost", "twin-lost-in-1"])
def test_a_seed_run_only_at_other_settings_leaves_out_no_bn_rule_s_seed(lost, said):
    """A seed 3 run only at b = 32, k = 1 read at k = 16 'paired over 3 of 4 seeds (default did not finish and the
    true batch did not finish in seed 3): default; ... scaled; ... matched', once per rule: the seeds counted were
    the study's, not those that ran at k = 16 or its true batch."""
    base = _bn_grid("cnn1d", "batch", False, measured=True)
    rows = [_failed(r) if lost(r) else r for r in base] + [
        dict(r, seed=3, run_id=f"{r['run_id']}-3") for r in base
        if r["seed"] == 0 and r["accum_steps"] == 1 and r["physical_batch"] == 32]
    study = _study(rows, VARIED)
    assert set(study.trials["seed"]) == {0, 1, 2, 3}
    [means] = [s for s in summarize(study.trials, study.history, None, None, study.varied) if s.startswith("At k = 16")]
    assert means.endswith(f"; {said}"), means
