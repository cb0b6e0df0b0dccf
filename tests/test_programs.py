"""[program] trials: the user's own script, swept with its own metrics, memory measured, every ending recorded."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import psutil
import pytest

from tests.conftest import ROOT
from tests.test_sweeps import child_runs, stores, sweep

State = optuna.trial.TrialState
LOOP = ROOT / "tests" / "programs" / "loop.py"
HANG = ROOT / "tests" / "programs" / "hang.py"
COMMAND = (f'command = ["{{python}}", "{LOOP}", "--batch-size", "{{physical_batch}}", "--accum", "{{accum_steps}}", '
           f'"--lr", "{{lr}}", "--seed", "{{seed}}", "--epochs", "{{epochs}}"')


def study_file(folder: Path, name: str, body: str, command: str = COMMAND + "]") -> Path:
    path = folder / f"{name}.toml"
    path.write_text(f'name = "{name}"\n{body}\n[program]\n{command}\n')
    return path


def trials_of(storage: str, name: str) -> list:
    return [t for t in optuna.load_study(study_name=name, storage=storage).trials
            if t.user_attrs.get("reason") != "duplicate"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def held(path: Path, proc: subprocess.Popen, timeout: float = 180) -> list[int]:
    """Wait until a script writes its pids to `path` (it is then running, and holds): [pid, child pid]."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the script never held"
        time.sleep(0.1)
    return [int(x) for x in path.read_text().split()]


@pytest.mark.slow
def test_a_script_swept_by_two_workers_killed_and_rerun_completes_every_point_once(tmp_path):
    hold = tmp_path / "hold"
    path = study_file(tmp_path, "script_grid", """seeds = 1
workers = 2
[fixed]
epochs = 2
base_lr = 0.1
lr_rule = "linear"
base_batch = 16
[grid]
physical_batch = [8, 16]
accum_steps = [1, 2]
""", COMMAND + f', "--hold", "{hold}"]')
    # The first invocation: a script holds after its first epoch (a file says so), then the sweep is killed.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), "--study", str(path)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    script, child = held(Path(f"{hold}.held"), proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the command and its workers, as a kill of the job would
    proc.wait()
    deadline = time.monotonic() + 30  # the workers' death sends the script SIGTERM; its group goes with it
    while not gone(script) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(script)
    hold.write_text("")  # the rerun does not hold
    rerun = sweep(tmp_path, "--study", str(path), process=True)  # and its report's line
    assert rerun.returncode == 0, rerun.stderr
    # A child the script started outlives a SIGTERM to the script alone: it carries the killed invocation's token,
    # which the rerun finds.
    assert gone(child) and re.search(rf"warning: an invocation of this study that was killed had left \d+ "
                                     rf"process(es)? that its trials started running \((.*, )?{child} \(",
                                     rerun.stderr), rerun.stderr
    assert "report: " in rerun.stdout
    storage, client = stores(tmp_path)
    trials = trials_of(storage, "script_grid")
    complete = [t for t in trials if t.state == State.COMPLETE]
    keys = sorted(tuple(sorted(t.user_attrs["config"].items())) for t in complete)
    assert len(keys) == 4 and len(set(keys)) == 4  # 2 x 2 points, each complete exactly once
    assert all(t.state == State.FAIL for t in trials if t.state != State.COMPLETE)  # the killed trial(s)
    children, parents = child_runs(client, "script_grid")
    assert not [r for r in children + parents if r.info.status == "RUNNING"]
    by_id = {r.info.run_id: r for r in children}
    for t in complete:
        run = by_id[t.user_attrs["mlflow_run_id"]]
        assert run.data.tags["mlflow.parentRunId"] in {p.info.run_id for p in parents}
        b, k = int(run.data.params["physical_batch"]), int(run.data.params["accum_steps"])
        assert run.data.params["effective_batch"] == str(b * k) and "model" not in run.data.params
        steps = client.get_metric_history(run.info.run_id, "loss")
        assert [m.step for m in steps] == list(range(1, 2 * 480 // (b * k) + 1))  # one row per optimizer step
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_acc")] == [1, 2]
        assert run.data.metrics["val_acc"] == pytest.approx(t.value)
        assert run.data.metrics["peak_memory_bytes"] > 50 * 2 ** 20  # a Python with torch, sampled
        assert run.data.tags["memory_source"] == "rss" and run.data.tags["exit_status"] == "0"
        assert run.data.metrics["wall_time_s"] > 0
        log = Path(client.download_artifacts(run.info.run_id, "log.txt", str(tmp_path))).read_text()
        assert '"val_acc"' in log and "done" in log
    # The correct loop is exact: (8, 2) and (16, 1) from the same seed end with the same accuracy.
    by_point = {(c["physical_batch"], c["accum_steps"], c["seed"]): t.value
                for t in complete for c in [t.user_attrs["config"]]}
    assert by_point[(8, 2, 0)] == pytest.approx(by_point[(16, 1, 0)], abs=1e-6)
    assert (tmp_path / "reports/script_grid/accuracy_vs_batch.png").exists()
    # The "lr" the script logged keeps MLflow's name beside the param it was given: one column each.
    csv = tmp_path / "reports/script_grid/trials.csv"
    assert csv.read_text().splitlines()[0].split(",").count("lr") == 1  # (read_csv would call a second one "lr.1")
    table = pd.read_csv(csv)
    assert list(table["lr"]) == pytest.approx(list(0.1 * table["effective_batch"] / 16))
    done = table[table["status"] == "FINISHED"]  # (the killed trial's run holds no metric)
    assert len(done) == 4 and list(done["metrics.lr"]) == pytest.approx(list(done["lr"]))  # no schedule: the LR given


def test_a_script_that_logs_through_mlflow_itself(tmp_path):
    path = study_file(tmp_path, "script_mlflow", """[fixed]
epochs = 3
physical_batch = 16
accum_steps = 2
""", COMMAND + ', "--mode", "mlflow"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    [trial] = trials_of(storage, "script_mlflow")
    assert trial.state == State.COMPLETE
    [run], _ = child_runs(client, "script_mlflow")
    assert run.info.status == "FINISHED" and run.data.tags["state"] == "COMPLETE"
    history = client.get_metric_history(run.info.run_id, "val_acc")
    assert [m.step for m in history] == [1, 2, 3]  # once each: not logged again by batchsweep
    assert trial.value == pytest.approx(history[-1].value)
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 3 * 480 // 32
    assert run.data.metrics["peak_memory_bytes"] > 0


@pytest.mark.slow
def test_crash_out_of_memory_and_a_clean_script_end_in_their_outcomes(tmp_path):
    path = study_file(tmp_path, "script_outcomes", """[fixed]
epochs = 2
physical_batch = 16
note = "postgresql://me:s3cr3t@db.example/runs"
[grid]
mode = ["ok", "fail", "oom"]
""", COMMAND + ', "--mode", "{mode}", "--note", "{note}"]')
    proc = sweep(tmp_path, "--study", str(path), process=True)  # all that its workers print
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    storage, client = stores(tmp_path)
    trials = {t.user_attrs["config"]["mode"]: t for t in trials_of(storage, "script_outcomes")}
    children, _ = child_runs(client, "script_outcomes")
    runs = {r.data.params["mode"]: r for r in children}  # the study's own field is a param
    assert trials["ok"].state == State.COMPLETE and runs["ok"].info.status == "FINISHED"
    # A printed name that MLflow refuses would fail the whole record: it is logged under the name MLflow takes.
    assert runs["ok"].data.metrics["recall_1"] == runs["ok"].data.metrics["val_acc"]
    assert runs["ok"].data.tags["warnings"].startswith("the script's metric 'recall@1' is logged as 'recall_1'")
    assert trials["fail"].state == State.FAIL and runs["fail"].data.tags["reason"] == "error"
    assert runs["fail"].data.tags["error"] == ("ScriptFailed: the script ended with exit status 1: note: "
                                               "postgresql://me:***@db.example/runs / loading the data failed: no "
                                               "such file train.bin")
    assert trials["oom"].state == State.PRUNED and trials["oom"].user_attrs["reason"] == "oom"
    assert "CUDA out of memory" in runs["oom"].data.tags["error"]
    log = Path(client.download_artifacts(runs["oom"].info.run_id, "log.txt", str(tmp_path))).read_text()
    assert "Traceback" in log  # the script's own output is its log
    # A password in a URL of the study's own fields is in no log, param or tag, nor in the report.
    assert "note: postgresql://me:***@db.example/runs" in log and "s3cr3t" not in log
    assert runs["ok"].data.params["note"] == "postgresql://me:***@db.example/runs"
    assert "s3cr3t" not in proc.stdout + proc.stderr + str([r.data for r in children])
    report = (tmp_path / "reports/script_outcomes/report.md").read_text()
    assert "s3cr3t" not in report and "only batchsweep's trainer measures them" in report


def pruned_sweep(tmp_path: Path, name: str, epochs: int,
                 command: str) -> tuple[subprocess.CompletedProcess, optuna.trial.FrozenTrial]:
    """loop.py at four handicaps under the median pruner, told `epochs` in the study: the pruner's 3 to start
    from complete, and the handicapped one is pruned. The sweep, and that trial."""
    path = study_file(tmp_path, name, f"""[fixed]
epochs = {epochs}
physical_batch = 16
[grid]
handicap = [0.0, 0.01, 0.02, 0.6]
[search]
pruner = "median"
""", command)
    proc = sweep(tmp_path, "--study", str(path), "--workers", "1", "--no-report")
    assert proc.returncode == 0, proc.stderr
    trials = {t.user_attrs["config"]["handicap"]: t for t in trials_of(stores(tmp_path)[0], name)}
    assert [trials[h].state for h in (0.0, 0.01, 0.02)] == [State.COMPLETE] * 3
    pruned = trials[0.6]
    assert pruned.state == State.PRUNED and pruned.user_attrs["reason"] == "pruned"
    return proc, pruned


@pytest.mark.slow
def test_a_median_pruner_stops_a_script_mid_run(tmp_path):
    proc, pruned = pruned_sweep(tmp_path, "script_pruned", 6, COMMAND + ', "--handicap", "{handicap}"]')
    assert max(pruned.intermediate_values) < 6  # stopped before its last epoch
    client = stores(tmp_path)[1]
    run = client.get_run(pruned.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED"
    log = Path(client.download_artifacts(run.info.run_id, "log.txt", str(tmp_path))).read_text()
    assert "done" not in log  # it never reached its end
    assert " 6/6 [" in proc.stderr  # the bar over a trial's epochs counts to the 6 the script is given


@pytest.mark.slow
def test_a_script_not_given_its_epochs_has_a_bar_of_no_total_and_is_pruned_at_any_epoch(tmp_path):
    """loop.py is told 4 epochs in the command, not by {epochs}: the study's 2 are not its last. A bar over them
    would stop at 4/2, and a pruner that spared epochs from the 2nd on would never stop the handicapped one."""
    command = COMMAND.split(', "--epochs"')[0] + ', "--epochs", "4", "--handicap", "{handicap}"]'
    proc, pruned = pruned_sweep(tmp_path, "script_own_epochs", 2, command)
    assert 2 <= max(pruned.intermediate_values) < 4  # the median pruner waits 2 epochs
    # (a rate under 1 epoch/s, on a loaded machine, is shown as s/epoch)
    frames = [f for f in re.split(r"[\r\n]", proc.stderr) if re.search(r"epoch/s|s/epoch", f)]
    assert any(f.startswith("handicap=0: 4epoch [") and "val_acc=0." in f for f in frames), frames
    assert not any("/2 [" in f for f in frames), frames


def test_a_script_past_its_time_is_stopped_with_its_process_group(tmp_path):
    pids = tmp_path / "pids"
    path = study_file(tmp_path, "script_timeout", "", f'command = ["{{python}}", "{HANG}", "{pids}"]\n'
                                                     f'timeout_minutes = 0.1')
    proc = sweep(tmp_path, "--study", str(path))
    storage, client = stores(tmp_path)
    [trial] = trials_of(storage, "script_timeout")
    assert trial.state == State.FAIL and trial.user_attrs["reason"] == "error"
    [run], _ = child_runs(client, "script_timeout")
    assert run.data.tags["error"] == "ScriptFailed: timeout: ran past timeout_minutes = 0.1 and was stopped"
    assert all(gone(int(pid)) for pid in pids.read_text().split())  # the script and the child it started
    assert proc.returncode == 1  # its only trial failed


def test_ctrl_c_stops_the_scripts_process_group_and_records_the_trial_interrupted(tmp_path):
    pids = tmp_path / "pids"
    path = study_file(tmp_path, "script_ctrl_c", "", f'command = ["{{python}}", "{HANG}", "{pids}"]')
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), "--study", str(path)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    script, child = held(pids, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert gone(script) and gone(child)
    storage, client = stores(tmp_path)
    [trial] = trials_of(storage, "script_ctrl_c")
    assert trial.state == State.FAIL and trial.user_attrs["reason"] == "interrupted"
    [run], _ = child_runs(client, "script_ctrl_c")
    assert run.info.status == "KILLED"


@pytest.mark.parametrize("body, command, expected", [
    ("", 'command = ["{python}", "train.py", "--lr", "{learning_rate}"]',
     "program.command: {learning_rate} is not a placeholder"),
    ("", 'command = "python train.py"', "program.command: must be a non-empty list of arguments (no shell)"),
    ("", 'command = ["{python}", "t.py"]\ncwd = "no/such/folder"', "program.cwd: "),
    ("", 'command = ["{python}", "t.py"]\ntimeout_minutes = -1', "program.timeout_minutes: must be a positive"),
    ("[objective]\nkind = \"equivalence\"", 'command = ["{python}", "t.py"]', "objective.kind: a study with a "
                                                                            "[program] runs your script"),
    ("[fixed]\nwidth = [1, 2]", 'command = ["{python}", "t.py", "{width}"]', "fixed.width: must be text, a finite"),
    ("", 'command = ["pythn", "t.py"]', "program.command: 'pythn' is not a program it can start"),
    ("", 'command = ["{python}", "t.py"', "not valid TOML"),
    ('[fixed]\n"drop rate" = 0.1', 'command = ["{python}", "t.py"]',
     "fixed.drop rate: 'drop rate' is not a name a field of your own can have: use letters, digits and _, not a "
     "digit first, as a placeholder does ({drop_rate})"),
    ("", 'command = ["{python}", "t.py", "--accum", "{accum_steps"]',
     "program.command: '{accum_steps' is no placeholder: write a placeholder as {name}, without spaces "
     "({accum_steps}), and a literal brace as {{ or }}"),
    ("", 'command = ["{python}", "t.py"]\nenv = {K = "{ accum_steps }"}',
     "program.env.K: '{ accum_steps }' is no placeholder: write a placeholder as {name}, without spaces "
     "({accum_steps})"),
    ('[objective]\nmetrics = ["recall@1"]', 'command = ["{python}", "t.py"]',
     "objective.metrics: MLflow cannot hold a metric named 'recall@1' (it takes letters, digits and _ - . : / and "
     "spaces): a script's 'recall@1' is logged as 'recall_1': put that name here"),
])
def test_a_bad_program_table_is_one_line_before_anything_runs(tmp_path, body, command, expected):
    path = study_file(tmp_path, "bad_program", body, command)
    for dry in ([], ["--dry-run"]):  # a malformed placeholder is no command line to show either
        proc = sweep(tmp_path, "--study", str(path), *dry)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f"error: {path}: {expected}"), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "mlruns").exists()
        assert "Traceback" not in proc.stderr and not proc.stdout


def test_a_doubled_brace_reaches_the_script_as_one():
    from batchsweep.sweeps.launch.program import Program

    program = Program(("{python}", "t.py", '--cfg={{"k": {accum_steps}}}'))
    assert program.placeholders() == ["python", "accum_steps"]
    assert program.argv({"accum_steps": 4})[2] == '--cfg={"k": 4}'


@pytest.mark.parametrize("printed, logged", [
    ("val_acc", "val_acc"), ("eval/f1 macro:5", "eval/f1 macro:5"), ("acc(%)", "acc_"), ("recall@1", "recall_1"),
    ("a//b", "a__b"), ("/abs", "_abs"), ("../up", "_.._up"), ("", "_"), ("..", "_.."), ("x" * 300, "x" * 250),
    ("peak_memory_bytes", "script/peak_memory_bytes"),  # batchsweep's own measurement keeps its name
])
def test_a_printed_metric_name_is_logged_under_one_that_mlflow_takes(printed, logged):
    from mlflow.utils.validation import _validate_metric_name

    from batchsweep.sweeps.launch.rows import parse_row

    renamed = {}
    assert parse_row(json.dumps({"epoch": 1, printed: 0.5}), renamed) == {"epoch": 1.0, logged: 0.5}
    assert renamed == ({} if printed == logged else {printed: logged})
    _validate_metric_name(logged)  # MLflow's own check, which raises on a name it refuses


def test_dry_run_prints_each_command_with_passwords_redacted(tmp_path):
    path = study_file(tmp_path, "script_dry", """[fixed]
db = "postgresql://me:s3cr3t@db.example/runs"
[grid]
physical_batch = [8, 16]
""", COMMAND + ', "--db", "{db}"]')
    proc = sweep(tmp_path, "--study", str(path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if str(LOOP) in line]
    assert len(lines) == 2 and "--batch-size 8 --accum 1 --lr 0.05 --seed 0 --epochs 10" in lines[0]
    assert "s3cr3t" not in proc.stdout and "postgresql://me:***@db.example/runs" in lines[0]


def test_a_scripts_recorded_settings_are_its_command_and_own_values_without_a_password(tmp_path):
    """What a resumed [program] study is held to (a change is refused: tests/test_sweeps.py): its command as
    written, its own [fixed] values, its grid and objective, and the fields no point sets; not the values a
    point sets, nor where it runs."""
    from batchsweep.sweeps.cli import build_invocation, parse_args
    from batchsweep.sweeps.stores.optuna_store import protocol

    path = study_file(tmp_path, "script_protocol", """[fixed]
db = "postgresql://me:s3cr3t@db.example/runs"
epochs = 3
[grid]
physical_batch = [8, 16]
""", COMMAND + ', "--db", "{db}"]')
    shared = protocol(build_invocation(parse_args(["--study", str(path), "--set", "data_dir=/elsewhere"])))
    assert shared["db"] == "postgresql://me:***@db.example/runs" and shared["epochs"] == "3"
    assert shared["program.command"].endswith(" --epochs {epochs} --db {db}") and "s3cr3t" not in str(shared)
    assert not {"physical_batch", "seed", "data_dir", "device"} & set(shared) and "base_lr" in shared
    assert shared["grid.physical_batch"] == "[8, 16]" and shared["search.metrics"] == "('val_acc',)"


@pytest.mark.slow
def test_scripts_on_postgresql_and_a_tracking_server_log_into_their_trials_runs(tmp_path, postgres):
    from mlflow import MlflowClient

    from tests.servers import mlflow_server

    path = study_file(tmp_path, "script_served", """workers = 2
[fixed]
epochs = 2
physical_batch = 16
[grid]
mode = ["ok", "mlflow"]
""", COMMAND + ', "--mode", "{mode}"]')
    server = postgres
    with mlflow_server(tmp_path) as tracking:
        proc = sweep(tmp_path, "--study", str(path), "--storage", server.url, "--tracking-uri", tracking,
                     "--no-report")
        assert proc.returncode == 0, proc.stderr
        trials = trials_of(server.url, "script_served")
        assert [t.state for t in trials] == [State.COMPLETE] * 2
        children, _ = child_runs(MlflowClient(tracking), "script_served")
        for run in children:  # JSON lines or the script's own MLflow calls over HTTP: the same run, once each
            assert run.info.status == "FINISHED"
            history = MlflowClient(tracking).get_metric_history(run.info.run_id, "val_acc")
            assert [m.step for m in history] == [1, 2]


LOADER_LOOP = (f'command = ["{{python}}", "{ROOT / "tests" / "programs" / "loader_loop.py"}", "--batch-size", '
               f'"{{physical_batch}}", "--accum", "{{accum_steps}}", "--lr", "{{lr}}", "--seed", "{{seed}}", '
               f'"--epochs", "{{epochs}}"')
LOADER_ENV = f'\nenv = {{PYTHONPATH = "{ROOT}"}}'  # (it loads the data as the trainer does: tests.factories)


@pytest.mark.parametrize("ignores", [False, True])
def test_a_script_is_recorded_as_it_ran_and_one_that_ignores_accum_steps_is_left_out(tmp_path, ignores):
    """The tracer inside the script sees its windows: an honest script's k = 4 trial carries
    observed_accum_steps 4 and a noise scale; one that takes --accum and steps per micro-batch anyway carries
    config_mismatch, is marked in the table, and the report leaves it out of every comparison and says why."""
    path = study_file(tmp_path, "honesty", """[fixed]
epochs = 2
physical_batch = 16
[grid]
accum_steps = [1, 4]
""", LOADER_LOOP + (', "--ignore-accum"]' if ignores else "]") + LOADER_ENV)
    proc = sweep(tmp_path, "--study", str(path))
    assert proc.returncode == 0, proc.stderr
    _, client = stores(tmp_path)
    runs, _ = child_runs(client, "honesty")
    by_k = {int(r.data.params["accum_steps"]): r for r in runs}
    assert set(by_k) == {1, 4}
    for k, run in by_k.items():
        tags = run.data.tags
        assert tags["observed_physical_batch"] == "16", tags
        assert tags["observed_accum_steps"] == str(1 if ignores else k)
        assert run.data.metrics["samples_per_s"] > 0
        assert ("config_mismatch" in tags) == (ignores and k == 4)
    # The noise scale needs windows of 2 micro-batches or more: the honest k = 4 trial's, not the one that ignored k.
    assert ("noise_scale" in by_k[4].data.metrics) == (not ignores)
    report = (tmp_path / "reports" / "honesty" / "report.md").read_text()
    if ignores:
        assert by_k[4].data.tags["config_mismatch"] == ("accum_steps 4 passed, 1 observed: the script does not "
                                                       "accumulate as asked")
        assert "config mismatch" in proc.stdout  # the results table marks the trial
        assert ("1 of 2 trials did not run as they were asked to (as batchsweep saw the script: accum_steps 4 "
                "passed, 1 observed") in report, report
    else:
        assert "did not run as they were asked to" not in report


def test_a_scripts_noise_scale_is_measured_from_inside_it(tmp_path):
    """A user's loop over a DataLoader, with the weights held still (lr 1e-9) at k = 16: the noise scale the
    tracer measures from each micro-batch's own gradient comes within a quarter of tr(Sigma) / |G|^2 from every
    sample's gradient, as the trainer's does (tests/test_trainer.py), and is logged as the trainer logs it."""
    from tests.factories import noise_truth

    path = study_file(tmp_path, "noisy", """[fixed]
epochs = 6
physical_batch = 4
accum_steps = 16
base_lr = 1e-9
lr_rule = "none"
""", LOADER_LOOP + "]" + LOADER_ENV)
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    _, client = stores(tmp_path)
    [run], _ = child_runs(client, "noisy")
    assert run.data.tags["observed_accum_steps"] == "16"
    assert run.data.metrics["noise_scale"] == pytest.approx(noise_truth("tests.factories:blobs1k", ""), rel=0.25)
    assert run.data.metrics["noise_scale_reliable"] == 1.0
