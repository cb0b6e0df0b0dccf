"""A BN momentum rule zipped with another field ("bn_momentum_rule+weight_decay"): the grid runs every k = 1 point
(B = 32 and the true-batch twins) under the default rule, whatever its weight decay. An accumulated run's twin is
the true-batch run at its B with its weight decay, not every run labelled default."""
import dataclasses

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import VARIED, _bars, _bn_grid, _drawn, _history

ZIP = {"default": 0.0, "scaled": 0.03, "matched": 0.1}


def _zipped(model: str = "cnn1d", noted: bool = False) -> list[dict]:
    """Each rule's arm at its own weight decay; at k = 1 every arm's runs labelled default. A weight decay above 0
    costs 10 points at every B, and each accumulated run is its own twin's accuracy + 0.1 points by seed."""
    rows = []
    for rule, wd in ZIP.items():
        for r in _bn_grid(model, "batch", noted, measured=model == "cnn1d", weight_decay=wd):
            if r["accum_steps"] > 1 and r["bn_momentum_rule"] != rule:
                continue
            drop = 0.1 if wd else 0.0
            up = 0.001 * (r["seed"] % 2) if r["accum_steps"] > 1 else 0.0
            rows.append({**r, "run_id": f"{rule}{r['run_id']}", "val_acc": round(r["val_acc"] - drop + up, 3)})
    return rows


def test_an_accumulated_bn_rule_is_compared_with_the_true_batch_at_its_own_weight_decay():
    """default (weight decay 0) read '... 6.7 points above, 95% CI ...': its true batch was every run labelled
    default at B, at weight decays 0, 0.03 and 0.1 alike. Against its twin at weight decay 0 it is within 0.1
    points, as each arm is against its own."""
    study = _study(_zipped(), (*VARIED, "weight_decay"))
    found, lines = summarize(study.trials, study.history, None, None, study.varied), recommend(study)
    finals = [s for s in found if s.startswith("Final accuracy at k")]
    assert len(finals) == 2, found
    for s in finals:
        assert "above" not in s and "below" not in s, s
    [twins] = [s for s in found if s.startswith("Accumulation and its true-batch twin")]
    assert "compared in 6 pairs" in twins and "resolved in 0" in twins, twins
    for s in [l for l in lines if l.startswith("BN momentum at k")]:
        assert "resolved better" not in s and "resolved worse" not in s, s


def test_a_bn_rule_without_a_true_batch_at_its_weight_decay_is_said_to_have_none():
    """Without scaled's true-batch runs (weight decay 0.03), scaled was compared with those of the other arms."""
    rows = [r for r in _zipped() if not (r["accum_steps"] == 1 and r["effective_batch"] > 32
                                         and r["weight_decay"] == 0.03)]
    study = _study(rows, (*VARIED, "weight_decay"))
    found = summarize(study.trials, study.history, None, None, study.varied)
    [final] = [s for s in found if s.startswith("Final accuracy at k = 4")]
    assert "scaled has no true-batch twin" in final and "scaled not resolved" not in final, final


def test_the_steps_finding_counts_each_arm_at_its_own_weight_decay():
    """'For default (at B = 128, 4 of 8 runs ...)': default's series held the runs at every weight decay at
    k = 1. Its series is its 3 accumulated runs at B = 128; the true batch at its weight decay is a series of its
    own, 3 runs there, not 9."""
    rows = _zipped()
    rows = [{**r, "val_acc": 0.5} if r["effective_batch"] == 128 and r["seed"] < 2 else r for r in rows]
    study = dataclasses.replace(_study(rows, (*VARIED, "weight_decay")), history=_history(rows))
    found = summarize(study.trials, study.history, None, None, study.varied)
    default = [s for s in found if s.startswith("For default")]
    assert default and "at B = 128, 2 of 3 runs never reached it" in default[0], default
    [true] = [s for s in found if s.startswith("For true batch at default's settings")]
    assert "at B = 128, 2 of 3 runs never reached it" in true, true


def test_the_accuracy_figure_draws_each_arm_s_true_batch_at_its_weight_decay():
    """mlp: 'default / true batch' was the mean over weight decays 0, 0.03 and 0.1 beside 'default / accumulated'
    at weight decay 0, 6.6 points apart where each arm's pair is 0.05 apart."""
    rows = [{**r, "memory_source": "saved_tensors"} for r in _zipped("mlp", noted=True)]
    study = dataclasses.replace(_study(rows, (*VARIED, "weight_decay")), history=_history(rows))
    figure = _drawn(study, "accuracy_vs_batch")
    ax = figure.figure.axes[0]
    lines = {c.get_label(): dict(zip(c.lines[0].get_xdata(), c.lines[0].get_ydata())) for c in ax.containers}
    assert _bars(figure)
    for label, points in lines.items():
        if "true batch" in label:
            twin = lines[label.replace("true batch", "accumulated")]
            for b in (128, 512):
                assert abs(points[b] - twin[b]) < 0.5, (label, points, twin)


def test_a_study_varying_norm_judges_the_bn_rules_on_the_runs_with_batchnorm_alone():
    """cnn1d with norm = batch and none in one study: scaled's 1.4 points above the true batch read '0.7 points
    above ... inside the ±1 point equivalence margin', pooled with the runs without BatchNorm."""
    from tests.test_report_no_batchnorm import _bn_grid as grid

    bn = [{**r, "run_id": "b" + r["run_id"], "val_acc": r["val_acc"] + (0.014 + 0.001 * (r["seed"] - 1)
           if r["bn_momentum_rule"] == "scaled" else 0)} for r in grid("cnn1d", "batch", False, measured=True)]
    none = [{**r, "run_id": "n" + r["run_id"], "val_acc": r["val_acc"] - 0.05} for r in grid("cnn1d", "none", True)]
    study = _study(bn + none, (*VARIED, "norm"))
    found = summarize(study.trials, study.history, None, None, study.varied)
    [final] = [s for s in found if s.startswith("norm = batch: final accuracy at k = 4")]
    assert "scaled 1.4 points above, 95% CI +1.2 to +1.6" in final, final


def test_a_study_mixing_models_counts_a_model_without_batchnorm_s_rules_as_one_configuration():
    """cnn1d (BatchNorm) and mlp in one study: the BN rules were checked over the whole study, so mlp's identical
    runs under its three rules counted as separate runs (its twin pairs over 9 runs a seed, not 3)."""
    rows = _bn_grid("mlp", "batch", True) + [{**r, "run_id": "c" + r["run_id"]}
                                             for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    study = _study(rows, (*VARIED, "model"))
    found, lines = summarize(study.trials, study.history, None, None, study.varied), recommend(study)
    assert any(s.startswith("mlp: the model has no BatchNorm") and "count as one configuration" in s
               for s in found), found
    assert any(s.startswith("On mlp: the model has no BatchNorm") for s in lines), lines
