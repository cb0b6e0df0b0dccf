"""The report of a model without BatchNorm names no BN momentum rule and draws no figure of them, and its figures
count its identical runs under those rules as one configuration, as its findings do. Whether a model has BatchNorm
is what its runs measured (bn_mean_error, logged exactly where it has), else the trainer's note, else `norm` of
cnn1d, the one model it acts on."""
import math

import pytest

from batchsweep.analysis.findings import summarize
from batchsweep.analysis.recommend import recommend
from tests.test_recommend_edges import _study

VARIED = ("physical_batch", "accum_steps", "bn_momentum_rule")
NOTE = "bn_momentum_rule={rule!r} has no effect: model {model!r} has no BatchNorm layer"


def _bn_grid(model: str, norm: str, noted: bool, seeds=(0, 1, 2), measured: bool = False, **extra) -> list[dict]:
    """bn_momentum's grid as the sweep runs it: b = 32, k in 1, 4, 16, each BN rule at k > 1, and k = 1 and the
    true-batch twins under default alone (every rule is the default momentum there); `noted`: the non-default
    rules' runs carry the trainer's note; `measured`: every run logged bn_mean_error (a model with BatchNorm)."""
    rows = []
    for seed in seeds:
        for b, k, rule in [(32, 1, "default"), *((32, k, r) for k in (4, 16) for r in ("default", "scaled", "matched")),
                           (128, 1, "default"), (512, 1, "default")]:
            value = 0.9 - 0.01 * math.log2(b * k / 32) + 0.002 * seed
            rows.append(dict(seed=seed, physical_batch=b, accum_steps=k, effective_batch=b * k, base_batch=32,
                             bn_momentum_rule=rule, lr_rule="sqrt", model=model, norm=norm, status="FINISHED",
                             reason=None, run_id=f"r{len(rows)}", val_acc=round(value, 3), peak_memory_bytes=1e3 * b,
                             warnings=NOTE.format(rule=rule, model=model) if noted and rule != "default" else None,
                             **({"bn_mean_error": 0.01 + 0.001 * seed} if measured else {}), **extra))
    return rows


@pytest.mark.parametrize("model, norm, noted, why", [
    ("mlp", "batch", True, "mlp, in whose runs the trainer found no BatchNorm layer"),
    ("cnn1d", "none", False, "cnn1d with norm = none")])
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
    split by BN rule: rules no layer uses. (The figures split the trials the findings compare.)"""
    import matplotlib.pyplot as plt

    from batchsweep.analysis.figures import bn_rules
    from batchsweep.analysis.findings import one_bn_rule
    from batchsweep.analysis.plotting import split

    trials = _study(_bn_grid(model, norm, noted, measured=drawn), VARIED).trials
    figure = bn_rules(trials)
    if figure is not None:
        plt.close(figure.figure)
    assert (figure is not None) == drawn
    compared = one_bn_rule(trials, VARIED)[0]
    assert (split(compared)[0] == "bn_momentum_rule") == drawn, split(compared)



def bn_net(input_shape, num_classes, **_):
    """A user's model with BatchNorm (norm does not act on it)."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, num_classes))


def plain_net(input_shape, num_classes, **_):
    """A user's model without BatchNorm."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), nn.Linear(16, num_classes))


USER = "tests.test_report_no_batchnorm:bn_net"


def _frame(model: str, norm: str, **columns):
    """Four runs of one model at k = 1 and 4 under default and scaled, finished, with `columns` added."""
    import pandas as pd

    return pd.DataFrame([{"model": model, "norm": norm, "accum_steps": k, "bn_momentum_rule": rule,
                          "status": "FINISHED", **{c: v[i] if isinstance(v, list) else v for c, v in columns.items()}}
                         for i, (k, rule) in enumerate(((1, "default"), (4, "default"), (4, "scaled"), (1, "scaled")))])


@pytest.mark.parametrize("frame, said", [
    (_frame(USER, "none", bn_mean_error=0.01), ""),  # (measured: it has BatchNorm, whatever norm reads)
    (_frame(USER, "none"), ""),  # (nothing measured, no note: norm does not act on a user's model)
    (_frame(USER, "none", warnings=[None, None, NOTE.format(rule="scaled", model=USER), None]),
     f"{USER} with norm = none, in whose runs the trainer found no BatchNorm layer"),
    (_frame("mlp", "batch", bn_mean_error=math.nan), "mlp, in whose runs the trainer found no BatchNorm layer"),
    (_frame("cnn1d", "none", bn_mean_error=0.02), ""),  # (what was measured wins over what norm reads)
    (_frame("", "none", **{"batchsweep.program": "python train.py"}), ""),  # (a script's runs measure nothing)
    (_frame(USER, "none", status="FAILED", bn_mean_error=math.nan), ""),  # (none finished: nothing measured)
], ids=["measured", "nothing", "noted", "measured-none", "measured-over-norm", "program", "none-finished"])
def test_whether_a_model_has_batchnorm_is_what_its_runs_measured(frame, said):
    """`norm` = none read as no BatchNorm for any model, though it acts on cnn1d alone: a user's model with
    BatchNorm was reported without it. The trainer logs bn_mean_error exactly where a model has BatchNorm and the
    run finished; where none finished, its note; where neither is there, norm of cnn1d."""
    from batchsweep.analysis.measures import no_batchnorm

    assert no_batchnorm(frame) == said


def test_a_users_model_with_batchnorm_in_a_study_with_norm_none_keeps_and_ranks_its_bn_momentum_rules():
    """mynets:bn_net (BatchNorm) with norm = none: 'The model has no BatchNorm (norm = none): ... count as one
    configuration (the runs under default) ...', its scaled and matched runs dropped and no BN rule ranked."""
    study = _study(_bn_grid(USER, "none", False, measured=True), VARIED)
    found, lines = summarize(study.trials, study.history, None, None, study.varied), recommend(study)
    assert not any("no BatchNorm" in s for s in [*found, *lines]), (found[0], lines[0])
    assert any(s.startswith("Final accuracy at k = 4 against the true batch: default") for s in found), found
    assert any(s.startswith("BN momentum at k = 4") for s in lines), lines


@pytest.mark.slow
@pytest.mark.parametrize("factory, without", [("bn_net", False), ("plain_net", True)])
def test_a_real_study_of_a_users_model_with_norm_none_reads_batchnorm_from_its_runs(tmp_path, factory, without):
    """A real study (MLflow on SQLite) of a user's model with norm = none: its runs log bn_mean_error where it has
    BatchNorm, and carry the trainer's note where a BN momentum rule found none."""
    from batchsweep.analysis.measures import no_batchnorm
    from batchsweep.analysis.runs import load_studies
    from tests.test_sweeps import sweep

    model = f"tests.test_report_no_batchnorm:{factory}"
    (tmp_path / "study.toml").write_text(f'''name = "user_norm"
seeds = 1
workers = 1

[fixed]
epochs = 1
model = "{model}"
dataset = "tests.factories:blobs1k"
norm = "none"
warmup_epochs = 0

[grid]
physical_batch = [32]
accum_steps = [1, 4]
bn_momentum_rule = ["default", "scaled"]
''')
    proc = sweep(tmp_path, "--study", str(tmp_path / "study.toml"), "--no-report", "--log-models", "none")
    assert proc.returncode == 0, proc.stderr
    [study] = load_studies(["user_norm"], f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert ("bn_mean_error" in study.trials) != without, list(study.trials)
    assert no_batchnorm(study.trials) == (f"{model} with norm = none, in whose runs the trainer found no BatchNorm "
                                          f"layer" if without else "")
    first = summarize(study.trials, study.history, None, None, study.varied)[0]
    assert first.startswith("The model has no BatchNorm") == without, first


def _bars(figure) -> dict[str, dict[int, float]]:
    """Per line of an accuracy figure, each B's 95% interval's width."""
    ax = figure.figure.axes[0]
    return {c.get_label(): {int(x): round(float(seg[1][1] - seg[0][1]), 9) for x, seg in
                            zip(c.lines[0].get_xdata(), c.lines[2][0].get_segments())} for c in ax.containers}


def _drawn(study, name: str):
    from batchsweep.analysis.render import _candidates

    return next(f for f in (draw() for draw in _candidates(study)) if f is not None and f.name == name)


@pytest.mark.parametrize("rules", [("default", "scaled", "matched"), ("scaled", "matched")])
def test_the_accuracy_figure_counts_the_seeds_of_one_configuration_not_the_bn_rules_identical_runs(rules):
    """mlp, every BN rule's run identical to default's in each seed: the accumulated point at B = 128 averaged the 3
    rules' runs as 9 (its interval 0.2 points) where its twin had 3 (0.5): the runs as seeds."""
    rows = [r for r in _bn_grid("mlp", "batch", True) if r["bn_momentum_rule"] in rules or r["accum_steps"] == 1]
    bars = _bars(_drawn(_study(rows, VARIED), "accuracy_vs_batch"))
    assert set(bars) == {"accumulated", "true batch"}, bars
    assert bars["accumulated"] == {b: bars["true batch"][b] for b in (128, 512)}, bars


def _zipped() -> list[dict]:
    """norm = none, each BN rule with its own weight decay (0, 1e-3, 1e-2), 5 points apart."""
    rows = []
    for shift, (rule, wd) in enumerate((("default", 0.0), ("scaled", 0.001), ("matched", 0.01))):
        rows += [{**r, "bn_momentum_rule": rule, "run_id": f"{rule}{r['run_id']}",
                  "val_acc": r["val_acc"] - 0.05 * shift} for r in _bn_grid("cnn1d", "none", False, weight_decay=wd)
                 if r["bn_momentum_rule"] == "default" and r["effective_batch"] > 32]
    return rows + [r for r in _bn_grid("cnn1d", "none", False, weight_decay=0.0) if r["effective_batch"] == 32]


def test_the_accuracy_figure_keeps_apart_the_runs_of_bn_rules_that_moved_with_another_field():
    """Each BN rule with its own weight decay, every run kept by the findings: the figure drew one line over the
    three weight decays, its interval spanning them (9 runs at the accumulated B = 128, 27 in all)."""
    bars = _bars(_drawn(_study(_zipped(), (*VARIED, "weight_decay")), "accuracy_vs_batch"))
    assert set(bars) == {f"{r} / {half}" for r in ("default", "scaled", "matched") for half in
                         ("accumulated", "true batch")}, bars
    assert bars["scaled / accumulated"][128] == bars["scaled / true batch"][128], bars


def _history(rows: list[dict]):
    """Every run reaches its accuracy at epoch 1, after 80 (1 + B_crit / B) steps, B_crit 100, 110, 120 by seed."""
    import pandas as pd

    return pd.DataFrame([dict(run_id=r["run_id"], epoch=e, steps=e * round(80 * (1 + (100 + 10 * r["seed"]) /
                                                                                     r["effective_batch"])),
                              val_acc=r["val_acc"]) for r in rows for e in (1, 2)])


@pytest.mark.parametrize("rules", [("default", "scaled", "matched"), ("scaled", "matched")])
def test_the_steps_figure_draws_the_series_the_findings_fit(rules):
    """mlp: the findings fit one series 'Over every run'; the figure drew one per BN rule (legend
    'bn_momentum_rule', three fits, 'of a BN momentum rule at a B'). With the rules scaled and matched at k > 1
    (k = 1 under default), the findings too fit 'For default' (B = 32 alone) and 'For scaled'."""
    import dataclasses

    rows = [r for r in _bn_grid("mlp", "batch", True) if r["bn_momentum_rule"] in rules or r["accum_steps"] == 1]
    study = dataclasses.replace(_study(rows, VARIED), history=_history(rows))
    found = summarize(study.trials, study.history, None, None, study.varied)
    assert [s.split(",")[0] for s in found if s.startswith(("Over every run", "For "))] == ["Over every run"], found
    figure = _drawn(study, "steps_to_target")
    legend = figure.figure.axes[0].get_legend()
    assert legend.get_title().get_text() == "", legend.get_title().get_text()
    assert [t.get_text() for t in legend.get_texts()] == ["all", "perfect scaling (steps ∝ 1/B)"]
    assert "BN momentum" not in figure.figure._suptitle.get_text()


def test_the_runs_kept_under_two_rules_are_named_so():
    """scaled and matched at k > 1, k = 1 and the twins under default: '(the runs under scaled)', though the kept
    runs at k = 1 are under default."""
    rows = [r for r in _bn_grid("mlp", "batch", True) if r["bn_momentum_rule"] != "default" or r["accum_steps"] == 1]
    study = _study(rows, VARIED)
    said = ("The model has no BatchNorm (mlp, in whose runs the trainer found no BatchNorm layer): the BN momentum "
            "rules scaled and matched set a momentum no layer uses, so they count as one configuration (the runs under "
            "scaled at k > 1 and under default at k = 1); no BN momentum rule is ranked.")
    assert summarize(study.trials, study.history, None, None, study.varied)[0] == said
    assert recommend(study)[0] == said
