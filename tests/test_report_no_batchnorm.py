"""The report of a model without BatchNorm names no BN momentum rule and draws no figure of them, whether `norm`
says so (cnn1d, norm = none) or the trainer's note does (mlp, recorded with norm = batch)."""
import math

import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study

VARIED = ("physical_batch", "accum_steps", "bn_momentum_rule")
NOTE = "bn_momentum_rule={rule!r} has no effect: model {model!r} has no BatchNorm layer"


def _bn_grid(model: str, norm: str, noted: bool, seeds=(0, 1, 2), **extra) -> list[dict]:
    """bn_momentum's grid as the sweep runs it: b = 32, k in 1, 4, 16, each BN rule at k > 1, and k = 1 and the
    true-batch twins under default alone (every rule is the default momentum there); `noted`: the non-default
    rules' runs carry the trainer's note."""
    rows = []
    for seed in seeds:
        for b, k, rule in [(32, 1, "default"), *((32, k, r) for k in (4, 16) for r in ("default", "scaled", "matched")),
                           (128, 1, "default"), (512, 1, "default")]:
            value = 0.9 - 0.01 * math.log2(b * k / 32) + 0.002 * seed
            rows.append(dict(seed=seed, physical_batch=b, accum_steps=k, effective_batch=b * k, base_batch=32,
                             bn_momentum_rule=rule, lr_rule="sqrt", model=model, norm=norm, status="FINISHED",
                             reason=None, run_id=f"r{len(rows)}", val_acc=round(value, 3), peak_memory_bytes=1e3 * b,
                             warnings=NOTE.format(rule=rule, model=model) if noted and rule != "default" else None,
                             **extra))
    return rows


@pytest.mark.parametrize("model, norm, noted, why", [("mlp", "batch", True, "mlp, in whose runs the trainer found no "
                                                      "BatchNorm layer"), ("cnn1d", "none", False, "norm = none")])
def test_a_model_without_batchnorm_labels_no_twin_pair_with_a_bn_momentum_rule(model, norm, noted, why):
    """bn_momentum on mlp: the twin pairs read 'default at B = 128', the final accuracy was ranked by BN rule
    ('BN momentum at k = 4 ...: default, scaled and matched ...'), as mlp is recorded with norm = batch. With
    norm = none the rules read 'did not each run under every value of the other fields (physical_batch and
    accum_steps)', as k = 1 and the twins run under default alone, and the pairs 'default at B = 128' too."""
    study = _study(_bn_grid(model, norm, noted), VARIED)
    said = (f"The model has no BatchNorm ({why}): the BN momentum rules default, scaled and matched set a momentum no "
            f"layer uses, so they count as one configuration (the runs under default); no BN momentum rule is ranked.")
    found, lines = summarize(study.trials, study.history, None, None, study.varied), recommend(study)
    assert found[0] == said and lines[0] == said, (found[0], lines[0])
    [twins] = [s for s in found if s.startswith("Accumulation and its true-batch twin")]
    assert "(B = 128; B = 512)" in twins, twins
    for s in [*found, *lines]:
        assert not any(w in s for w in ("default at B", "BN default", "BN momentum at k", "Final accuracy at k")), s


def test_a_model_without_batchnorm_whose_bn_rule_moves_with_a_field_pools_its_twins_by_b():
    """norm = none, each BN rule with its own weight decay, every run kept: the twin pairs were named by BN rule
    ('default at B = 512; scaled at B = 512; ...'); each B is one pair over every run there, paired by seed."""
    rows = []
    for rule, wd in (("default", 0.0), ("scaled", 0.001), ("matched", 0.01)):
        rows += [{**r, "bn_momentum_rule": rule, "run_id": f"{rule}{r['run_id']}"} for r in
                 _bn_grid("cnn1d", "none", False, weight_decay=wd) if r["accum_steps"] > 1 or r["physical_batch"] > 32]
    rows += [r for r in _bn_grid("cnn1d", "none", False) if r["effective_batch"] == 32]
    study = _study(rows, (*VARIED, "weight_decay"))
    found = summarize(study.trials, study.history, None, None, study.varied)
    assert "every run is kept" in found[0], found[0]
    [twins] = [s for s in found if s.startswith("Accumulation and its true-batch twin")]
    assert "compared in 2 pairs" in twins and "(B = 128; B = 512)" in twins, twins
    assert not any(r in twins for r in ("default", "scaled", "matched")), twins


@pytest.mark.parametrize("model, norm, noted, drawn", [("mlp", "batch", True, False), ("cnn1d", "none", False, False),
                                                       ("cnn1d", "batch", False, True)])
def test_the_figures_show_bn_momentum_rules_only_for_a_model_with_batchnorm(model, norm, noted, drawn):
    """'Accuracy by BatchNorm momentum rule' was drawn for mlp and for norm = none, and the learning curves were
    split by BN rule: rules no layer uses."""
    import matplotlib.pyplot as plt

    from batchsweep.analysis.figures import bn_rules
    from batchsweep.analysis.plotting import split

    trials = _study(_bn_grid(model, norm, noted), VARIED).trials
    figure = bn_rules(trials)
    if figure is not None:
        plt.close(figure.figure)
    assert (figure is not None) == drawn
    assert (split(trials)[0] == "bn_momentum_rule") == drawn, split(trials)

