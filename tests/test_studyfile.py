"""Study files: the built-ins as files, validation in one line, searches and outcomes, a user's own study."""
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from batchsweep.analysis.runs import load_studies
from batchsweep.analysis.space import objectives_front
from batchsweep.sweeps.cli import main
from batchsweep.sweeps.stores.outcomes import OUTCOMES, holds
from batchsweep.sweeps.study.search import GridSearch, SamplerSearch, make_search
from batchsweep.sweeps.study.spec import point_key
from batchsweep.sweeps.study.files import builtin_names, load, parse
from tests.conftest import in_process
from tests.test_sweeps import child_runs, stores, wait_for_complete
from batchsweep.trainers import DERIVED, TrainConfig

State = optuna.trial.TrialState
K = (1, 2, 4, 8, 16)


def old_twins(points):
    """The registry's twins() before study files, kept here as the reference."""
    out = list(points)
    for p in points:
        if p.get("accum_steps", 1) > 1:
            twin = {**p, "physical_batch": p["physical_batch"] * p["accum_steps"], "accum_steps": 1}
            if "bn_momentum_rule" in twin:
                twin["bn_momentum_rule"] = "default"
            if twin not in out:
                out.append(twin)
    return out


# The points of the built-in studies as sweeps/study/spec.py wrote them in Python before they became files.
BEFORE = {
    "accum_lr": old_twins([dict(physical_batch=32, accum_steps=k, lr_rule=r) for k in K
                           for r in ("none", "linear", "sqrt")]),
    "bn_momentum": old_twins([dict(physical_batch=32, accum_steps=1, bn_momentum_rule="default")]
                             + [dict(physical_batch=32, accum_steps=k, bn_momentum_rule=r)
                                for k in (4, 16) for r in ("default", "scaled", "matched")]),
    "adam_lr": [dict(physical_batch=32, accum_steps=k, lr_rule=r) for k in (1, 4, 8)
                for r in ("none", "linear", "sqrt", "adam_sqrt", "adam_halflife")],  # (no twins since issue 102)
    "adam_lr_search": [dict(base_lr=lr, physical_batch=b, accum_steps=k)
                       for lr in (4e-3, 1.4e-3, 1.1e-2, 5e-4, 3.2e-2, 9e-2, 0.25)
                       for b, k in ((8, 1), (16, 1), (32, 2), (128, 2))],
    "batch_warmup": [dict(accum_steps=k, batch_warmup=w) for k, w in ((8, ""), (8, "32,64,128"), (1, ""))],
    "critical_batch": [dict(accum_steps=2, batch_warmup="", epochs=10)]
    + [dict(accum_steps=k, batch_warmup=",".join(["32"] * t), epochs=t + 2) for t in (1, 2, 4, 8) for k in (4, 8, 16, 32)],
    "batch_memory": [dict(physical_batch=2 ** i, accum_steps=k) for k in (1, 4) for i in range(3, 11)],
    "lr_search": [dict(physical_batch=32, accum_steps=2 ** i) for i in range(6)],
    "equivalence": [dict(model=m, dataset=d, physical_batch=32, accum_steps=k)
                    for m, d in (("mlp", "mnist1d"), ("cnn1d", "mnist1d"), ("gpt", "pytext")) for k in (2, 4, 8)],
}


def test_the_derived_values_a_study_may_name_are_the_trainers():
    """Named once in trainers/config.py, without building a TrainConfig (which would import torch)."""
    assert DERIVED == tuple(TrainConfig(optimizer="adamw").derived())


def test_each_kind_a_study_file_may_name_has_its_objective():
    """Named in sweeps/study/spec.py, so that reading a study file imports no torch or MLflow."""
    from batchsweep.sweeps.trials.objective import OBJECTIVES
    from batchsweep.sweeps.study.spec import KINDS

    assert tuple(OBJECTIVES) == KINDS


def test_builtin_study_files_give_the_same_trials_as_before():
    # (equivalence has gained gpt on pytext, its fields joined to the model's in one axis)
    assert builtin_names() == sorted(BEFORE)
    for name, points in BEFORE.items():
        assert list(load(name).points) == points, name  # same points, same order
    assert load("lr_search").tune["base_lr"].distribution() == \
        optuna.distributions.FloatDistribution(1e-3, 2.0, log=True)
    assert (load("lr_search").sampler, load("lr_search").trials, load("lr_search").pruner) == ("tpe", 8, "median")
    assert load("equivalence").metrics == ("param_rel_diff",) and load("equivalence").directions == ("minimize",)
    assert (load("accum_lr").seeds, load("accum_lr").workers, load("accum_lr").fixed["schedule"]) == (3, 2, "cosine")


HALFLIFE = """
name = "halflife"
[fixed]
model = "gpt"
dataset = "pytext"
optimizer = "adamw"
adam_beta2 = 0.95
halflife_beta1 = true
[grid]
physical_batch = [32]
accum_steps = [1, 4]
lr_rule = ["sqrt", "adam_halflife"]
"""


def test_a_study_file_asks_the_half_life_rule_for_beta1_in_one_field(tmp_path, capsys):
    path = tmp_path / "study.toml"
    path.write_text(HALFLIFE)
    study = load(str(path))
    betas = {(p["accum_steps"], p["lr_rule"], beta): getattr(TrainConfig(**study.fixed, **p), beta)
             for p in study.points for beta in ("beta1", "beta2")}
    assert betas == pytest.approx({(1, "sqrt", "beta1"): 0.9, (1, "sqrt", "beta2"): 0.95,
                                   (1, "adam_halflife", "beta1"): 0.9, (1, "adam_halflife", "beta2"): 0.95,
                                   (4, "sqrt", "beta1"): 0.9, (4, "sqrt", "beta2"): 0.95,
                                   (4, "adam_halflife", "beta1"): 0.9 ** 4, (4, "adam_halflife", "beta2"): 0.95 ** 4})
    path.write_text(HALFLIFE.replace('"adamw"', '"sgd"'))
    assert main(["--study", str(path), "--dry-run", "--storage", f"sqlite:///{tmp_path}/o.db"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("error: lr_rule=adam_halflife is a rule for AdamW: "
                                                                "set optimizer=adamw, or use lr_rule=sqrt with SGD")


GOOD = """
name = "mine"
[grid]
physical_batch = [16]
accum_steps = [1, 4]
[tune.base_lr]
type = "float"
low = 0.01
high = 0.5
log = true
[search]
sampler = "tpe"
trials = 2
"""


@pytest.mark.parametrize("edit,expected", [
    (("", "colour = 3\n"), "colour: unknown key"),
    (('name = "mine"', 'name = "../up"'), "name: study name '../up' is not a plain name"),
    (("[grid]", "[grid]\nphysical_bacth = [1]"), "grid.physical_bacth: 'physical_bacth' is not a trainer field "
                                                "(did you mean physical_batch?)"),
    (("accum_steps = [1, 4]", 'accum_steps = ["4"]'), "grid.accum_steps: must be an integer, got text '4'"),
    (("accum_steps = [1, 4]", "accum_steps = []"), "grid.accum_steps: must be a non-empty list"),
    (("accum_steps = [1, 4]", "accum_steps = [4, 4]"), "grid.accum_steps: lists a value twice"),
    (("high = 0.5", "high = 0.001"), "tune.base_lr: needs low < high"),
    (('type = "float"', 'type = "normal"'), "tune.base_lr.type: 'normal' is not one of float, int, categorical"),
    (('sampler = "tpe"', 'sampler = "bayes"'), "search.sampler: 'bayes' is not one of grid, random, tpe"),
    (('sampler = "tpe"', 'sampler = "grid"'), "tune: needs a sampler that searches"),
    (("trials = 2", "trials = 0"), "search.trials: must be between 1 and 100,000, got 0"),
    (("trials = 2", 'trials = 2\nconstraints = ["effective_batch <== 3"]'), "search.constraints: 'effective_batch <== 3'"
                                                                            " is not `field op number`"),
    (("trials = 2", 'trials = 2\nconstraints = ["width < 3"]'), "'width' is neither a trainer field"),
    (("trials = 2", "trials = 2\ntwins = true\n[fixed]\naccum_steps = 2"), "grid.accum_steps: is also in [fixed]"),
    (("trials = 2", 'trials = 2\n[objective]\nmetrics = ["val_acc", "peak_memory_bytes"]\ndirections = ["maximize"]'),
     "objective.directions: give one direction per metric (2 metrics, 1 directions)"),
    (("trials = 2", 'trials = 2\npruner = "median"\n[objective]\nmetrics = ["val_acc", "peak_memory_bytes"]\n'
                    'directions = ["maximize", "minimize"]'), "search.pruner: Optuna prunes single-objective"),
    (("[grid]", "[grid\n"), "not valid TOML"),
    (("accum_steps = [1, 4]", '"accum_steps+model" = [[1, "mlp"], [4]]'), "grid.accum_steps+model: each value must be "
                                                                          "a list of 2 values, one for each of"),
    (("accum_steps = [1, 4]", '"accum_steps+physical_batch" = [[1, 8]]'), "grid: names a field in two axes"),
    (("accum_steps = [1, 4]", '"accum_steps+model" = [[1, 2]]'), "grid.accum_steps+model: must be text, got an "
                                                                 "integer 2"),
    (("", 'launcher = "slurm"\n'), "launcher: 'slurm' is not one of process, torchrun"),
    (("accum_steps = [1, 4]", "effective_batch = [64]"), "grid.effective_batch: effective_batch is b x k x world_size"),
    (("[grid]", '[fixed]\nphysical_batch = "auto"\n[grid]'), 'fixed.physical_batch: "auto" needs the target'),
    (("[grid]\nphysical_batch = [16]", '[fixed]\nphysical_batch = "auto"\n[grid]\neffective_batch = [64]'),
     '"auto" sets physical_batch and accum_steps itself'),
    (("[grid]\nphysical_batch = [16]", '[fixed]\nphysical_batch = "auto"\n[grid]\neffective_batch = [0]'),
     "grid.effective_batch: must be a positive integer, got an integer 0"),
    (("trials = 2", 'trials = 2\nconstraints = ["effective_batch <= 1e999"]'), "'1e999' is beyond a float's range"),
    (("trials = 2", 'trials = 2\n[objective]\nmetrics = ["val_accuracy"]'), "objective.metrics: 'val_accuracy' is "
                                                                          "not a metric its trials log (did you mean "
                                                                          "'val_acc'?)"),
])
def test_a_bad_study_file_is_one_line_naming_file_and_key(tmp_path, capsys, edit, expected):
    path = tmp_path / "study.toml"
    path.write_text(GOOD.replace(*edit) if edit[0] else edit[1] + GOOD)
    assert main(["--study", str(path), "--dry-run", "--storage", f"sqlite:///{tmp_path}/o.db"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and expected in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == [path]  # nothing written


def test_fields_joined_in_one_axis_vary_together():
    study = parse({"name": "j", "grid": {"model+dataset": [["mlp", "mnist1d"], ["gpt", "pytext"]],
                                         "accum_steps": [1, 2]}}, "j.toml")
    assert list(study.points) == [dict(model="mlp", dataset="mnist1d", accum_steps=1),
                                  dict(model="mlp", dataset="mnist1d", accum_steps=2),
                                  dict(model="gpt", dataset="pytext", accum_steps=1),
                                  dict(model="gpt", dataset="pytext", accum_steps=2)]


def test_dry_run_of_a_file_lists_its_trials_and_the_points_a_constraint_drops(tmp_path, capsys):
    path = tmp_path / "study.toml"
    path.write_text(GOOD.replace("accum_steps = [1, 4]", "accum_steps = [1, 4, 64]")
                    .replace("trials = 2", 'trials = 2\nconstraints = ["effective_batch <= 256"]'))
    assert main(["--study", str(path), "--dry-run", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("tpe x2 over base_lr") == 4  # (b16 k1, b16 k4) x 2 seeds
    assert "not run: b16 k64 breaks the constraint effective_batch <= 256" in out


def objective_for(search, mine, worker=0):
    def objective(trial):
        point, seed = search.next_point(trial, mine, set(), worker)
        return point.get("accum_steps", 1) * 0.1 + point.get("base_lr", 0) + seed * 0.01
    return objective


def test_grid_search_walks_every_point_once_and_records_optuna_params():
    study_def = parse({"name": "g", "grid": {"physical_batch": [8, 16], "accum_steps": [1, 2], "lr_rule":
                       ["none", "sqrt"]}, "search": {"twins": True}}, "test")
    search = make_search(study_def, "g", list(study_def.points), (0, 1))
    assert isinstance(search, GridSearch) and len(search.units()) == 2 * (8 + 2)  # (8, 2)'s twin is the grid's (16, 1)
    study = optuna.create_study(sampler=search.sampler(0, 0))
    study.optimize(objective_for(search, search.units()), n_trials=len(search.units()))
    keys = [point_key({k: v for k, v in t.user_attrs["config"].items() if k != "seed"}, t.user_attrs["config"]["seed"])
            for t in study.trials]
    assert keys == [point_key(u.point, u.seed) for u in search.units()]  # in order, each once
    assert search.left(study.trials, search.units(), set()) == 0
    for t in study.trials:  # every varied field is a param, over the axis's full list (twins included)
        assert t.params == {k: v for k, v in t.user_attrs["config"].items() if k != "seed"}
        assert t.distributions["physical_batch"].choices == (8, 16, 32)
    importances = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    assert set(importances) == {"physical_batch", "accum_steps", "lr_rule"}
    assert max(importances, key=importances.get) == "accum_steps"  # the objective depends on it alone
    assert set(optuna.importance.get_param_importances(study)) == set(importances)  # fANOVA, Optuna's default
    figure = optuna.visualization.plot_parallel_coordinate(study)
    assert set(figure.layout.xaxis.ticktext) >= {"physical_batch", "accum_steps", "lr_rule"}  # one axis each


def test_grid_search_yields_a_point_that_another_trial_holds():
    study_def = parse({"name": "g", "grid": {"accum_steps": [1, 2]}}, "test")
    search = make_search(study_def, "g", list(study_def.points), (0,))
    study = optuna.create_study(sampler=search.sampler(0, 0))
    study.optimize(objective_for(search, search.units()), n_trials=1)
    # A second worker whose only unit is the point already done gets Duplicate, not a second run.
    from batchsweep.sweeps.study.search import Duplicate

    trial = study.ask()
    with pytest.raises(Duplicate):
        search.next_point(trial, search.units()[:1], set())


def test_sampler_search_runs_trials_per_point_with_the_grid_pinned():
    study_def = parse({"name": "t", "grid": {"accum_steps": [1, 4]}, "tune": {"base_lr": {
        "type": "float", "low": 0.01, "high": 1.0, "log": True}, "lr_rule": {"type": "categorical", "choices":
        ["none", "sqrt"]}}, "search": {"sampler": "tpe", "trials": 5}}, "test")
    search = make_search(study_def, "t", list(study_def.points), (0,))
    assert isinstance(search, SamplerSearch)
    assert [u.study_name for u in search.units()] == ["t/accum_steps=1,seed=0", "t/accum_steps=4,seed=0"]
    for i, unit in enumerate(search.units()):
        study = optuna.create_study(sampler=search.sampler(i, 0))
        study.optimize(objective_for(search, [unit]), n_trials=5)
        assert search.left(study.trials, [unit], set()) == 0
        assert all(t.params["accum_steps"] == unit.point["accum_steps"] for t in study.trials)
        assert all(0.01 <= t.params["base_lr"] <= 1.0 and t.params["lr_rule"] in ("none", "sqrt")
                   for t in study.trials)
        assert len({t.params["base_lr"] for t in study.trials}) == 5  # searched, not fixed


def test_outcome_table_decides_state_status_and_retry():
    trial = lambda state, reason=None: optuna.trial.create_trial(
        state=state, value=None if state != State.COMPLETE else 1.0, user_attrs={"reason": reason} if reason else {})
    assert holds(trial(State.COMPLETE)) and not holds(trial(State.FAIL))
    assert not holds(trial(State.PRUNED, "duplicate")) and holds(trial(State.PRUNED, "oom"))
    assert OUTCOMES["oom"].infeasible and not OUTCOMES["pruned"].infeasible
    for o in OUTCOMES.values():  # an outcome that runs again is never COMPLETE; an infeasible one ends for good
        assert o.retry == "never" or o.state != State.COMPLETE
        assert not o.infeasible or (o.retry, o.state) == ("never", State.PRUNED)


# A user's project: a model and dataset of its own, outside the package, found from the current folder.
PROJECT = {
    "myproj/__init__.py": "",
    "myproj/nets.py": """
        from torch import nn

        def make_net(input_shape, num_classes, width=16, **_):
            return nn.Sequential(nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))
        """,
    "myproj/data.py": """
        import torch
        from torch.utils.data import TensorDataset

        def make_data(seed=0, **_):
            g = torch.Generator().manual_seed(3)
            y = torch.arange(320) % 4
            x = torch.randn(320, 6, generator=g) + 1.5 * torch.nn.functional.one_hot(y, 6)[:, :6].float()
            return TensorDataset(x[:256], y[:256]), TensorDataset(x[256:], y[256:])
        """,
}
FIXED = '[fixed]\nmodel = "myproj.nets:make_net"\ndataset = "myproj.data:make_data"\nepochs = 2\nwarmup_epochs = 0\n'


def write_project(folder):
    for name, text in PROJECT.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(textwrap.dedent(text))


def run_cmd(cwd, *args):
    # No PYTHONPATH: the installed package, and the user's modules from the current folder.
    return subprocess.Popen([sys.executable, "-m", "batchsweep.sweeps", *args, "--no-report"], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_own_study_file_with_tpe_resumes_after_a_kill(tmp_path):
    write_project(tmp_path)
    (tmp_path / "study.toml").write_text(f'name = "own_tpe"\n{FIXED}' + textwrap.dedent("""
        [grid]
        physical_batch = [8]
        accum_steps = [1, 4]
        [tune.base_lr]
        type = "float"
        low = 0.01
        high = 0.5
        log = true
        [search]
        sampler = "tpe"
        trials = 3
        pruner = "median"
        twins = true
        """))
    proc = run_cmd(tmp_path, "--study", "study.toml")
    wait_for_complete(tmp_path / "mlruns/optuna.db", 2, proc, study="own_tpe/accum_steps=1,physical_batch=8,seed=0")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = run_cmd(tmp_path, "--study", "study.toml")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    storage, client = stores(tmp_path)
    names = sorted(optuna.get_all_study_names(storage))
    assert names == ["own_tpe/accum_steps=1,physical_batch=32,seed=0", "own_tpe/accum_steps=1,physical_batch=8,seed=0",
                     "own_tpe/accum_steps=4,physical_batch=8,seed=0"]  # the twin (32, 1) included
    holding = []
    for name in names:
        trials = optuna.load_study(study_name=name, storage=storage).trials
        # A kill that lands between Optuna creating a trial and the trial naming its owner (a window the timed
        # kill above can hit) leaves a trial that holds its place and nothing else; the next invocation after
        # the heartbeat's grace fails it (test_sweeps.py::test_ownerless_trial_fails_after_grace). Either way
        # every trial that was trained is finished.
        ownerless = [t for t in trials if t.state == State.RUNNING and not t.user_attrs]
        kept = [t for t in trials if holds(t) and t.user_attrs]
        assert len(kept) + len(ownerless) == 3 and len(ownerless) <= 1, name
        assert all(t.state.is_finished() for t in kept), name
        assert all("base_lr" in t.params and "accum_steps" in t.params for t in kept)
        holding += kept
    children, parents = child_runs(client, "own_tpe")
    assert len(parents) == 2 and {r.data.tags["mlflow.parentRunId"] for r in children} <= {p.info.run_id for p in parents}
    finished = {r.info.run_id for r in children if r.info.status in ("FINISHED", "KILLED")}
    assert {t.user_attrs["mlflow_run_id"] for t in holding} <= finished  # every trial kept is one ended run
    # One seed: no trial is marked best (one run of several that seed noise cannot tell apart), and the table says so.
    assert " *" not in out and "No trial is marked best: one trial is one seed's run; with one seed" in out


def test_the_table_of_a_study_of_searches_keeps_each_searchs_trials_together(tmp_path):
    """lr_search numbers its trials per B (one TPE search each): its table lists each search's trials together,
    best first, so that '#' names one trial. With one seed it marks none best, and says why."""
    from batchsweep.sweeps.trials.invocation import Invocation
    from batchsweep.sweeps.stores.optuna_store import create_studies, open_storage
    from batchsweep.sweeps.trials.tables import results_table

    study = load("lr_search")
    inv = Invocation(study=study, base=TrainConfig(**study.fixed), seeds=(0,), study_name="lr_search",
                     storage=f"sqlite:///{tmp_path}/optuna.db", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    storage = open_storage(inv.storage)
    create_studies(inv, storage)
    for k, accuracies in ((1, (0.5, 0.9)), (2, (0.95, 0.6)), (4, (0.7, 0.8))):  # B = 64 holds the best overall
        searched = optuna.load_study(study_name=f"lr_search/accum_steps={k},physical_batch=32,seed=0", storage=storage)
        for accuracy in accuracies:
            searched.add_trial(optuna.trial.create_trial(value=accuracy, user_attrs={
                "config": {"physical_batch": 32, "accum_steps": k, "base_lr": 0.1, "seed": 0},
                "metrics": {"val_acc": accuracy}}))
    table = results_table(inv, storage).splitlines()
    rows = [line.split() for line in table[2:-1]]
    assert [(row[0], row[5]) for row in rows] == [("1", "32"), ("0", "32"), ("0", "64"), ("1", "64"), ("1", "128"),
                                                  ("0", "128")]
    assert "best" not in table[0] and not any(row[-1] == "*" for row in rows)
    assert table[-1] == ("No trial is marked best: one trial is one seed's run; with one seed no configuration can be "
                         "told from another (--seeds 3 or more).")


@pytest.mark.slow
def test_own_study_file_with_nsga2_marks_the_pareto_front(tmp_path):
    write_project(tmp_path)
    (tmp_path / "study.toml").write_text(f'name = "own_pareto"\n{FIXED}' + textwrap.dedent("""
        [tune.physical_batch]
        type = "categorical"
        choices = [8, 32, 128]
        [tune.accum_steps]
        type = "categorical"
        choices = [1, 2]
        [search]
        sampler = "nsga2"
        trials = 8
        [objective]
        metrics = ["val_acc", "peak_memory_bytes"]
        directions = ["maximize", "minimize"]
        """))
    proc = run_cmd(tmp_path, "--study", "study.toml")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    storage, client = stores(tmp_path)
    study = optuna.load_study(study_name="own_pareto/seed=0", storage=storage)
    assert len(study.trials) == 8 and all(t.state == State.COMPLETE for t in study.trials)
    front = {t.number for t in study.best_trials}
    rows = [line.split() for line in out.splitlines()[2:]]
    assert {int(r[0]) for r in rows if r[-1] == "*"} == front and 0 < len(front) < 8 + 1
    assert "front" in out.splitlines()[0]
    children, parents = child_runs(client, "own_pareto")
    assert len(children) == 8 and len(parents) == 1
    assert all(r.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for r in children)
    on_front = {r.info.run_id for r in children if r.data.tags["optuna.trial_number"] in {str(n) for n in front}}
    assert {r.info.run_id for r in children if "batchsweep.model" in r.data.tags} == on_front  # their models
    assert not list((tmp_path / "mlruns/checkpoints").rglob("checkpoint.pt"))
    # The report, from MLflow alone, draws the same front as Optuna's and says so.
    from batchsweep.analysis import cli as report_cli

    report = in_process(report_cli.main, tmp_path, "--study", "own_pareto", "--no-log")  # (its imports paid once)
    assert report.returncode == 0, report.stderr
    md = (tmp_path / "reports/own_pareto/report.md").read_text()
    assert f"holds {len(front)} of 8 finished trials" in md and "objectives_front.png" in md
    assert "parallel_coordinates.png" in md and "memory_front.png" in md
    runs = load_studies(["own_pareto"], f"sqlite:///{tmp_path}/mlruns/mlflow.db")[0]
    assert runs.varied == ("physical_batch", "accum_steps")
    assert runs.objectives == (("val_acc", "maximize"), ("peak_memory_bytes", "minimize"))
    figure = objectives_front(runs)
    assert figure is not None and figure.finding.count(": val_acc ") == min(len(front), 4)
    plotted = {tuple(p) for p in figure.figure.axes[0].lines[0].get_xydata()}
    expected = runs.trials[runs.trials["run_id"].isin(on_front)]
    assert plotted == set(zip(expected["val_acc"], expected["peak_memory_bytes"]))


def test_a_study_built_in_python(tmp_path, monkeypatch, capsys):
    (tmp_path / "userstudy.py").write_text("STUDY = {'name': 'py', 'grid': {'accum_steps': [1, 2, 4]}}\nOTHER = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--study", "userstudy:STUDY", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("\nk") == 3  # trials k1, k2, k4
    assert main(["--study", "userstudy:OTHER", "--dry-run"]) == 2
    assert "module 'userstudy' has no Study or dict named 'OTHER'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_installed_command_runs_from_any_folder(tmp_path):
    command = [str(Path(sys.executable).parent / "batchsweep")]
    usage = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert usage.returncode == 2 and "run" in usage.stdout and "report" in usage.stdout
    dry = subprocess.run(command + ["run", "--study", "equivalence", "--dry-run"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert dry.returncode == 0 and dry.stdout.count("cnn1d mnist1d b32") == 3 * 3, dry.stderr  # k, seeds
    wrong = subprocess.run(command + ["sweep"], capture_output=True, text=True, cwd=tmp_path)
    assert wrong.returncode == 2 and wrong.stderr.strip() == "error: unknown command 'sweep': use one of run, plan, " \
                                                             "report, train, audit"
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing
    # A hint names a command as the user started it: `batchsweep ...` runs here, `python sweeps/...` would not.
    (tmp_path / "work").mkdir()
    plan = subprocess.run(command + ["plan", "--target-batch", "64", "--memory-budget", "1GiB", "--model", "mlp"],
                          capture_output=True, text=True, cwd=tmp_path / "work")
    hint = plan.stdout.strip().splitlines()[-1]
    assert plan.returncode == 0 and hint.startswith("run it: batchsweep train --model mlp "), plan.stdout + plan.stderr
    (tmp_path / "work/mlruns").mkdir()
    MlflowClient(f"sqlite:///{tmp_path}/work/mlruns/mlflow.db").search_experiments()  # a store without the study
    report = subprocess.run(command + ["report", "--study", "nope"], capture_output=True, text=True,
                            cwd=tmp_path / "work")
    assert report.returncode == 2 and "run `batchsweep run --study nope` first" in report.stderr, report.stderr


def test_objective_values_and_pruners_follow_the_file():
    from batchsweep.sweeps.trials.objective import MetricMissing, make_objective

    study_def = parse({"name": "o", "grid": {"accum_steps": [1]}, "objective": {
        "metrics": ["val_acc", "peak_memory_bytes"], "directions": ["maximize", "minimize"]}}, "test")
    objective = make_objective(study_def)
    assert objective.values({"val_acc": 0.9, "peak_memory_bytes": 1e6, "x": 1}) == [0.9, 1e6]
    with pytest.raises(MetricMissing, match="'peak_memory_bytes' was not logged; this trial logged val_acc"):
        objective.values({"val_acc": 0.9})
    assert objective.epoch_value({"val_acc": 0.5}) is None  # several objectives: Optuna prunes none
    tuned = {"name": "p", "tune": {"base_lr": {"type": "float", "low": 0.01, "high": 1.0}},
             "search": {"sampler": "random", "pruner": "hyperband"}}
    search = make_search(parse(tuned, "test"), "p", [{}], (0,))
    assert isinstance(search.pruner(epochs=12), optuna.pruners.HyperbandPruner)
    assert make_objective(parse(tuned, "test")).epoch_value({"val_acc": float("nan")}) == float("-inf")


@pytest.mark.parametrize("program", [False, True])
def test_hyperband_counts_a_scripts_own_epochs_or_steps_from_its_first_completed_trial(program):
    """batchsweep's trainer reports the study's epochs: Hyperband's brackets are sized by them from the start,
    and the worse of two trials is pruned at its first epoch. A script's rows count its own epochs, or steps:
    Hyperband prunes nothing until a trial completes, and is then sized by that trial's last row."""
    body = {"name": "h", "grid": {"accum_steps": [1, 2]}, "search": {"pruner": "hyperband"}}
    if program:
        body["program"] = {"command": ["{python}", "train.py", "--accum", "{accum_steps}"]}
    search = make_search(parse(body, "test"), "h", [{"accum_steps": 1}], (0,))
    study = optuna.create_study(direction="maximize", pruner=search.pruner(epochs=2))

    def pruned(trial: optuna.Trial, value: float) -> bool:
        trial.report(value, 1)
        return trial.should_prune()

    first, worse = study.ask(), study.ask()
    assert not pruned(first, 0.9) and pruned(worse, 0.1) == (not program)
    if program:  # one trial of one step completes: one bracket, as the trainer's 2 epochs give
        study.tell(first, 0.9)
        assert not pruned(study.ask(), 0.9) and pruned(study.ask(), 0.1)


def test_a_grid_changed_under_a_running_study_stops_it_in_one_line():
    from batchsweep.sweeps.study.search import StudyChanged

    first = parse({"name": "g", "grid": {"accum_steps": [1, 2]}}, "test")
    search = make_search(first, "g", list(first.points), (0,))
    study = optuna.create_study(sampler=search.sampler(0, 0))
    study.optimize(objective_for(search, search.units()), n_trials=1)
    changed = parse({"name": "g", "grid": {"accum_steps": [1, 2, 4]}}, "test")
    search = make_search(changed, "g", list(changed.points), (0,))
    study.sampler = search.sampler(0, 0)
    with pytest.raises(StudyChanged, match=r"the \[grid\] of study g changed since its first trials: accum_steps "
                                           r"now takes \[1, 2, 4\]; restore the grid, or run it under a new"):
        study.optimize(objective_for(search, search.units()), n_trials=1)


def test_a_trials_name_says_which_field_a_number_is():
    """A run name like critical_batch's 'k2 fixed B 10' read as B = 10 where 10 was its epochs."""
    from batchsweep.sweeps.study.spec import describe

    assert describe({"accum_steps": 2, "batch_warmup": "", "epochs": 10}) == "k2 fixed B epochs=10"
    assert describe({"physical_batch": 32, "lr_rule": "sqrt", "base_lr": 0.031623, "channels_last": True}) == \
        "b32 sqrt base_lr=0.0316 channels_last=True"
