import contextlib
import datetime
import getpass
import html
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import optuna
import pytest
import sqlalchemy
import torch
from mlflow import MlflowClient

from tests.conftest import ROOT, in_process
from batchsweep.sweeps.study.spec import config_key, point_key
from batchsweep.sweeps.study.files import builtin_names, load

# One seed, one worker, no warmup: the studies' own protocol (3 seeds, 2 workers, 2 warmup epochs) is for users.
TINY = ["--model", "mlp", "--dataset", "tests.factories:blobs1k", "--epochs", "1", "--seeds", "1", "--workers", "1",
        "--set", "warmup_epochs=0", "--log-models", "none", "--no-report"]


# accum_lr's grid cut to 12 points, for tests that kill and rerun a sweep several times.
SMALL = """name = "accum_lr"
[grid]
physical_batch = [32]
accum_steps = [1, 2, 4, 8]
lr_rule = ["none", "linear", "sqrt"]
"""


def small(folder):
    (folder / "small.toml").write_text(SMALL)
    return ["--study", str(folder / "small.toml")]


def held(marker, proc) -> int:
    """Wait until a tests.factories:holds model holds (it writes `marker.held`); its process id."""
    done = marker.with_name(f"{marker.name}.held")
    deadline = time.monotonic() + 240
    while not done.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no trial held"
        time.sleep(0.05)
    return int(done.read_text())


def sweep(cwd, *args, timeout=300, process=False, env=None):
    """`sweeps/run.py` with these arguments from `cwd`: in this test process (tests.conftest.in_process), or
    as a process of its own where a test needs one (with `env` added): what its children print, its exit as a
    script."""
    if not process:
        from batchsweep.sweeps.cli import main

        return in_process(main, cwd, *args)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "sweeps/run.py"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def stores(cwd):
    return f"sqlite:///{cwd}/mlruns/optuna.db", MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")


def grid_trials(storage, name="accum_lr"):
    study = optuna.load_study(study_name=name, storage=storage)
    return [t for t in study.trials if t.user_attrs.get("reason") != "duplicate"]


def child_runs(client, name="accum_lr"):
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags], [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


@pytest.mark.slow
def test_tiny_study_end_to_end(tmp_path):
    proc = sweep(tmp_path, *TINY[:-1], "--n-trials", "3", "--seed", "3", "--log-models", "best",  # and its report
                 "--no-fuse", process=True)  # (each trial's own bar and times; fused: tests/test_fused_trials.py)
    assert proc.returncode == 0, proc.stderr
    assert "val_acc" in proc.stdout and "health" in proc.stdout and "24 trials left" in proc.stderr
    assert f"report: {tmp_path}/reports/accum_lr/report.html" in proc.stdout
    # Said before the wait, and then only the bars over the runs the report reads and the figures it draws, which
    # clear themselves. (text=True reads tqdm's carriage returns as line ends)
    after = [line for line in proc.stderr.split("writing the report of accum_lr ...\n")[1].splitlines() if line.strip()]
    reading = [line for line in after if line.startswith("reading the runs of accum_lr: ")]
    drawing = [line for line in after if line.startswith("drawing the figures of accum_lr: ")]
    assert reading and drawing and after == reading + drawing, after
    kinds = re.search(r" 0/(\d+) \[.* kinds/s\]", drawing[0])  # each kind of figure the report knows, in turn
    drawn = len(list((tmp_path / "reports/accum_lr").glob("*.png")))
    assert " 0/3 [" in reading[0] and kinds and int(kinds[1]) > drawn > 0, (drawing, drawn)
    started, ended = epoch_frames(proc.stderr, 1)  # the bar over epochs: each trial's own, from epoch 0
    assert len(started) == 3 and ended == started, (started, ended)
    storage, client = stores(tmp_path)
    trials = grid_trials(storage)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    children, parents = child_runs(client)
    assert len(parents) == 1 and len(children) == 3
    parent = parents[0]
    # The runs table in the UI, one address (MLflow 3.x opens an experiment on its overview), and the objective by
    # its name in optuna-dashboard and Optuna's plots.
    assert (f"MLflow runs: mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlruns/mlflow.db, then "
            f"http://127.0.0.1:5000/#/experiments/{parent.info.experiment_id}/runs") in proc.stdout
    assert optuna.load_study(study_name="accum_lr", storage=storage).metric_names == ["val_acc"]
    assert parent.info.status == "FINISHED" and parent.data.params["model"] == "mlp"
    report = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {"report/report.html", "report/report.md", "report/trials.csv"} <= report
    by_id = {r.info.run_id: r for r in children}
    for t in trials:
        run = by_id[t.user_attrs["mlflow_run_id"]]  # each leads to the other
        assert run.data.tags["optuna.trial_number"] == str(t.number)
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.status == "FINISHED" and run.data.tags["state"] == "COMPLETE"
        p = run.data.params
        assert int(p["effective_batch"]) == int(p["physical_batch"]) * int(p["accum_steps"])
        assert p["seed"] == "3" and p["lr_rule"] == t.user_attrs["config"]["lr_rule"] and "bn_momentum" in p
        assert run.data.metrics["val_acc"] == pytest.approx(t.value)
        assert {"train_loss", "val_loss", "samples_per_s", "peak_memory_bytes"} <= set(run.data.metrics)
        history = client.get_metric_history(run.info.run_id, "val_acc")
        assert [m.step for m in history] == [1]
        logged = run.data.tags.get("batchsweep.model") == "pytorch"
        assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["history.csv", *["model"] * logged]
        assert not logged or t.value == max(u.value for u in trials)
        assert not logged or run.data.tags["batchsweep.model_kept"] == (  # what it is, as the report lists it
            "the trial of the highest val_acc, one seed's run (the report names the best configuration over the seeds)")
        for tag in ("device_name", "torch_version", "optuna.study_name", "health"):
            assert run.data.tags[tag]
        assert run.data.tags["health"] == t.user_attrs["health"]
        assert {"grad_norm", "update_ratio", "dead_fraction"} <= set(run.data.metrics)
    # --log-models best: the best trial's model, and no other's
    assert sum("batchsweep.model" in r.data.tags for r in children) == 1


def test_dry_run_and_list_write_nothing(tmp_path):
    listing = sweep(tmp_path, "--list")
    assert listing.returncode == 0 and all(name in listing.stdout for name in builtin_names())
    dry = sweep(tmp_path, "--dry-run", "--seeds", "2")
    assert dry.returncode == 0
    assert len(dry.stdout.strip().splitlines()) == 2 + 27 * 2
    assert not (tmp_path / "mlruns").exists()


def test_a_study_resumed_under_other_settings_is_refused_and_more_seeds_are_not(tmp_path):
    """Its finished points would count as done under the old settings, beside new trials under these: a quick
    `--epochs 1` try of a study, then the full run. The seed, the number of seeds and where it runs may change."""
    assert sweep(tmp_path, *TINY, "--n-trials", "1").returncode == 0
    changed = sweep(tmp_path, *TINY, "--n-trials", "1", "--epochs", "2", "--set", "momentum=0.5")
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    assert changed.stderr.splitlines()[-1] == (
        f"error: study accum_lr in sqlite:///{tmp_path}/mlruns/optuna.db ran with epochs = 1 (now 2), momentum = 0.9 "
        "(now 0.5): run it with those settings to resume it, or pass --study-name NAME "
        "for a new study"), changed.stderr
    (tmp_path / "small.toml").write_text(SMALL)  # the same name, a grid of fewer points
    grid = sweep(tmp_path, *TINY, "--n-trials", "1", "--study", str(tmp_path / "small.toml"))
    assert grid.returncode == 2 and "ran with grid.accum_steps = [1, 2, 4, 8, 16] (now [1, 2, 4, 8])" in grid.stderr
    storage, client = stores(tmp_path)
    assert len(grid_trials(storage)) == 1 and [len(runs) for runs in child_runs(client)] == [1, 1]  # nothing written
    more = sweep(tmp_path, *TINY, "--n-trials", "1", "--seeds", "2", "--seed", "5", "--device", "cpu")
    assert more.returncode == 0, more.stderr
    assert [t.user_attrs["config"]["seed"] for t in grid_trials(storage)] == [0, 5]
    other = sweep(tmp_path, *TINY, "--n-trials", "1", "--epochs", "2", "--study-name", "accum_lr-2")
    assert other.returncode == 0, other.stderr


def test_a_machine_that_finds_a_new_study_without_settings_waits_for_its_creators(tmp_path, monkeypatch):
    """Two machines start a new study at once under other settings: the storage lets one create it, and the
    other, finding it without trials or settings, waits for the creator's and is held to them (both used to
    run, the last to record winning). A study that stays without them (an earlier batchsweep's, or one whose
    creator was killed before recording) is given the waiting invocation's after a grace."""
    from types import SimpleNamespace

    from batchsweep.sweeps.stores import optuna_store as stored
    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.trainers import ConfigError

    url, refused = f"sqlite:///{tmp_path}/optuna.db", []
    creator, other = (build_invocation(parse_args([*TINY, "--storage", url, "--epochs", e])) for e in ("1", "2"))
    optuna.create_study(study_name="accum_lr", storage=url)  # the creator's create_study, before its record
    waiting = threading.Event()  # set when the other machine has looked, found nothing, and waits
    monkeypatch.setattr(stored, "time", SimpleNamespace(monotonic=time.monotonic,
                                                        sleep=lambda s: (waiting.set(), time.sleep(s))))
    monkeypatch.setattr(stored, "CREATOR_GRACE_S", 600)

    def check():
        try:
            stored.check_protocol(other, stored.open_storage(url))
        except ConfigError as exc:
            refused.append(str(exc))

    thread = threading.Thread(target=check)
    thread.start()
    assert waiting.wait(timeout=120)
    optuna.load_study(study_name="accum_lr", storage=url).set_user_attr(stored.PROTOCOL, stored.protocol(creator))
    thread.join(timeout=120)
    assert len(refused) == 1 and "ran with epochs = 1 (now 2): run it with those settings" in refused[0], refused
    monkeypatch.setattr(stored, "CREATOR_GRACE_S", 0.5)
    alone = f"sqlite:///{tmp_path}/alone.db"
    optuna.create_study(study_name="accum_lr", storage=alone)
    inv = build_invocation(parse_args([*TINY, "--storage", alone]))
    stored.check_protocol(inv, stored.open_storage(alone))
    assert optuna.load_study(study_name="accum_lr", storage=alone).user_attrs[stored.PROTOCOL] == stored.protocol(inv)


def test_a_dry_run_of_a_resumed_study_shows_each_trials_status_and_writes_nothing(tmp_path):
    """What the run would do next: a point done, one a live process runs, one whose process is gone (it runs
    again), the rest to run; settings the study did not run with are refused as the run refuses them."""
    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.sweeps.stores.mlflow_store import HOST

    assert sweep(tmp_path, *TINY, "--n-trials", "1").returncode == 0
    storage, _ = stores(tmp_path)
    study = optuna.load_study(study_name="accum_lr", storage=storage)
    units = build_invocation(parse_args(TINY)).units()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is dead, as a killed worker's is
    for unit, pid in ((units[1], os.getpid()), (units[2], gone.pid)):
        trial = study.ask()
        trial.set_user_attr("config", {**unit.point, "seed": unit.seed})
        trial.set_user_attr("owner", f"{HOST}:{pid}")
    db = tmp_path / "mlruns" / "optuna.db"
    before = db.read_bytes()
    dry = sweep(tmp_path, *TINY, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    *table, last = dry.stdout.splitlines()
    statuses = [re.split(r"\s{2,}", row.strip())[-1] for row in table[2:]]
    assert table[0].split()[-1] == "status" and statuses == ["complete", "running", "interrupted",
                                                             *["to run"] * (len(units) - 3)]
    assert last == f"study accum_lr in {storage}: 1 trial done, 1 running, {len(units) - 2} to run"
    changed = sweep(tmp_path, *TINY, "--dry-run", "--epochs", "2")
    assert changed.returncode == 2 and changed.stdout == ""
    assert changed.stderr == f"error: study accum_lr in {storage} ran with epochs = 1 (now 2): run it with those " \
                             f"settings to resume it, or pass --study-name NAME for a new study\n"
    assert db.read_bytes() == before


def wait_for_complete(storage, at_least, proc, timeout=120, study="accum_lr"):
    """Poll an Optuna storage (a SQLite file's path, or a server's URL) until `at_least` trials are COMPLETE. A
    file is read only: Optuna's own open would create the schema that the sweep is creating at that moment, and
    the sweep's version row could then collide with the poller's."""
    def complete() -> int:
        if isinstance(storage, str):  # (a server creates its schema in one transaction)
            trials = optuna.load_study(study_name=study, storage=storage).trials
            return sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
        with contextlib.closing(sqlite3.connect(f"file:{storage}?mode=ro", uri=True)) as db:
            return db.execute("SELECT count(*) FROM trials JOIN studies USING (study_id) WHERE study_name = ? AND "
                              "state = 'COMPLETE'", (study,)).fetchone()[0]

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if isinstance(storage, str) or storage.exists():
            try:
                if complete() >= at_least:
                    return
            except Exception:  # not created yet, or its schema is being created
                pass
        time.sleep(0.2)


@pytest.mark.slow
def test_resume_after_sigkill_runs_every_point_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # 3 epochs make a trial last a few hundred ms: the delays land in training, in tracking, between trials.
    args = [*TINY, *small(tmp_path), "--model", "tests.factories:holds", "--epochs", "3"]
    storage_path = tmp_path / "mlruns/optuna.db"
    # Each of these runs stops after 2 trials, so that however late a kill lands (on a busy machine the polling
    # lags), the five leave at least 2 of the 12 points for the last kill below.
    for kill_after, delay in ((1, 0.0), (2, 0.05), (3, 0.12), (4, 0.2), (5, 0.33)):
        proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *args, "--n-trials", "2"], cwd=tmp_path,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_complete(storage_path, kill_after, proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # and once where it is known to land inside a trial: the next one holds at its second evaluation.
    (tmp_path / "hold").touch()
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *args], cwd=tmp_path,
                            env={**env, "BATCHSWEEP_TEST_HOLD": f"{tmp_path / 'hold'}:2"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held(tmp_path / "hold", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = {config_key(t.user_attrs["config"]) for t in grid_trials(f"sqlite:///{storage_path}")
            if t.state == optuna.trial.TrialState.COMPLETE}
    final = sweep(tmp_path, *args)
    assert final.returncode == 0, final.stderr
    # The killed process's trial is failed before counting: its point is counted as left, not as held.
    assert f"study accum_lr: {12 - len(done)} trials left" in final.stderr
    trials = grid_trials(f"sqlite:///{storage_path}")
    complete = [config_key(t.user_attrs["config"]) for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    expected = {point_key(p, 0) for p in load(str(tmp_path / "small.toml")).points}
    assert sorted(complete) == sorted(expected)  # each point exactly once
    # A kill between Optuna creating a trial and the trial naming its owner leaves one that holds nothing;
    # the next invocation fails it once the heartbeat's grace has passed (test_ownerless_trial_fails_after_grace).
    assert all(t.state.is_finished() or not t.user_attrs for t in trials)
    assert any(t.state == optuna.trial.TrialState.FAIL for t in trials)  # the held trial's, at least
    children, parents = child_runs(stores(tmp_path)[1])
    assert not [r for r in children + parents if r.info.status == "RUNNING"]
    assert len([r for r in children if r.info.status == "FINISHED"]) == 12


@pytest.mark.slow
def test_a_worker_killed_mid_study_is_reported_and_its_trial_ended(tmp_path):
    """A worker that the kernel kills (its out-of-memory killer, say) leaves its trial RUNNING and its run open.
    The invocation says so in one line and ends both, so that no run stays RUNNING and the count of trials left
    is honest; the grid ends with every point complete once."""
    hold = tmp_path / "hold"
    hold.touch()
    # The first trial to evaluate holds there, in its worker, until that worker is killed: its trial is RUNNING.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BATCHSWEEP_TEST_HOLD": f"{hold}:1"}
    args = [*TINY, *small(tmp_path), "--model", "tests.factories:holds", "--workers", "2", "--no-fuse"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    storage = f"sqlite:///{tmp_path}/mlruns/optuna.db"
    worker = held(hold, proc)
    (trial,) = [t for t in grid_trials(storage) if t.state == optuna.trial.TrialState.RUNNING and
               t.user_attrs["owner"].rpartition(":")[2] == str(worker)]
    os.kill(worker, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert re.search(r"warning: worker \d was killed by SIGKILL; its trial is marked failed", err), err
    trials = grid_trials(storage)
    assert all(t.state.is_finished() for t in trials)
    assert [t.state for t in trials if t.number == trial.number] == [optuna.trial.TrialState.FAIL]
    left = 12 - len({config_key(t.user_attrs["config"]) for t in trials if t.state.name == "COMPLETE"})
    assert (f"{left} trials left: run the same command again" in err) == (left > 0), err
    client = stores(tmp_path)[1]
    children, parents = child_runs(client)
    assert not [r for r in children + parents if r.info.status == "RUNNING"]
    assert client.get_run(trial.user_attrs["mlflow_run_id"]).info.status == "KILLED"
    assert sweep(tmp_path, *args).returncode == 0
    complete = [config_key(t.user_attrs["config"]) for t in grid_trials(storage) if t.state.name == "COMPLETE"]
    assert sorted(complete) == sorted(point_key(p, 0) for p in load(str(tmp_path / "small.toml")).points)


def test_ownerless_trial_fails_after_grace(tmp_path):
    from batchsweep.sweeps.stores.optuna_store import HEARTBEAT_GRACE_S, fail_orphans

    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/optuna.db")
    now = datetime.datetime.now()
    for age in (HEARTBEAT_GRACE_S + 60, 5):  # a dead process's trial; one whose owner is being written now
        trial = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING)
        trial.datetime_start = now - datetime.timedelta(seconds=age)
        study.add_trial(trial)
    assert fail_orphans(study, study.get_trials()) == 1
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "RUNNING"]


@pytest.mark.slow
@pytest.mark.parametrize("workers,storage", [(4, "sqlite"), (2, "journal")])
def test_workers_cover_the_grid_once(tmp_path, workers, storage):
    url = f"sqlite:///{tmp_path}/mlruns/optuna.db" if storage == "sqlite" else f"journal:{tmp_path}/optuna.log"
    # mlp, whose workers' first trials wait until two of them train (tests/company.py): the work is shared
    (tmp_path / "company").mkdir()
    proc = sweep(tmp_path, *TINY, *small(tmp_path), "--model", "tests.company:mlp", "--workers", str(workers),
                 "--storage", url, "--no-fuse", process=True, env={"BATCHSWEEP_TEST_COMPANY": f"{tmp_path}/company:2"})
    assert proc.returncode == 0, proc.stderr  # (and what the workers print; fused: tests/test_fused_trials.py)
    assert "locked" not in proc.stderr and "Traceback" not in proc.stderr
    _, client = stores(tmp_path)
    trials = grid_trials(url if storage == "sqlite" else optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(f"{tmp_path}/optuna.log")))
    points = [config_key(t.user_attrs["config"]) for t in trials]
    assert len(points) == len(set(points)) == 12  # none lost, none twice
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials), (
        [(t.number, t.state.name, t.user_attrs.get("reason"), t.user_attrs.get("owner")) for t in trials
         if t.state != optuna.trial.TrialState.COMPLETE], proc.stderr)
    assert len(list((tmp_path / "company").iterdir())) >= 2  # workers that trained met there, two at least,
    assert len({t.user_attrs["owner"] for t in trials}) >= 2  # so the work was shared
    children, _ = child_runs(client)
    assert sorted(r.info.run_id for r in children if r.info.status == "FINISHED") == \
        sorted(t.user_attrs["mlflow_run_id"] for t in trials)
    started, ended = epoch_frames(proc.stderr, 1)  # each worker's bar over epochs: every trial's epoch, drawn
    assert len(ended) == 12 and ended <= started, (started, ended)


def epoch_frames(stderr: str, epochs: int) -> tuple[set[str], set[str]]:
    """The trials that the bars over epochs showed at epoch 0, and at their last epoch with their val_acc; a
    frame at epoch 0 shows no metric (of the trial before it)."""
    frames = [f for f in re.split(r"[\r\n]", stderr) if re.search(r"epoch/s|s/epoch", f)]
    at_0 = [f for f in frames if f" 0/{epochs} [" in f]
    assert not any("val_acc=" in f for f in at_0), at_0
    return ({f.split(":")[0] for f in at_0},
            {f.split(":")[0] for f in frames if f" {epochs}/{epochs} [" in f and "val_acc=0." in f})


def test_a_workers_bar_over_epochs_is_timed_by_when_the_worker_sent_each_epoch(capsys):
    """The main process shows a second's messages together: a 0.5 s epoch is 2 epoch/s all the same, not the
    thousands that its own clock would read between two messages shown at once."""
    from batchsweep.sweeps.trials.driver import epoch_bar, show_epoch

    bars = [epoch_bar(1), epoch_bar(2)]
    try:
        show_epoch(bars, ("start", 1, "b32 k4 linear", 3, 100.0))
        for epoch in (1, 2, 3):
            show_epoch(bars, ("epoch", 1, {"val_acc": f"0.{epoch}00"}, 100.0 + 0.5 * epoch))
    finally:
        for bar in bars:
            bar.close()
    frames = [f for f in re.split(r"[\r\n]", capsys.readouterr().err) if "b32 k4 linear" in f]
    assert any(" 3/3 [00:01<00:00,  2.00epoch/s, val_acc=0.300]" in f for f in frames), frames
    assert any(" 1/3 [00:00<00:01,  2.00epoch/s, val_acc=0.100]" in f for f in frames), frames


@pytest.mark.parametrize("args,expected", [
    (["--study", "nope"], "unknown study 'nope'"),
    (["--set", "nope=1"], "unknown setting 'nope'"),
    (["--set", "physical_batch=big"], "physical_batch takes an integer, got 'big'"),
    (["--model", "vgg"], "unknown model 'vgg'"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--set", "bn_momentum_rule=half"], "unknown bn_momentum_rule 'half'"),
    (["--seeds", "0"], "--seeds must be between 1 and 1,000"),
    (["--set", "weight_decay"], "malformed setting 'weight_decay'"),
    (["--epochs", "0"], "epochs must be >= 1"),
    (["--storage", "redis://localhost/0"], "unknown storage 'redis://localhost/0'"),
    (["--storage", "postgresql://nobody@127.0.0.1:9/none"], "cannot open the Optuna storage"),
    (["--tracking-uri", "http://127.0.0.1:9"], "cannot reach the MLflow tracking server http://127.0.0.1:9"),
    (["--checkpoint-dir", "/proc/nope"], "cannot write checkpoints to /proc/nope (No such file or directory)"),
    # What would make every trial invalid alike: found once, before the stores are opened.
    (["--model", "gpt"], "model 'gpt' takes token ids of shape (length,), and dataset 'tests.factories:blobs1k' "
                         "gives floats of shape (4,): use --model mlp"),
    (["--model", "nosuchpkg.mod:make"], "model import path 'nosuchpkg.mod:make' does not import"),
    (["--metrics", "tests.factories:missing"], "metrics import path 'tests.factories:missing': module "
                                                "'tests.factories' has no callable 'missing'"),
    (["--set", "loss=tests.factories:missing"], "loss import path 'tests.factories:missing'"),
    (["--dataset", "tests.factories:not_a_dataset"], "must return (train, test) Datasets"),
    (["--dataset", "tests.factories:broken_model"], "dataset 'tests.factories:broken_model' raised RuntimeError: "
                                                    "factory exploded"),
    pytest.param(["--device", "cuda"], "device 'cuda' is not available on this machine: use --device cpu or auto",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: cuda is valid")),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, expected):
    proc = sweep(tmp_path, *TINY, *args, "--storage" if "--storage" not in args else "--n-trials",
                 f"sqlite:///{tmp_path}/elsewhere/optuna.db" if "--storage" not in args else "1", timeout=60,
                 process=args == ["--study", "nope"])  # one as the script, exit status and all
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert not (tmp_path / "mlruns").exists() or "checkpoint" in expected  # (checked once the stores are open)
    if (tmp_path / "elsewhere/optuna.db").exists():  # the tracking URI failed after the storage opened
        assert optuna.get_all_study_names(f"sqlite:///{tmp_path}/elsewhere/optuna.db") == []


@pytest.mark.slow
def test_distributed_study_on_postgresql_and_a_tracking_server(tmp_path, postgres):
    from tests.servers import mlflow_server

    server = postgres
    with mlflow_server(tmp_path) as tracking:
        pg = server.url
        dry = sweep(tmp_path, *TINY, "--storage", pg, "--dry-run")  # a server without the study: no status column
        assert dry.returncode == 0 and dry.stdout.splitlines()[0].split()[-1] == "seed", dry.stderr
        assert sqlalchemy.inspect(sqlalchemy.create_engine(pg)).get_table_names() == []  # nor tables made
        # mlp, whose first trial on each machine waits until both train (tests/company.py): both work
        (tmp_path / "company").mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "BATCHSWEEP_TEST_COMPANY": f"{tmp_path}/company:2"}
        machines = []
        for name in ("machine-a", "machine-b"):  # two independent processes, as on two machines
            (tmp_path / name).mkdir()
            machines.append(subprocess.Popen(
                [sys.executable, str(ROOT / "sweeps/run.py"), *TINY, "--model", "tests.company:mlp", "--storage", pg,
                 "--tracking-uri", tracking],
                cwd=tmp_path / name, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [m.communicate(timeout=400) for m in machines]
        for name, (_, err) in zip(("machine-a", "machine-b"), outputs):  # whole, under "Captured stdout" if it fails
            print(f"--- {name} stderr ---\n{err}")
        assert [m.returncode for m in machines] == [0, 0]
        trials = grid_trials(pg)
        complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
        assert sorted(config_key(t.user_attrs["config"]) for t in complete) == \
            sorted(point_key(p, 0) for p in load("accum_lr").points)  # covered exactly once
        assert len(complete) == len(trials)
        client = MlflowClient(tracking)
        children, parents = child_runs(client)
        assert len(parents) == 2  # one per invocation
        finished = {r.info.run_id for r in children if r.info.status == "FINISHED"}
        statuses = {r.info.run_id: (r.info.status, r.data.tags.get("reason")) for r in children}
        assert {t.user_attrs["mlflow_run_id"] for t in complete} == finished, (
            {t.number: statuses.get(t.user_attrs["mlflow_run_id"]) for t in complete},
            [err[-2000:] for _, err in outputs])
        assert len(list((tmp_path / "company").iterdir())) == 2  # the machines met there,
        assert len({t.user_attrs["owner"] for t in complete}) == 2  # so both worked
        dry = sweep(tmp_path, *TINY, "--model", "tests.company:mlp", "--storage", pg, "--dry-run")  # (as it ran)
        assert dry.stdout.splitlines()[-1] == f"study accum_lr in {pg}: {len(complete)} trials done, 0 running, 0 to run"

        # The MLflow UI, as a user opens it: the runs table and the latest parent run's page have their
        # standard columns filled (source, version, user, dataset) and the descriptions written.
        from batchsweep.analysis import cli as report_cli

        report = in_process(report_cli.main, tmp_path, "--study", "accum_lr", "--out", str(tmp_path / "reports"),
                            "--tracking-uri", tracking)  # (in this process: its imports paid once)
        assert report.returncode == 0, report.stderr[-2000:]
        experiment = client.get_experiment_by_name("accum_lr").experiment_id
        latest = max(parents, key=lambda r: (r.info.start_time, r.info.run_id)).info.run_id  # as the report picks
        table = ui_text(f"{tracking}/#/experiments/{experiment}/runs", tmp_path / "ui-table")
        assert "true-batch twins" in table  # the experiment's description: the study's summary
        assert "Source" in table and "run.py" in table and "tests.factories:blobs1k" in table, table[:3000]
        page = ui_text(f"{tracking}/#/experiments/{experiment}/runs/{latest}", tmp_path / "ui-run")
        assert "Findings of study accum_lr:" in page and "report.html" in page, \
            ([(p.info.run_id, p.info.start_time) for p in parents], page[:3000])
        assert f"Created by {getpass.getuser()}" in page and "run.py" in page
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        assert commit[:7] in page  # the Version: mlflow.source.git.commit
        assert "Datasets tests.factories:blobs1k" in page


def ui_text(url, profile):
    """The text of a page of the MLflow UI after headless Chromium has run its scripts."""
    from tests.test_analysis import chromium

    out = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", f"--user-data-dir={profile}", "--window-size=2400,1400",
                          "--virtual-time-budget=25000", "--dump-dom", url], capture_output=True, text=True, timeout=180)
    text = re.sub(r"<(script|style)\b.*?</\1>", " ", out.stdout, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text)))


def test_corrupted_optuna_storage_is_one_line_and_left_alone(tmp_path):
    (tmp_path / "mlruns").mkdir()
    (tmp_path / "mlruns/optuna.db").write_bytes(b"this is not a database" * 100)
    proc = sweep(tmp_path, *TINY)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "cannot open the Optuna storage" in proc.stderr
    assert (tmp_path / "mlruns/optuna.db").read_bytes() == b"this is not a database" * 100


@pytest.mark.parametrize("damage,expected", [
    (lambda good: b"not a journal\n", "its last line is not one of Optuna's records"),
    (lambda good: good + b'{"op_code":4,"worker_id":"w', "ends in a line cut short"),
    (lambda good: good[:good.index(b"\n") + 1] + b"garbage\n" + good[good.index(b"\n") + 1:],
     "a line before its last is not one of Optuna's records"),
])
def test_a_damaged_journal_is_one_line_and_left_alone(tmp_path, damage, expected):
    """Optuna skips a journal's last line that does not parse, as a write in progress, and would append after it:
    the run and its dry run refuse such a file before writing to it."""
    from optuna.storages.journal import JournalFileBackend

    good = tmp_path / "good.log"
    study = optuna.create_study(storage=optuna.storages.JournalStorage(JournalFileBackend(str(good))))
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=1)
    journal = tmp_path / "optuna.log"
    journal.write_bytes(damage(good.read_bytes()))
    before = journal.read_bytes()
    for dry in ([], ["--dry-run"]):
        proc = sweep(tmp_path, *TINY, "--storage", f"journal:{journal}", *dry)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("error: ") and expected in proc.stderr, proc.stderr
        assert journal.read_bytes() == before


def test_a_dry_run_reads_a_journal_in_a_folder_it_cannot_write(tmp_path):
    """The journal check takes the journal's lock, a file beside it; where the folder cannot be written (immutable,
    which root cannot write either) the dry run looks without it, as it did before the check."""
    folder = tmp_path / "shared"
    folder.mkdir()
    url = f"journal:{folder}/optuna.log"
    assert sweep(tmp_path, *TINY, "--n-trials", "1", "--storage", url).returncode == 0
    probe = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if probe.returncode:
        pytest.skip(f"this file system or sandbox refuses chattr +i ({probe.stderr.strip()})")
    try:
        proc = sweep(tmp_path, *TINY, "--storage", url, "--dry-run")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert proc.returncode == 0, proc.stderr
    assert f"study accum_lr in {url}: 1 trial done, 0 running," in proc.stdout, proc.stdout


def test_store_folder_that_cannot_be_created(tmp_path):
    (tmp_path / "mlruns").write_text("a file where the store folder should be")
    proc = sweep(tmp_path, *TINY)
    assert proc.returncode == 2
    assert proc.stderr.strip() .startswith("error: cannot create the Optuna storage folder")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flag,url,expected", [
    ("--storage", "postgresql://nobody@127.0.0.1:{port}/none", "cannot open the Optuna storage"),
    ("--tracking-uri", "http://127.0.0.1:{port}", "cannot reach the MLflow tracking server"),
])
def test_a_hung_server_is_an_error_not_a_hang(tmp_path, flag, url, expected):
    from tests.servers import hung_server

    with hung_server() as port:
        # No timing goal here (machines are noisy): docs/reliability.md has the measured seconds.
        proc = sweep(tmp_path, *TINY, flag, url.format(port=port), timeout=60, process=True)  # a hang fails
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and expected in proc.stderr


def test_points_larger_than_the_training_set_are_recorded_and_skipped(tmp_path):
    proc = sweep(tmp_path, *TINY, "--study", "batch_memory")  # 1,024 samples: b = 512 and 1024 at k = 4 cannot run
    assert proc.returncode == 0, proc.stderr
    assert "effective batch 2048 (physical_batch 512 x accum_steps 4) is larger than the training set" in proc.stderr
    # The grid chose the point: the line says it is skipped, not which command-line flag to lower.
    assert "training set (1024 samples): skipped as invalid" in proc.stderr and "--physical-batch" not in proc.stderr
    storage, client = stores(tmp_path)
    trials = grid_trials(storage, "batch_memory")
    invalid = sorted(t.user_attrs["config"]["physical_batch"] for t in trials if t.user_attrs.get("reason") == "invalid")
    assert invalid == [512, 1024] and len(trials) == 16
    children, _ = child_runs(client, "batch_memory")
    assert sorted(r.data.tags.get("reason", "") for r in children if r.info.status == "FAILED") == ["invalid"] * 2


@pytest.mark.slow
def test_system_metrics_are_logged_for_each_trial(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")  # trials of a second (30 epochs) get several
    proc = sweep(tmp_path, *TINY, "--epochs", "30", "--n-trials", "2", "--system-metrics", "--no-fuse")
    assert proc.returncode == 0, proc.stderr
    children, _ = child_runs(stores(tmp_path)[1])
    assert len(children) == 2
    for run in children:
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
        assert run.info.status == "FINISHED"
