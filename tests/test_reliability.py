"""What a study must survive: metrics that appear late, a store that refuses a write, failing workers, a storage
server that goes down, damaged files, and inputs out of range."""
import csv
import os
import subprocess
import sys

import optuna
import pytest
from mlflow import MlflowClient

from batchsweep.sweeps.stores.mlflow_store import Tracker
from tests.conftest import ROOT
from tests.test_sweeps import TINY, child_runs, grid_trials, stores, sweep, wait_for_complete
from batchsweep.trainers import TrainConfig, train

State = optuna.trial.TrialState


def history_csv(client: MlflowClient, run_id: str) -> list[dict[str, str]]:
    path = client.download_artifacts(run_id, "history.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_history_takes_every_key_of_every_row(tmp_path):
    # noise_scale is not measurable in epoch 1 after a warmup: it first appears in a later row.
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "late")
    parent = tracker.start_parent("parent", {}, {})
    run_id = tracker.start_trial(parent, "trial", {"seed": 0}, {})
    history = [{"epoch": e, "val_acc": 0.5 + e / 10, **({"noise_scale": 100.0 * e} if e >= 3 else {})}
               for e in (1, 2, 3, 4)]
    assert tracker.finish(run_id, "FINISHED", history=history, metrics=dict(history[-1])) is None
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FINISHED" and "reason" not in run.data.tags
    rows = history_csv(tracker.client, run_id)
    assert [r["noise_scale"] for r in rows] == ["", "", "300.0", "400.0"]
    assert [m.step for m in tracker.client.get_metric_history(run_id, "noise_scale")] == [3, 4]


def test_a_refused_write_ends_the_run_and_says_why(tmp_path):
    # MLflow refuses a metric name with '<' in it: recording fails after training, the run must still end.
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "refused")
    parent = tracker.start_parent("parent", {}, {})
    run_id = tracker.start_trial(parent, "trial", {}, {})
    error = tracker.finish(run_id, "FINISHED", history=[{"epoch": 1, "bad<name": 1.0}], metrics={"val_acc": 0.9})
    assert error and "bad<name" in error
    run = tracker.client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["reason"] == "record_error" and run.data.tags["error"] == error
    assert tracker.open_runs == {parent}
    tracker.end_open_runs("KILLED")
    assert tracker.client.get_run(parent).info.status == "KILLED" and tracker.open_runs == set()


@pytest.mark.slow
def test_failures_in_worker_processes_reach_the_terminal(tmp_path):
    proc = sweep(tmp_path, *TINY, "--model", "tests.factories:broken_model", "--workers", "2", "--n-trials", "4",
                 process=True)  # what the workers print
    lines = proc.stderr.splitlines()
    failed = [line for line in lines if "failed: RuntimeError: factory exploded" in line]
    assert len(failed) == 4, proc.stderr
    assert "Traceback" not in proc.stderr
    # Every trial failed with an error: the command fails too, and says so.
    assert proc.returncode == 1
    assert "error: all 4 trials of study accum_lr failed with an error" in proc.stderr
    children, parents = child_runs(stores(tmp_path)[1])
    assert [r.info.status for r in children] == ["FAILED"] * 4 and parents[0].info.status == "FINISHED"


@pytest.mark.parametrize("failed, invalid, said", [
    (1, 0, "error: the one trial of study accum_lr failed with an error: see the lines above, or the 'error' tag "
           "of its MLflow run"),
    (2, 0, "error: all 2 trials of study accum_lr failed with an error: see the lines above, or the 'error' tag of "
           "their MLflow runs"),
    (0, 1, "error: the one trial of study accum_lr was invalid: see the lines above, or the 'error' tag of its "
           "MLflow run"),
    (1, 2, "error: all 3 trials of study accum_lr failed with an error or were invalid: see the lines above, or "
           "the 'error' tag of their MLflow runs"),
    (1, 1, None),  # and one complete trial
    (2, 1, "error: all 3 trials of study accum_lr failed with an error or were invalid; the last, trial 2: effective "
           "batch 5000 is larger than the training set (see the 'error' tag of their MLflow runs)"),
    (0, 1, "error: the one trial of study accum_lr was invalid; trial 0: effective batch 5000 is larger than the "
           "training set (see the 'error' tag of its MLflow run)"),
    (1, 0, "error: the one trial of study accum_lr failed with an error; trial 0: RuntimeError: first (see the "
           "'error' tag of its MLflow run)")])  # its first line
def test_a_study_whose_every_trial_failed_says_how_many(tmp_path, monkeypatch, capsys, failed, invalid, said):
    """A study that measured nothing fails as a command; one trial that measured something is enough. Where the
    trials recorded their errors, the line quotes the last (a study resumed with nothing left to run printed none)."""
    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.sweeps.trials.driver import all_failed

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlruns").mkdir()
    inv = build_invocation(parse_args([]))
    study = optuna.create_study(study_name=inv.study_name, storage=inv.storage)
    states = [optuna.trial.TrialState.FAIL] * failed + [optuna.trial.TrialState.PRUNED] * invalid
    errors = ["RuntimeError: first\nits traceback", "effective batch 5000 is larger than the training set"]
    for state in states:
        reason = {"reason": "invalid"} if state == optuna.trial.TrialState.PRUNED else {}
        if said and "; " in said:  # errors as the recorder keeps them, the last one per state kind
            reason["error"] = errors[state == optuna.trial.TrialState.PRUNED]
        study.add_trial(optuna.trial.create_trial(state=state, user_attrs=reason))
    if said is None:
        study.add_trial(optuna.trial.create_trial(value=0.5))
    assert all_failed(inv, inv.storage) == (said is not None)
    assert capsys.readouterr().err == ("" if said is None else said + "\n")


@pytest.mark.slow
def test_a_storage_server_that_goes_down_stops_the_study_in_one_line(tmp_path):
    from tests.servers import postgres_server

    with postgres_server() as server:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *TINY, "--epochs", "3", "--storage",
                                 server.url], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_for_complete(server.url, 2, proc)
        server.stop()
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: the Optuna storage {server.url} stopped accepting writes"), err[-3000:]
        assert "run the same command again to resume" in last and "Traceback" not in err
        _, parents = child_runs(stores(tmp_path)[1])
        assert [p.info.status for p in parents] == ["FAILED"]
        server.start()
        kept = [t for t in optuna.load_study(study_name="accum_lr", storage=server.url).trials
                if t.state == State.COMPLETE]
        assert len(kept) >= 2  # what finished before stays finished


def test_a_corrupt_dataset_cache_is_rebuilt_with_a_note(tmp_path):
    cache = tmp_path / "mnist1d.npz"
    for content in (b"", b"PK\x03\x04 truncated zip", b"something else entirely" * 50):
        cache.write_bytes(content)
        result = train(TrainConfig(epochs=1, max_steps=2, data_dir=str(tmp_path)))
        assert result.status == "ok"
        assert any("was not a complete cache" in w and "rebuilt it" in w for w in result.warnings)
    again = train(TrainConfig(epochs=1, max_steps=2, data_dir=str(tmp_path)))
    assert not any("cache" in w for w in again.warnings)  # the rebuilt cache is a good one
    umask = os.umask(0)
    os.umask(umask)
    assert cache.stat().st_mode & 0o777 == 0o666 & ~umask  # as the umask gives any new file, not 0600


@pytest.mark.parametrize("script", ["sweeps/run.py", "analysis/report.py"])
def test_a_corrupt_mlflow_store_is_one_line_and_left_alone(tmp_path, script):
    (tmp_path / "mlruns").mkdir()
    garbage = os.urandom(4096)
    (tmp_path / "mlruns/mlflow.db").write_bytes(garbage)
    args = [*TINY, "--storage", f"sqlite:///{tmp_path}/optuna.db"] if script == "sweeps/run.py" else \
        ["--study", "accum_lr"]
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "mlflow.db" in lines[0], proc.stderr
    assert (tmp_path / "mlruns/mlflow.db").read_bytes() == garbage


@pytest.mark.slow
def test_a_deleted_experiment_is_one_line_that_says_how_to_restore_it(tmp_path):
    """Deleting the experiment in the MLflow UI moves it to the trash, where no run can start: the next
    invocation says so, and after the restore it names, the study goes on."""
    assert sweep(tmp_path, *TINY, "--n-trials", "1").returncode == 0
    storage, client = stores(tmp_path)
    experiment = client.get_experiment_by_name("accum_lr").experiment_id
    client.delete_experiment(experiment)
    proc = sweep(tmp_path, *TINY, "--n-trials", "1", process=True)  # all that the script prints
    assert proc.returncode == 2 and proc.stderr == (
        f"error: the MLflow experiment accum_lr is deleted: restore it (mlflow experiments restore --experiment-id "
        f"{experiment}) or pass another --study-name\n"), proc.stderr
    assert len(grid_trials(storage)) == 1  # nothing started
    client.restore_experiment(experiment)
    assert sweep(tmp_path, *TINY, "--n-trials", "1").returncode == 0
    assert len(child_runs(client)[0]) == 2


@pytest.mark.parametrize("args,expected", [
    (["--storage", "sqlite://optuna.db"], "--storage 'sqlite://optuna.db' is not a SQLite URL"),
    (["--tracking-uri", "sqlite://mlflow.db"], "--tracking-uri 'sqlite://mlflow.db' is not a SQLite URL"),
    (["--storage", "journal:"], "--storage 'journal:' names no file"),
    (["--seed", "99999999999999999999"], "seed must be at most 4294967295"),
    (["--set", "eval_batch=99999999999999999999"], "eval_batch must be at most 2147483647"),
    (["--set", "weight_decay=1e308"], "weight_decay 1e+308 times the learning rate"),
    (["--set", "base_lr=1e308", "--set", "lr_rule=linear", "--set", "weight_decay=0"],
     "scales base_lr 1e+308 to an infinite learning rate"),
    (["--set", "base_lr=1e400"], "base_lr must be a finite number"),
    (["--set", "batch_warmup=64,32"], "batch_warmup '64,32': each B must grow"),
    (["--set", "batch_warmup=a,b"], "batch_warmup 'a,b' is not a list of batch sizes"),
    (["--seeds", "100000", "--dry-run"], "--seeds must be between 1 and 1,000"),
    (["--workers", "100000"], "--workers must be between 1 and"),
    (["--n-trials", "0"], "--n-trials must be between 1 and 1,000,000"),
    (["--study-name", "../escape"], "study name '../escape' is not a plain name"),
    (["--study-name", "/tmp/abs"], "study name '/tmp/abs' is not a plain name"),
    (["--study-name", ""], "study name '' is not a plain name"),
    (["--storage", "postgresql://u:pw@h:abc/db"], "'postgresql://u:***@h:abc/db' has a port that is not a number"),
    (["--tracking-uri", "http://a:pw@:5000"], "'http://a:***@:5000' names no host"),
    (["--tracking-uri", "http://127.0.0.1:99999"], "'http://127.0.0.1:99999' has a port that is not a number"),
    (["--tracking-uri", "sqlite:////tmp"], "--tracking-uri 'sqlite:////tmp' names a folder"),
])
def test_bad_values_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, args, expected):
    # In-process (the subprocess cases are in test_sweeps.py): these fail before anything is opened.
    from batchsweep.sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*TINY, *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,expected", [
    (["--memory-budget", "1e400", "--target-batch", "64"], "memory budget '1e400' is out of range"),
    (["--memory-budget", "1GiB", "--target-batch", "1000000000000"], "--target-batch must be between 1 and"),
])
def test_plan_bad_input_is_one_line(tmp_path, args, expected):
    proc = sweep(tmp_path, "--plan", *args, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and expected in proc.stderr, proc.stderr


@pytest.mark.slow
def test_a_storage_folder_that_turns_read_only_stops_the_study_in_one_line(tmp_path):
    # Mid-study the folder becomes immutable (chattr +i): no file can be created in it, root included (who
    # writes through mere permissions), so SQLite cannot open the journal that every write needs.
    store = tmp_path / "optuna"
    store.mkdir()
    probe = subprocess.run(["chattr", "+i", str(store)], capture_output=True)
    if probe.returncode:
        pytest.skip(f"this file system or sandbox refuses chattr +i ({probe.stderr.strip()})")
    subprocess.run(["chattr", "-i", str(store)], check=True)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        storage = f"sqlite:///{store}/optuna.db"
        proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *TINY, "--epochs", "3", "--storage",
                                 storage], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        wait_for_complete(store / "optuna.db", 2, proc)  # tolerates reading while the sweep creates the schema
        subprocess.run(["chattr", "+i", str(store)], check=True)
        _, err = proc.communicate(timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(store)], capture_output=True)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the Optuna storage {storage} stopped accepting writes"), err[-3000:]
    assert "Traceback" not in err, err[-6000:]
    _, parents = child_runs(stores(tmp_path)[1])
    assert [p.info.status for p in parents] == ["FAILED"]
    kept = [t for t in optuna.load_study(study_name="accum_lr", storage=storage).trials if t.state == State.COMPLETE]
    assert len(kept) >= 2  # what finished before stays finished


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_heartbeat_the_storage_refuses_is_one_line(tmp_path, capsys):
    """Optuna writes a running trial's heartbeat from a thread of its own: when the storage refuses it (its
    folder turned read-only, as above), the worker's hook says so in one line instead of the thread's
    traceback."""
    import threading

    from optuna.storages._heartbeat import HeartbeatThread

    from batchsweep.sweeps.stores.optuna_store import heartbeat_failed, open_storage

    store = tmp_path / "optuna"
    store.mkdir()
    if subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode:
        pytest.skip("this file system or sandbox refuses chattr +i")
    subprocess.run(["chattr", "-i", str(store)], check=True)
    storage = open_storage(f"sqlite:///{store}/optuna.db")
    trial_id = optuna.create_study(storage=storage).ask()._trial_id
    previous = threading.excepthook
    threading.excepthook = heartbeat_failed
    try:
        subprocess.run(["chattr", "+i", str(store)], check=True)
        beat = HeartbeatThread(trial_id, storage)
        beat.start()
        beat.join()
    finally:
        subprocess.run(["chattr", "-i", str(store)], capture_output=True)
        threading.excepthook = previous
    err = capsys.readouterr().err
    assert err.startswith("warning: the Optuna storage refused the running trial's heartbeat (") and \
        err.endswith("); the trial goes on\n") and err.count("\n") == 1, err


@pytest.mark.slow
def test_two_machines_that_write_the_experiment_at_once_both_go_on(tmp_path):
    """Two machines that start together on a fresh experiment both set its description and both log the same
    dataset with their first trial. MLflow writes either by SELECT then INSERT, so both INSERT and the slower
    one hits the unique key (in about half the rounds here); tried again, it finds the row."""
    import threading

    from tests.servers import mlflow_server

    dataset = {"name": "tests.factories:blobs1k", "digest": "0123abcd", "train_size": 800, "test_size": 200}
    with mlflow_server(tmp_path) as url:
        errors = []
        for i in range(20):
            machines = [Tracker(url, f"race-{i}") for _ in range(2)]
            runs = [m.start_parent(f"machine {n}", {}, {}) for n, m in enumerate(machines)]
            start = threading.Barrier(2)

            def first_writes(tracker: Tracker, run_id: str) -> None:
                start.wait()
                try:
                    tracker.describe(None, f"description {i}")
                    tracker.log_dataset(run_id, dataset)
                except Exception as exc:
                    errors.append(str(exc)[:200])

            threads = [threading.Thread(target=first_writes, args=pair) for pair in zip(machines, runs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert errors == []
        client = MlflowClient(url)
        assert client.get_experiment_by_name("race-19").tags["mlflow.note.content"] == "description 19"
        assert [[d.dataset.digest for d in client.get_run(r).inputs.dataset_inputs] for r in runs] == [["0123abcd"]] * 2


def test_a_trial_of_another_container_with_the_same_host_name_is_left_running(tmp_path):
    """Containers that share a host name see each other's process ids as dead: a trial is failed as an orphan only
    where its process could be seen (same boot, same PID namespace)."""
    import warnings

    from batchsweep.sweeps.stores.optuna_store import fail_orphans
    from batchsweep.sweeps.stores.mlflow_store import HOST, PROCESSES

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/o.db")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, ours = study.ask(), study.ask()
    for trial, processes in ((theirs, "another-boot/pid:[4026532000]"), (ours, PROCESSES)):
        trial.set_user_attr("owner", f"{HOST}:{gone.stdout.strip()}")
        trial.set_user_attr("owner_processes", processes)
    assert fail_orphans(study, study.get_trials(deepcopy=False)) == 1
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.FAIL]


def test_a_trial_whose_worker_is_a_zombie_is_failed_as_an_orphan(tmp_path):
    """A worker killed with its parent stays a zombie where nothing reaps it (a container's PID 1 that reaps
    nothing, or a subreaper that waits only for its own children): it is dead, and its trial runs again."""
    import time
    import warnings

    import psutil

    from batchsweep.sweeps.stores.mlflow_store import HOST, PROCESSES
    from batchsweep.sweeps.stores.optuna_store import fail_orphans

    worker = subprocess.Popen([sys.executable, "-c", "pass"])  # not waited for: a zombie once it exits
    try:
        while psutil.Process(worker.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)  # (until it has exited; Popen never reaps it behind our back)
        study = optuna.create_study(storage=f"sqlite:///{tmp_path}/o.db")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial = study.ask()
        trial.set_user_attr("owner", f"{HOST}:{worker.pid}")
        trial.set_user_attr("owner_processes", PROCESSES)
        assert fail_orphans(study, study.get_trials(deepcopy=False)) == 1
    finally:
        worker.wait()
