"""Stop means stop: every row of docs/reliability.md's table of signals, on a real study with 2 workers and on an
audit. Each signal lands once every worker is held inside a trial (tests.factories:holds_each) or the audit's
script is running (tests/programs/hang.py): a point made certain by an event, never by a sleep."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from mlflow import MlflowClient

from tests.conftest import ROOT, in_process
from tests.test_sweeps import child_runs, stores
from batchsweep.trainers import interrupt

pytestmark = pytest.mark.slow
State = optuna.trial.TrialState
STUDY = """name = "stops"
[fixed]
model = "tests.factories:holds_each"
dataset = "tests.factories:blobs1k"
epochs = 3
[grid]
accum_steps = [1, 2, 4, 8]
"""
# Every process of the study or audit is gone this long after the main process ended: a bound, not a measure of
# how fast a stop is. After a SIGKILL of the main process its workers still record their trials (Optuna, MLflow)
# before they end, which takes a while on a loaded machine; otherwise it is room for the kernel to reap them.
GONE_S = 60


def start(cwd: Path, argv: list[str], env: dict[str, str], ignore_sigint: bool = False) -> subprocess.Popen:
    """A command in a process group of its own, as a shell's job: SIGINT as a terminal leaves it, or ignored, as
    `cmd &` in a script leaves it."""
    def before():
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)
    return subprocess.Popen(argv, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=before)


def wait_for(done, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            raise AssertionError(f"the command ended before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no {what} in {timeout} s")
        time.sleep(0.1)


def processes(proc: subprocess.Popen) -> tuple[list[psutil.Process], dict[int, str]]:
    """The command's process and all it started (workers, scripts and their children), and their command lines."""
    main = psutil.Process(proc.pid)
    procs = [main, *main.children(recursive=True)]
    return procs, {p.pid: " ".join(p.cmdline())[:100] for p in procs}


def all_gone_within(procs: list[psutil.Process], names: dict[int, str], seconds: float) -> list[str]:
    """The processes still running `seconds` after the signal (none, where all is well); an ended one that its
    parent has not reaped yet (a zombie) is gone."""

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    while any(running(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [f"{p.pid} {names[p.pid]}" for p in procs if running(p)]
    for p in procs:
        if running(p):
            p.kill()
    return left


def stop(proc: subprocess.Popen, how: str, held: Path | None = None) -> None:
    """Send what `how` names: a terminal's Ctrl-C reaches the whole group; `kill` the main process alone (as a
    scheduler's cancel does first: how soon all is gone, before its SIGKILL 10 s later, is a speed that
    benchmarks/stop_time.py measures); `timeout` passes a SIGTERM it gets on to its command and the group (as when
    its time runs out); a second signal stops at once."""
    if how == "terminal":
        os.killpg(proc.pid, signal.SIGINT)
    elif how in ("sigint", "sigterm", "sigkill", "timeout"):
        proc.send_signal({"sigint": signal.SIGINT, "sigkill": signal.SIGKILL}.get(how, signal.SIGTERM))
    else:  # "second": another SIGTERM once both workers are busy stopping (they swallow the first)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: len(list(held.glob("*.stopping"))) == 2, proc, "two stopping workers", timeout=60)
        # The main process took the first signal before the workers were told: a repeat within REPEAT_S of it is
        # the same stop (as `timeout` sends it), so the second comes after that.
        time.sleep(interrupt.REPEAT_S + 0.5)
        proc.send_signal(signal.SIGTERM)


@pytest.mark.parametrize("how", ["terminal", "sigint", "sigterm", "sigkill", "timeout", "second"])
def test_a_stopped_study_leaves_nothing_running_and_resumes_every_point_once(tmp_path, how):
    (tmp_path / "study.toml").write_text(STUDY)
    (tmp_path / "held").mkdir()
    # (trials alone, one held in each worker: the hold counts one trial a worker, and a fused group holds several)
    argv = [sys.executable, str(ROOT / "sweeps/run.py"), "--study", "study.toml", "--seeds", "1", "--workers", "2",
            "--log-models", "none", "--no-report", "--no-fuse"]
    hold = {"BATCHSWEEP_TEST_HOLD_EACH": f"{tmp_path / 'held'}:2" + (":stubborn" if how == "second" else "")}
    proc = start(tmp_path, (["timeout", "600"] if how == "timeout" else []) + argv, hold,
                 ignore_sigint=how == "sigint")
    wait_for(lambda: len(list((tmp_path / "held").glob("*.held"))) == 2, proc, "two held workers")
    procs, names = processes(proc)
    assert len([n for n in names.values() if "multiprocessing.spawn" in n]) == 2
    stop(proc, how, tmp_path / "held")
    # The main process ends once its workers have recorded their stop (on a loaded machine that takes a while);
    # nothing of the study may outlive it.
    _, err = proc.communicate(timeout=180)
    left = all_gone_within(procs, names, GONE_S)
    assert not left, (left, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="stops", storage=storage).trials
    if how != "sigkill":
        assert proc.returncode == 130, err[-3000:]
        said = "interrupted" if how in ("terminal", "sigint") else "stopped by SIGTERM"
        assert f"{said}: finished trials are kept; run the same command again to resume study stops" in err, err
        _, parents = child_runs(client, "stops")
        assert [(p.info.status) for p in parents] == ["KILLED"]
    children, _ = child_runs(client, "stops")
    if how == "second":  # killed at once: the next invocation ends what they left RUNNING
        assert [t.state for t in trials] == [State.RUNNING] * 2
        assert [r.info.status for r in children] == ["RUNNING"] * 2
    else:  # the workers recorded their trials as interrupted, also where the main process was killed outright
        assert [(t.state.name, t.user_attrs.get("reason")) for t in trials] == [("FAIL", "interrupted")] * 2, (
            [(t.number, t.state.name, t.user_attrs) for t in trials], err[-3000:])
        assert [(r.info.status, r.data.tags.get("reason")) for r in children] == [("KILLED", "interrupted")] * 2

    # The same command with one worker, in this process: it trains there, its imports already paid.
    from batchsweep.sweeps.cli import main

    args = argv[2:]
    rerun = in_process(main, tmp_path, *args[:args.index("--workers") + 1], "1", *args[args.index("--workers") + 2:])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    trials = optuna.load_study(study_name="stops", storage=storage).trials
    complete = [t.user_attrs["config"]["accum_steps"] for t in trials if t.state == State.COMPLETE]
    assert sorted(complete) == [1, 2, 4, 8]  # every point once
    assert not [t for t in trials if t.state == State.RUNNING]
    children, parents = child_runs(client, "stops")
    assert not [r for r in children + parents if r.info.status == "RUNNING"]
    # The interrupted points went on from their checkpoints: nothing trained before the stop is trained again.
    resumed = [r for r in children if r.info.status == "FINISHED" and "resumed_after_epoch" in r.data.tags]
    assert len(resumed) == 2, [(r.info.run_name, r.data.tags.get("resumed_after_epoch")) for r in children]


AUDIT = """name = "stops"
[fixed]
pids = "{pids}"
[program]
command = ["{python}", "sleeps.py", "{{pids}}", "{{physical_batch}}", "{{accum_steps}}", "{{max_steps}}", "{{epochs}}"]
"""
# A script that writes its pid, then sleeps until stopped. (A script's own children are the script's to stop: a
# SIGKILL of batchsweep reaches the script alone, as SIGTERM; tests/test_programs.py stops a group that holds one.)
SLEEPS = """import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""


@pytest.mark.parametrize("how", ["terminal", "sigterm", "sigkill"])
def test_a_stopped_audit_stops_its_script_and_ends_its_runs(tmp_path, how):
    pids = tmp_path / "pids"
    (tmp_path / "study.toml").write_text(AUDIT.format(pids=pids, python=sys.executable))
    (tmp_path / "sleeps.py").write_text(SLEEPS)
    argv = [sys.executable, "-c", "import sys; from batchsweep.sweeps.commands import main; sys.exit(main())", "audit",
            "--study", "study.toml", "--physical-batch", "4", "--accum-steps", "2", "--steps", "2"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")

    def audit_runs():
        return client.search_runs([client.get_experiment_by_name("stops-audit").experiment_id])

    for attempt in (1, 2):  # the second audit closes what a killed first one left RUNNING
        pids.unlink(missing_ok=True)
        proc = start(tmp_path, argv, {})
        wait_for(pids.exists, proc, "the script's pids")
        procs, names = processes(proc)
        assert len(procs) == 2  # the audit and its script
        stop(proc, how if attempt == 1 else "sigterm")
        _, err = proc.communicate(timeout=180)
        left = all_gone_within(procs, names, GONE_S)
        assert not left, (left, err[-3000:])
        if attempt == 1 and how == "sigkill":
            assert proc.returncode == -signal.SIGKILL
            assert sorted(r.info.status for r in audit_runs()) == ["RUNNING", "RUNNING"]
            continue
        assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
        said = "interrupted" if how == "terminal" and attempt == 1 else "stopped by SIGTERM"
        assert f"{said}: the audit's runs end KILLED; run the same command again" in err, err
    runs = audit_runs()
    assert len(runs) == 4 and not [r for r in runs if r.info.status == "RUNNING"]
    assert {(r.info.status, r.data.tags.get("reason")) for r in runs} == {("KILLED", "interrupted")}


def test_a_stop_that_lands_as_the_store_commits_a_trials_run_leaves_it_among_the_runs_ended(tmp_path):
    """The store makes a trial's run RUNNING in one commit; a stop that lands right after it (sent from
    SQLAlchemy's after_commit of the session that inserted the run) reaches the caller with the run among
    `open_runs`, which every way out of a worker ends: it was left RUNNING after a Ctrl-C."""
    from mlflow.store.tracking.dbmodels.models import SqlRun
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    from batchsweep.sweeps.stores.mlflow_store import Tracker

    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "stops")
    parent = tracker.start_parent("parent", {}, {})
    inserted, sent = set(), []

    def flushed(session, context):
        if any(isinstance(row, SqlRun) for row in session.new):
            inserted.add(id(session))

    def committed(session):
        if id(session) in inserted and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    event.listen(Session, "after_flush", flushed)
    event.listen(Session, "after_commit", committed)
    try:
        with interrupt.trapped(), pytest.raises(KeyboardInterrupt):
            tracker.start_trial(parent, "0: stopped", {}, {})
    finally:
        event.remove(Session, "after_flush", flushed)
        event.remove(Session, "after_commit", committed)
        interrupt.handled()
    assert sent, "the run's commit was never seen"
    runs = [r for r in tracker.client.search_runs([tracker.experiment_id]) if r.info.run_id != parent]
    assert [r.info.status for r in runs] == ["RUNNING"] and {r.info.run_id for r in runs} <= tracker.open_runs
    tracker.end_open_runs("KILLED")
    assert [tracker.client.get_run(r.info.run_id).info.status for r in runs] == ["KILLED"]
