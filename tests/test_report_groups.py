"""A study that mixes models (or datasets, or norms) gets each group's figures drawn from its own runs, as its
findings group them (measures.group_keys): a line pooled over cnn1d and mlp holds for neither."""
from batchsweep.analysis.render import _candidates, write_report
from tests.test_recommend_edges import _study
from tests.test_report_no_batchnorm import VARIED, _bars, _bn_grid


def _mixed() -> list[dict]:
    """bn_momentum's grid on cnn1d (BatchNorm) and on mlp (none, its runs under the three rules identical), mlp
    40 points lower at every B."""
    mlp = [{**r, "run_id": "m" + r["run_id"], "val_acc": round(r["val_acc"] - 0.4, 3)}
           for r in _bn_grid("mlp", "batch", True)]
    rows = mlp + [{**r, "run_id": "c" + r["run_id"]} for r in _bn_grid("cnn1d", "batch", False, measured=True)]
    return [{**r, "memory_source": "saved_tensors"} for r in rows]


def _points(figure) -> dict[str, dict[int, float]]:
    """Per line of an accuracy figure, its mean at each B, in points."""
    return {c.get_label(): {int(x): round(float(y), 6) for x, y in zip(*c.lines[0].get_data())}
            for c in figure.figure.axes[0].containers}


def test_a_study_mixing_models_draws_each_model_s_figures_from_its_own_runs():
    """The accuracy figure averaged cnn1d's and mlp's runs in one line (at B = 32 70.2%, halfway between 90.2%
    and 50.2%, its interval over the models as seeds), and the BN-rules figure drew mlp's runs under rules no layer
    of it uses."""
    study = _study(_mixed(), (*VARIED, "model"))
    figures = [f for f in (draw() for draw in _candidates(study)) if f is not None]
    accuracy = [f for f in figures if f.name == "accuracy_vs_batch"]
    at_32 = [{line[32] for line in _points(f).values() if 32 in line} for f in accuracy]
    assert at_32 == [{90.2}, {50.2}], at_32  # (seeds 0, 1, 2 at 0.900, 0.902, 0.904, mlp 0.4 less)
    accuracy = {f.group: f for f in accuracy}
    assert list(accuracy) == ["cnn1d", "mlp"], accuracy
    bars = _bars(accuracy["mlp"])  # mlp's three identical rules one configuration: its 3 seeds, as its twin's
    assert bars["accumulated"][128] == bars["true batch"][128], bars
    assert [f.group for f in figures if f.name == "bn_rules"] == ["cnn1d"]


def test_the_report_names_each_group_s_figures_by_it(tmp_path):
    """Each group's figure has its own file and caption; mlp has no BN-rules figure."""
    study = _study(_mixed(), (*VARIED, "model"))
    written, _ = write_report([study], tmp_path)
    names = {p.name for p in written}
    assert {"cnn1d-accuracy_vs_batch.png", "mlp-accuracy_vs_batch.png", "cnn1d-bn_rules.png"} <= names, names
    assert not {"accuracy_vs_batch.png", "bn_rules.png", "mlp-bn_rules.png"} & names, names
    text = (tmp_path / "report.md").read_text()
    for model in ("cnn1d", "mlp"):
        assert f"![{model}: Validation accuracy against effective batch]({model}-accuracy_vs_batch.png)" in text, text
