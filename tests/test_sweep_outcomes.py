"""How trials end: diverged, failed, pruned, interrupted; and the equivalence and lr_search studies."""
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest

from tests.conftest import ROOT
from tests.test_sweeps import TINY, child_runs, stores, sweep, wait_for_complete

State = optuna.trial.TrialState


def runs_by_trial(client, trials, name="accum_lr"):
    children, _ = child_runs(client, name)
    by_id = {r.info.run_id: r for r in children}
    return [by_id[t.user_attrs["mlflow_run_id"]] for t in trials]


def test_diverged_trials_are_recorded_and_the_study_goes_on(tmp_path):
    proc = sweep(tmp_path, *TINY, "--set", "base_lr=1e9", "--set", "weight_decay=0", "--n-trials", "2")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert [t.state for t in trials] == [State.PRUNED] * 2
    assert [t.user_attrs["reason"] for t in trials] == ["diverged"] * 2
    runs = runs_by_trial(client, trials)
    assert [(r.info.status, r.data.tags["reason"]) for r in runs] == [("FAILED", "diverged")] * 2
    assert "diverged" in proc.stdout  # the final table says it


def test_a_failing_model_factory_fails_its_trial_and_the_study_goes_on(tmp_path):
    proc = sweep(tmp_path, *TINY, "--model", "tests.factories:broken_model", "--n-trials", "3")
    assert proc.returncode == 1, proc.stderr  # it went on, and every trial failed: the command fails
    assert proc.stderr.count("failed: RuntimeError: factory exploded") == 3
    assert "Traceback" not in proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert [t.state for t in trials] == [State.FAIL] * 3
    assert len({t.user_attrs["config"]["lr_rule"] for t in trials}) == 3  # three points, none retried now
    assert [t.user_attrs["error"] for t in trials] == ["RuntimeError: factory exploded"] * 3  # in Optuna too
    assert proc.stderr.strip().splitlines()[-1] == "error: all 3 trials of study accum_lr failed with an error; the " \
        "last, trial 2: RuntimeError: factory exploded (see the 'error' tag of their MLflow runs)"
    for run in runs_by_trial(client, trials):
        assert run.info.status == "FAILED" and run.data.tags["reason"] == "error"
        assert run.data.tags["error"] == "RuntimeError: factory exploded"


def test_fail_fast_stops_at_the_first_failure(tmp_path):
    proc = sweep(tmp_path, *TINY, "--model", "tests.factories:broken_model", "--fail-fast")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == \
        "error: trial 0 failed: RuntimeError: factory exploded (stopped by --fail-fast)"
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert trials[0].state == State.FAIL and trials[0].user_attrs["error"] == "RuntimeError: factory exploded"
    # The trials claimed with it as its fused group stop with it, interrupted: their points run again.
    assert all(t.state == State.FAIL and t.user_attrs["reason"] == "interrupted" for t in trials[1:])
    _, parents = child_runs(client)
    assert [p.info.status for p in parents] == ["FAILED"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ctrl_c_marks_the_running_trial_and_says_how_to_resume(tmp_path, workers):
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # The first two points train 1 epoch and complete (whichever of them a worker starts at); the others are
    # long, still training when the signal lands. As from a terminal: a shell that started the tests in the
    # background left SIGINT ignored, and a child inherits that. The signal goes to the main process alone
    # (kill -INT), which sends each worker SIGTERM (from a terminal they got SIGINT too).
    long = 100 if workers == 1 else 400
    (tmp_path / "study.toml").write_text(f"""name = "accum_lr"
[fixed]
model = "mlp"
dataset = "tests.factories:blobs1k"
[grid]
"accum_steps+epochs" = [[1, 1], [2, 1], [4, {long}], [8, {long}]]
""")
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), "--study", "study.toml", "--seeds", "1",
                             "--workers", str(workers), "--log-models", "none", "--no-report", "--no-fuse"],
                            cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_complete(tmp_path / "mlruns/optuna.db", 1, proc)
    storage = f"sqlite:///{tmp_path}/mlruns/optuna.db"
    # Inside a long trial's training: once it has checkpointed its first epoch of `long` (a short trial has a
    # checkpoint too while it is being recorded; the next tests cover a Ctrl-C then).
    def training() -> bool:
        try:
            trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
        except KeyError:  # a record read while the sweep writes it (as wait_for_complete, poll again)
            return False
        running = {t.user_attrs["mlflow_run_id"] for t in trials if t.state == State.RUNNING
                   and "mlflow_run_id" in t.user_attrs and t.user_attrs["config"]["epochs"] == long}
        def run_of(folder):
            try:
                return (folder / "mlflow_run_id").read_text() if (folder / "checkpoint.pt").exists() else None
            except OSError:  # removed meanwhile, with its ended trial
                return None

        return any(run_of(folder) in running for folder in (tmp_path / "mlruns/checkpoints/accum_lr").glob("*"))

    while not training() and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "run the same command again to resume" in err and "Traceback" not in err
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert all(t.state.is_finished() for t in trials), (  # (what a trial left RUNNING held, to tell why)
        [(t.number, t.state.name, t.user_attrs) for t in trials if not t.state.is_finished()], err[-3000:])
    interrupted = [t for t in trials if t.state == State.FAIL]
    assert 1 <= len(interrupted) <= workers, (  # a worker may have been between two trials
        [(t.number, t.user_attrs.get("reason")) for t in interrupted], err[-3000:])
    # A worker stopped after it claimed a trial but before it started the trial's run leaves a trial without
    # one (and where the stop landed inside Optuna before the objective began, without a reason either);
    # the trial that was training has its run, ended KILLED as interrupted.
    started = [t for t in interrupted if "mlflow_run_id" in t.user_attrs]
    assert all(t.user_attrs.get("reason") == "interrupted" for t in started), err[-3000:]
    assert [t for t in started if t.user_attrs["config"]["epochs"] == long], err[-3000:]
    for run in runs_by_trial(client, started):
        assert run.info.status == "KILLED" and run.data.tags["reason"] == "interrupted", (
            run.info.status, {k: v for k, v in run.data.tags.items() if k in ("reason", "state", "error")},
            err[-3000:])
    children, parents = child_runs(client)
    assert [p.info.status for p in parents] == ["KILLED"]
    assert not [r for r in children if r.info.status == "RUNNING"]


def main_with_its_sigint_handler(args: list[str]) -> int:
    """sweeps/run.py's main, in this process, with the SIGINT handler that the script installs."""
    from batchsweep.sweeps.cli import main
    from batchsweep.trainers import interrupt

    interrupt.trap()
    try:
        return main(args)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def the_one_trial_interrupted(tmp_path, capsys):
    """Check that the study stopped at one trial, recorded as interrupted in Optuna and MLflow; its run."""
    assert "run the same command again to resume" in capsys.readouterr().err
    storage, client = stores(tmp_path)
    (trial,) = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert trial.state == State.FAIL and trial.user_attrs["reason"] == "interrupted"
    (run,) = runs_by_trial(client, [trial])
    assert (run.info.status, run.data.tags["reason"]) == ("KILLED", "interrupted")
    return run


def test_a_ctrl_c_while_a_complete_trial_is_recorded_ends_its_run_as_interrupted(tmp_path, monkeypatch, capsys):
    """Training is over and the result is being written when Ctrl-C lands. The objective then raised, so Optuna
    fails the trial: its run must end KILLED as interrupted too, not stay open for the worker to close FAILED."""
    from batchsweep.sweeps.cli import main
    from batchsweep.sweeps.stores.mlflow_store import Tracker

    record = Tracker.finish

    def finish(self, run_id, status, **kwargs):
        error = record(self, run_id, status, **kwargs)
        if status == "FINISHED":  # the complete trial's metrics are written; its run is left open for Optuna
            raise KeyboardInterrupt  # as a Ctrl-C that lands right there
        return error

    monkeypatch.setattr(Tracker, "finish", finish)
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, "--n-trials", "2", "--no-fuse"]) == 130  # (optimize()'s path)
    run = the_one_trial_interrupted(tmp_path, capsys)
    assert run.data.metrics["train_loss"] > 0  # what it trained is kept


def test_a_ctrl_c_inside_optunas_tell_stops_the_study_and_records_the_trial(tmp_path, monkeypatch, capsys):
    """Optuna records a trial after its objective returned; a Ctrl-C that lands there comes out of optimize() as
    an UnboundLocalError (its `finally` reads a variable the interrupted tell never set) and leaves the trial
    RUNNING. The study must stop there, as for any Ctrl-C, and record that trial as interrupted."""
    from batchsweep.trainers import interrupt

    tell = optuna.storages.RDBStorage.set_trial_state_values

    def set_trial_state_values(self, trial_id, state, values=None):
        if state == State.COMPLETE:
            # raise_signal, not os.kill: the signal goes to this thread, and its handler (sweeps/run.py's) runs
            # before the call returns, so the KeyboardInterrupt comes out of this write, on any machine's load.
            signal.raise_signal(signal.SIGINT)
        return tell(self, trial_id, state, values)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", set_trial_state_values)
    monkeypatch.chdir(tmp_path)
    assert main_with_its_sigint_handler([*TINY, "--n-trials", "3", "--no-fuse"]) == 130
    assert not interrupt.pending()  # handled: a later run in this process is not stopped by it
    the_one_trial_interrupted(tmp_path, capsys)  # no next trial


def test_a_ctrl_c_that_a_library_replaces_with_another_error_is_an_interruption(tmp_path, monkeypatch, capsys):
    """Code that catches the KeyboardInterrupt and raises something else would make the trial an `error` and the
    study go on; while a Ctrl-C is pending, any error out of training is that Ctrl-C."""
    monkeypatch.chdir(tmp_path)
    assert main_with_its_sigint_handler([*TINY, "--model", "tests.factories:swallows_ctrl_c", "--n-trials", "3",
                                        "--no-fuse"]) == 130
    the_one_trial_interrupted(tmp_path, capsys)


@pytest.mark.slow
def test_equivalence_study_separates_bn_from_no_bn(tmp_path, data_dir):
    proc = sweep(tmp_path, "--study", "equivalence", "--epochs", "1", "--seeds", "1", "--set", "max_steps=4",
                 "--set", f"data_dir={data_dir}")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="equivalence", storage=storage).trials
    assert len(trials) == 9 and all(t.state == State.COMPLETE for t in trials)
    for t, run in zip(trials, runs_by_trial(client, trials, "equivalence")):
        diff = run.data.metrics["param_rel_diff"]
        assert diff == pytest.approx(t.value)
        assert "acc_gap" in run.data.metrics and "twin_val_acc" in run.data.metrics
        if t.user_attrs["config"]["model"] in ("mlp", "gpt"):
            assert diff < 1e-5  # float rounding only (gpt: over tokens, unequal between micro-batches)
        else:
            assert diff > 1e-3  # BatchNorm normalizes each micro-batch ...
            # ... as Ghost BN with ghost size b does: in float64 the ghost twin is exact, so what remains in
            # float32 (1e-3 to 1e-2 after an epoch, far below the difference without it) is rounding.
            assert run.data.metrics["ghost_rel_diff"] < diff / 20
            assert run.data.metrics["ghost_rel_diff_fp64"] < 1e-10
    report = (tmp_path / "reports/equivalence/report.md").read_text()
    assert "mlp: accumulation is exactly the true batch" in report
    assert "gpt: accumulation is exactly the true batch" in report and "never by k" in report
    assert "cnn1d: accumulation is not the true batch" in report and "ghost_batch = b came within" in report
    assert "in float64 the same pair agreed to" in report and "so what remains in float32 is rounding" in report
    labelled = re.findall(r"- \w+ on (?:mnist1d|pytext): (\w+)", report)  # the sentences of each model and dataset
    assert labelled and all(word[0].islower() or word[1:2].isupper() for word in labelled), labelled


def test_a_pair_without_batchnorm_that_parts_is_trained_again_in_float64(monkeypatch, data_dir):
    """Where float32 parts the pair by the report's line or more, float64 says whether it is rounding: this
    one's is (the line is lowered to 0 here, so that a pair of a few steps crosses it)."""
    from batchsweep.sweeps.trials.objective import Equivalence
    from batchsweep.sweeps.study.files import load
    from batchsweep.trainers import TrainConfig

    objective = Equivalence(load("equivalence"))
    config = TrainConfig(model="mlp", dataset="mnist1d", physical_batch=32, accum_steps=4, epochs=1, max_steps=3,
                         data_dir=data_dir)
    metrics = objective.train(config, lambda row: None).metrics
    assert metrics["param_rel_diff"] < objective.recheck and "param_rel_diff_fp64" not in metrics
    monkeypatch.setattr(objective, "recheck", 0.0)
    metrics = objective.train(config, lambda row: None).metrics
    assert 0 < metrics["param_rel_diff"] and metrics["param_rel_diff_fp64"] < 1e-10


def test_lr_search_tunes_base_lr_with_tpe_and_prunes(tmp_path):
    proc = sweep(tmp_path, *TINY, "--study", "lr_search", "--epochs", "4", "--n-trials", "8")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    names = optuna.get_all_study_names(storage)
    assert len(names) == 6  # one TPE search per effective batch, all created before any worker starts
    trials = optuna.load_study(study_name="lr_search/accum_steps=1,physical_batch=32,seed=0", storage=storage).trials
    assert len(trials) == 8
    for t, run in zip(trials, runs_by_trial(client, trials, "lr_search")):
        assert 1e-3 <= t.params["base_lr"] <= 2.0
        assert float(run.data.params["base_lr"]) == pytest.approx(t.params["base_lr"])
        if t.user_attrs.get("reason") == "diverged":  # TPE tries LRs up to 2.0: some blow up
            assert (t.state, run.info.status, run.data.tags["reason"]) == (State.PRUNED, "FAILED", "diverged")
            continue
        expected = {State.COMPLETE: ("FINISHED", None), State.PRUNED: ("KILLED", "pruned")}[t.state]
        assert (run.info.status, run.data.tags.get("reason")) == expected
        if t.state == State.PRUNED:
            assert len(t.intermediate_values) < 4  # stopped before its last epoch


def test_out_of_memory_is_recorded_and_the_next_trial_runs(tmp_path):
    proc = sweep(tmp_path, *TINY, "--model", "tests.factories:OutOfMemory", "--n-trials", "2")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert [(t.state, t.user_attrs["reason"]) for t in trials] == [(State.PRUNED, "oom")] * 2
    assert [t.constraints for t in trials] == [{"infeasible": 1.0}] * 2  # what TPE and NSGA-II read
    assert [(r.info.status, r.data.tags["reason"]) for r in runs_by_trial(client, trials)] == [("FAILED", "oom")] * 2


@pytest.mark.parametrize("fuse", [True, False])
def test_a_stop_inside_optunas_ask_leaves_no_trial_running(tmp_path, monkeypatch, fuse):
    """A stop that lands after Optuna has created a trial but before the worker has given it an owner (here, in
    the sampler's before_trial, which Optuna calls inside ask()) waits until the owner is set, then ends that
    trial as interrupted: before, it was left RUNNING for the next invocation to fail after the heartbeat's grace."""
    import os

    from batchsweep.sweeps.study.search import Pinned
    from batchsweep.trainers import interrupt

    before = Pinned.before_trial

    def stopped_at_the_second(self, study, trial):
        before(self, study, trial)
        if trial.number == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, in this (the main) thread

    monkeypatch.setattr(Pinned, "before_trial", stopped_at_the_second)
    (tmp_path / "study.toml").write_text('name = "accum_lr"\n[grid]\naccum_steps = [1, 2, 4, 8]\n')
    with interrupt.trapped():
        done = sweep(tmp_path, "--study", "study.toml", *TINY, *([] if fuse else ["--no-fuse"]))
    assert done.returncode == 130, done.stderr[-2000:]
    trials = optuna.load_study(study_name="accum_lr", storage=stores(tmp_path)[0]).trials
    # Alone, the first trial trained and completed; fused, it was claimed into the group that the stop ended.
    assert trials[0].state == (State.FAIL if fuse else State.COMPLETE), trials[0].user_attrs
    assert all(t.state.is_finished() for t in trials), [(t.number, t.state.name, t.user_attrs) for t in trials]
    assert trials[1].state == State.FAIL and trials[1].user_attrs["reason"] == "interrupted"
    assert trials[1].user_attrs.get("owner"), trials[1].user_attrs
