"""Checkpoints of a study: a checkpoint is refused in one line unless it is one of this run's; the clean-up never
removes the folder of a trial that is still training, nor the best model of another machine's invocation that
still runs; it works on every kind of storage."""
import json
import re

import optuna
import pytest
import torch

from tests.conftest import in_process
from tests.test_train_cli import one_line_error

ARGS = ["--model", "mlp", "--dataset", "tests.factories:blobs", "--epochs", "2", "--device", "cpu"]


def saved(folder):
    return torch.load(folder / "checkpoint.pt", weights_only=True)


@pytest.mark.parametrize("change,expected", [
    (lambda s: s["model"].update({k: torch.zeros(3, 3) for k in list(s["model"])[:1]}),
     "does not fit this run's model (Error(s) in loading state_dict"),
    (lambda s: s.pop("probes"), "is not one of this run's (no probes)"),
    (lambda s: s.pop("rng"), "is not one of this run's (no rng)"),
    (lambda s: s.update(planted=1), "is not one of this run's (unknown planted)"),
    (lambda s: s["progress"].update(epoch=5, finished=True), "is not one of this run's (it stands at epoch 5 of a "
                                                             "2-epoch run)"),
    (lambda s: s["progress"].update(epoch=1, finished=True), "is not one of this run's (it is marked finished at "
                                                             "epoch 1 of 2)"),
])
def test_a_checkpoint_that_is_not_this_runs_is_one_line_that_names_it(capsys, tmp_path, change, expected):
    from batchsweep.trainers.cli import main

    folder = tmp_path / "run"
    args = [*ARGS, "--checkpoint-dir", str(folder)]
    assert main(args) == 0
    state = saved(folder)
    state["progress"].update(epoch=1, finished=False)  # as if killed after epoch 1
    change(state)
    torch.save(state, folder / "checkpoint.pt")
    line = one_line_error(capsys, args)
    assert line.startswith(f"error: checkpoint {folder}/checkpoint.pt ") and expected in line, line


def test_a_finished_run_asked_for_more_epochs_is_told_which_field_differs(capsys, tmp_path):
    """Its schedule was of 2 epochs: the checkpoint is of another configuration, not a damaged one of this run."""
    from batchsweep.trainers.cli import main

    args = [*ARGS, "--checkpoint-dir", str(tmp_path / "run")]
    assert main(args) == 0
    line = one_line_error(capsys, [*args, "--epochs", "3"])
    assert "is of another configuration (epochs 2 there, 3 here): pass another --checkpoint-dir" in line, line


def test_a_trainer_error_under_a_launcher_says_its_kind(tmp_path, capsys):
    """Under torchrun the launcher cannot see a rank's exit status: the trainer writes its error's kind beside the
    epochs' rows, and only a configuration error makes a point invalid for good."""
    from batchsweep.sweeps.launch.torchrun import _failure
    from batchsweep.trainers import ConfigError
    from batchsweep.trainers.cli import main

    folder, rows = tmp_path / "run", tmp_path / "rows.jsonl"
    args = [*ARGS, "--checkpoint-dir", str(folder), "--epochs-jsonl", str(rows)]
    assert main(args) == 0  # (trainers/train.py's main, in this process: what a rank runs)
    (folder / "checkpoint.pt").write_bytes(b"damaged")
    capsys.readouterr()
    assert main(args) == 2
    errors = [json.loads(line) for line in rows.read_text().splitlines() if "error" in json.loads(line)]
    assert [e["error"] for e in errors] == ["CheckpointError"]
    failure = _failure(1, capsys.readouterr().err, errors)
    assert not isinstance(failure, ConfigError) and "cannot be read" in str(failure)
    assert isinstance(_failure(1, "error: b*k > n\n", [{"error": "ConfigError", "message": "b*k > n"}]), ConfigError)
    assert not isinstance(_failure(1, "error: something\n", []), ConfigError)  # no kind known: it runs again


STUDY = """name = "cleanup"
[fixed]
model = "mlp"
dataset = "tests.factories:blobs"
device = "cpu"
[grid]
physical_batch = [8, 16, 32]
"""


# A trial asked for by hand stands for a running one; a worker runs its trial through optimize(), which Optuna's
# heartbeat expects.
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
@pytest.mark.parametrize("storage_kind", ["sqlite", "journal"])
def test_the_clean_up_keeps_what_running_trials_and_invocations_need(tmp_path, storage_kind):
    """Planted trials, as a race and a second machine leave them: a duplicate of a point that another trial
    trains, and the best trial of another invocation that still runs."""
    from batchsweep.sweeps.trials.checkpoints import Cleanup, folder_of
    from batchsweep.sweeps.trials.invocation import Invocation
    from batchsweep.sweeps.stores.optuna_store import create_studies, open_storage
    from batchsweep.sweeps.study.files import parse, tomllib  # (tomli below Python 3.11)
    from batchsweep.sweeps.stores.mlflow_store import Tracker

    study = parse(tomllib.loads(STUDY), "cleanup.toml")
    storage_url = f"sqlite:///{tmp_path}/optuna.db" if storage_kind == "sqlite" else f"journal:{tmp_path}/optuna.log"
    inv = Invocation(study=study, base=__import__("trainers").TrainConfig(**study.fixed), seeds=(0,),
                     study_name="cleanup", storage=storage_url, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
                     checkpoint_dir=str(tmp_path / "checkpoints"), log_models="best")
    storage = open_storage(inv.storage)
    create_studies(inv, storage)
    tracker = Tracker(inv.tracking_uri, inv.study_name)
    mine = tracker.start_parent("mine", {}, {})
    theirs = tracker.start_parent("theirs", {}, {})  # another machine's invocation, still running
    live, done, other_best = ({"physical_batch": b, "seed": 0} for b in (8, 16, 32))
    optuna_study = optuna.load_study(study_name="cleanup", storage=storage)

    def folder(config, number):
        path = folder_of(inv, inv.config({k: v for k, v in config.items() if k != "seed"}, 0), number)
        path.mkdir(parents=True, exist_ok=True)
        (path / "checkpoint.pt").write_bytes(b"")
        return path

    running = optuna_study.ask()  # trains `live`
    running.set_user_attr("config", live)
    optuna_study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs={
        "config": live, "reason": "duplicate"}))  # lost the race for `live`, kept its config
    for config, invocation, value in ((done, mine, 0.5), (other_best, theirs, 0.9)):
        run = tracker.start_trial(invocation, "t", {}, {})
        optuna_study.add_trial(optuna.trial.create_trial(value=value, user_attrs={
            "config": config, "invocation": invocation, "mlflow_run_id": run}))
    live_folder, done_folder, other_folder = folder(live, 0), folder(done, 2), folder(other_best, 3)
    Cleanup(inv, storage, tracker).spare(mine)
    assert live_folder.exists() and other_folder.exists()  # a running trial's, the other invocation's best
    assert done_folder.exists()  # this invocation's best so far
    said = []
    tracker.finish(mine, "FINISHED")
    (done_folder / "checkpoint.pt").unlink()  # gone: the model cannot be logged, and it says so
    Cleanup(inv, storage, tracker).keep_models(mine, said.append)
    assert any("checkpoint" in line and "is gone" in line for line in said), said
    assert live_folder.exists() and other_folder.exists() and not done_folder.exists()
    tracker.finish(theirs, "FINISHED")
    optuna_study.tell(running, 0.7)
    Cleanup(inv, storage, tracker).keep_models(theirs, said.append)
    assert not any(p.exists() for p in (live_folder, other_folder))


RACE = """name = "race"
[fixed]
model = "tests.factories:killable"
dataset = "tests.factories:jittered"
physical_batch = 4
accum_steps = 2
optimizer = "adamw"
base_lr = 0.01
device = "cpu"
[grid]
epochs = [8, 2]
"""


@pytest.mark.slow
def test_a_race_for_a_point_and_a_kill_leave_the_live_trials_checkpoint(tmp_path, monkeypatch):
    """Two workers: one trains the 8-epoch point, the other the 2-epoch one, with the trial that lost a race for
    the 8-epoch point already in the storage (as two machines starting together leave it). The short trial's
    clean-up must not remove the long one's folder; the long one is then killed in epoch 6, resumes from its
    checkpoint (in the same invocation when a worker is free for it, else in the next), and its model is logged:
    with --log-models all, since both trials reach the same accuracy and either may be the best."""
    from mlflow import MlflowClient

    from batchsweep.sweeps import cli

    (tmp_path / "race.toml").write_text(RACE)
    storage = f"sqlite:///{tmp_path}/mlruns/optuna.db"
    (tmp_path / "mlruns").mkdir()
    study = optuna.create_study(storage=storage, study_name="race", direction="maximize")
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, user_attrs={
        "config": {"epochs": 8, "seed": 0}, "reason": "duplicate"}))
    marker = tmp_path / "marker"
    marker.write_text("kill once")
    monkeypatch.setenv("BATCHSWEEP_TEST_KILL", f"{marker}:train:55")  # 10 forwards an epoch: in epoch 6 of the long
    # trial, in a worker process; the main process is this one (its imports paid), which the kill does not reach.

    def run():
        return in_process(cli.main, tmp_path, "--study", "race.toml", "--seeds", "1", "--workers", "2",
                          "--log-models", "all", "--no-report")

    first = run()
    assert not marker.exists(), first.stderr  # the long trial reached epoch 6: its folder was there to write to
    assert re.search(r"warning: worker \d was killed by SIGKILL", first.stderr), first.stderr
    assert "cannot write checkpoint" not in first.stderr, first.stderr
    second = run()
    assert second.returncode == 0, second.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("race").experiment_id], "tags.`mlflow.parentRunId` != ''")
    long = [r for r in runs if r.data.params["epochs"] == "8" and r.info.status == "FINISHED"]
    assert len(long) == 1 and long[0].data.tags["resumed_after_epoch"] == "5", [r.data.tags for r in long]
    assert long[0].data.tags.get("batchsweep.model") in ("pytorch", "state_dict"), second.stderr  # its model
    assert not any(r.info.status == "RUNNING" for r in runs)
    trials = optuna.load_study(study_name="race", storage=storage).trials
    complete = [t.user_attrs["config"]["epochs"] for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(complete) == [2, 8]
