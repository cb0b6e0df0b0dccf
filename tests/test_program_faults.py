"""[program] trials under faults a user's script brings: rows that are no numbers or out of order, a failed
script's measurements, processes that outlive their script, and trials that write the same file."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from tests.test_programs import State, child_runs, gone, held, stores, study_file, sweep, trials_of

ROWS = ROOT / "tests" / "programs" / "rows.py"
DAEMON = ROOT / "tests" / "programs" / "daemon.py"
CLASH = ROOT / "tests" / "programs" / "clash.py"
RUDE = ROOT / "tests" / "programs" / "rude.py"


def test_an_objective_row_that_is_no_number_or_out_of_order_is_a_warning(tmp_path):
    """A val_acc printed as text is not dropped without a word, and a row that is not the last whole epoch's never
    becomes the objective: not an earlier epoch printed last, not a row within an epoch at its step, not a row
    without an epoch. Optuna's value is the value MLflow shows as the run's latest, and its history's last."""
    path = study_file(tmp_path, "rows", '[grid]\nmode = ["string", "backwards", "mixed", "unplaced"]',
                      f'command = ["{{python}}", "{ROWS}", "{{mode}}"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = {t.user_attrs["config"]["mode"]: t for t in trials_of(storage, "rows")}
    runs = {r.data.params["mode"]: r for r in child_runs(client, "rows")[0]}

    def history(mode, name="val_acc"):
        return [(m.step, m.value) for m in client.get_metric_history(runs[mode].info.run_id, name)]

    def warnings(mode):  # (but the last: the tracer saw no optimizer step, in a script without torch)
        return runs[mode].data.tags["warnings"].split(" | ")[:-1]

    assert trials["string"].state == State.COMPLETE and trials["string"].value == pytest.approx(0.6)
    assert warnings("string")[0] == (
        "the script printed val_acc as '0.9', not a number, in the row " + json.dumps({"epoch": 3, "val_acc": "0.9"})
        + ": it is not logged; print val_acc as a number")
    for mode, value in (("backwards", 0.1), ("mixed", 0.7), ("unplaced", 0.7)):
        assert trials[mode].state == State.COMPLETE, mode
        assert trials[mode].value == pytest.approx(value) == runs[mode].data.metrics["val_acc"], mode
        assert history(mode)[-1] == (max(step for step, _ in history(mode)), pytest.approx(value)), mode
    assert history("backwards") == [(1, 0.2), (3, 0.1)]
    assert warnings("backwards") == [
        'the script printed epoch 2.5 after epoch 3 (the row {"epoch": 2.5, "val_acc": 0.4}): a metric\'s final '
        "value is its value at the latest epoch",
        'the script printed val_acc in a row with epoch 2.5 without a step ({"epoch": 2.5, "val_acc": 0.4}), where '
        "other rows give it at epochs: it cannot be placed among them, so it is kept in log.txt only and is not the "
        "final value; print its epoch (or step) in the row, or give it a name of its own"]
    # Within epochs, at their steps: step_val_acc, as the trainer logs its evaluations within epochs.
    assert history("mixed") == [(1, 0.5), (2, 0.7)] and history("mixed", "step_val_acc") == [(150, 0.6), (250, 0.8)]
    assert warnings("mixed") == [
        'the script printed val_acc at step 150 between whole epochs ({"epoch": 1.5, "step": 150, "val_acc": 0.6}): '
        "logged as step_val_acc at its step, while val_acc holds its value at each whole epoch (1 more row like it)"]
    assert history("unplaced") == [(1, 0.5), (2, 0.7)]
    assert warnings("unplaced") == [
        'the script printed epoch as \'3\', not a number, in the row {"epoch": "3", "val_acc": 0.95}: it is not '
        "logged; print epoch as a number",
        'the script printed val_acc in a row with neither epoch nor step ({"val_acc": 0.9}), where other rows give it '
        "at epochs: it cannot be placed among them, so it is kept in log.txt only and is not the final value; print "
        "its epoch (or step) in the row, or give it a name of its own (1 more row like it)"]


def test_the_pruner_is_given_each_row_where_the_run_logs_it(tmp_path):
    """Rows within epochs at their step, as the run logs them: at int(epoch) they were a second value at epoch 1 and
    2, which Optuna ignores."""
    path = study_file(tmp_path, "pruned_rows", '[grid]\nmode = ["mixed"]\n[search]\npruner = "median"',
                      f'command = ["{{python}}", "{ROWS}", "{{mode}}"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    [trial] = trials_of(stores(tmp_path)[0], "pruned_rows")
    assert trial.intermediate_values == {1: 0.5, 150: 0.6, 2: 0.7, 250: 0.8}


def test_rows_are_placed_each_metric_on_one_scale():
    """Units of place(): a metric at steps alone is logged at its steps, a value printed once without either is
    final, the later of two rows at one epoch is logged (MLflow's latest at one step would be the larger)."""
    from batchsweep.sweeps.launch.rows import place

    placed = place([{"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}, {"epoch": 1, "val_acc": 0.6},
                    {"epoch": 1, "val_acc": 0.5}, {"test_acc": 0.4}, {"step": 30, "loss": 1.0}])
    assert placed.history == [{"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}, {"epoch": 1, "val_acc": 0.5},
                              {"step": 30, "loss": 1.0}]
    assert placed.final == {"loss": 1.0, "val_acc": 0.5, "test_acc": 0.4}
    assert placed.notes == ['the script printed val_acc twice at epoch 1 ({"epoch": 1, "val_acc": 0.5}): the later '
                            "value is logged"]


def test_a_failed_trial_keeps_what_was_measured_of_it(tmp_path):
    """A script that exits 1, and one that exits 0 without the objective's metric (MetricMissing): both runs
    carry the exit status, the wall time and the peak memory, as a complete trial's do."""
    path = study_file(tmp_path, "failed", '[grid]\nmode = ["fail", "backwards"]\n[objective]\nmetrics = ["loss"]',
                      f'command = ["{{python}}", "{ROWS}", "{{mode}}"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 1, proc.stderr  # every trial failed
    storage, client = stores(tmp_path)
    runs = {r.data.params["mode"]: r for r in child_runs(client, "failed")[0]}
    assert runs["fail"].data.tags["error"] == "ScriptFailed: the script ended with exit status 1: the data is gone"
    assert runs["backwards"].data.tags["error"].startswith("MetricMissing: the objective's metric 'loss' was not "
                                                           "logged; this trial logged peak_memory_bytes, val_acc, "
                                                           "wall_time_s")
    for mode, status in (("fail", "1"), ("backwards", "0")):
        run = runs[mode]
        assert run.info.status == "FAILED" and run.data.tags["reason"] == "error"
        assert run.data.tags["exit_status"] == status and run.data.tags["memory_source"] == "rss"
        assert run.data.metrics["wall_time_s"] > 0 and run.data.metrics["peak_memory_bytes"] > 2 ** 20
    assert [t.state for t in trials_of(storage, "failed")] == [State.FAIL] * 2


@pytest.mark.slow
def test_no_process_a_script_double_forks_outlives_its_trial(tmp_path):
    """Each trial's script leaves a daemon in a session of its own (double fork, setsid): the worker, the reaper of
    its descendants, finds it and stops it at the trial's end, and the run says so."""
    path = study_file(tmp_path, "daemons", "workers = 2\n[grid]\nn = [1, 2]",
                      f'command = ["{{python}}", "{DAEMON}", "{tmp_path}/daemon-{{n}}"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    pids = {n: int((tmp_path / f"daemon-{n}").read_text()) for n in ("1", "2")}
    assert all(gone(pid) for pid in pids.values())
    storage, client = stores(tmp_path)
    assert [t.state for t in trials_of(storage, "daemons")] == [State.COMPLETE] * 2
    for run in child_runs(client, "daemons")[0]:
        pid = pids[run.data.params["n"]]
        assert run.data.tags["warnings"].split(" | ")[0] == (
            f"the script left 1 process running outside its process group ({pid} (sleep)): stopped at the trial's end")
        assert "processes_left" not in run.data.tags


def started(folder: Path, path: Path) -> subprocess.Popen:
    """A study run as a user runs it, in a process of its own that a test can kill."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), "--study", str(path), "--no-report"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_daemon_outlives_no_worker_killed_under_it(tmp_path):
    """A worker is SIGKILLed while its script holds: the daemon the script double-forked (re-parented to the worker,
    its reaper, then away from it) carries the worker's token in its environment, and the main process, seeing the
    worker end, stops it and says so. Each step waits on a condition: the script's pid file (written once its
    daemon is up), the worker's end, the daemon's end (bounded)."""
    hold = tmp_path / "hold"
    path = study_file(tmp_path, "orphans", f'workers = 2\n[grid]\n"n+hold" = [[1, "{hold}"], [2, "{tmp_path}"]]',
                      f'command = ["{{python}}", "{DAEMON}", "{tmp_path}/daemon-{{n}}", "{{hold}}"]')
    proc, daemon = started(tmp_path, path), None
    try:
        script = held(hold, proc)[0]  # (its daemon is up: the script waited for its pid file)
        daemon = int((tmp_path / "daemon-1").read_text())
        worker = psutil.Process(script).ppid()
        assert psutil.Process(worker).ppid() == proc.pid and psutil.Process(daemon).ppid() == worker
        os.kill(worker, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(worker)], timeout=60)  # (the main process reaps it)
        deadline = time.monotonic() + 60
        while not gone(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(daemon)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        if daemon and not gone(daemon):
            os.kill(daemon, signal.SIGKILL)
    assert re.search(rf"warning: worker \d ended leaving \d process(es)? that its trials started running "
                     rf"\((.*, )?{daemon} \(sleep\)(, .*)?\): stopped\n", err), err
    assert "warning: worker " in err and "was killed by SIGKILL" in err, err


@pytest.mark.slow
def test_a_daemon_left_by_a_killed_invocation_is_stopped_by_the_next(tmp_path):
    """One worker, the main process itself, SIGKILLed while its script holds: nothing outlives it to look, so the
    next invocation stops the daemon, which carries the killed invocation's token, and says so."""
    hold = tmp_path / "hold"
    path = study_file(tmp_path, "orphan", "",
                      f'command = ["{{python}}", "{DAEMON}", "{tmp_path}/daemon", "{hold}"]')
    proc, daemon = started(tmp_path, path), None
    try:
        script = held(hold, proc)[0]
        daemon = int((tmp_path / "daemon").read_text())
        assert psutil.Process(script).ppid() == proc.pid == psutil.Process(daemon).ppid()
        proc.kill()
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 60  # (the kernel sends the script SIGTERM as its parent dies)
        while not gone(script) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(script) and not gone(daemon)  # (re-parented away from the killed invocation)
        rerun = sweep(tmp_path, "--study", str(path), "--no-report")
        stopped = gone(daemon)
    finally:
        if proc.poll() is None:
            proc.kill()
        if daemon and not gone(daemon):
            os.kill(daemon, signal.SIGKILL)
    assert rerun.returncode == 0, rerun.stderr
    assert stopped and re.search(rf"warning: an invocation of this study that was killed had left \d+ "
                                 rf"process(es)? that its trials started running \((.*, )?{daemon} \(sleep\)"
                                 rf"(, .*)?\): stopped\n", rerun.stderr), rerun.stderr


@pytest.mark.slow
def test_trials_that_write_one_file_at_once_are_marked_and_left_out(tmp_path):
    """Trials 1 and 2 write ./checkpoint.txt while both run (each waits for the other's write before it reads the
    file back): both are marked clash, left out of the report's comparisons, and the end of the study names the
    file and the fix. Trial 3 writes into its own folder ({trial_dir}) and completes."""
    events = tmp_path / "events"
    events.mkdir()
    path = study_file(tmp_path, "clashing", 'workers = 2\n[grid]\n"value+shared" = [[1, true], [2, true], [3, false]]',
                      f'command = ["{{python}}", "{CLASH}", "{{value}}", "{events}", "{{shared}}", "{{trial_dir}}"]')
    proc = sweep(tmp_path, "--study", str(path))
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = {t.user_attrs["config"]["value"]: t for t in trials_of(storage, "clashing")}
    runs = {r.data.params["value"]: r for r in child_runs(client, "clashing")[0]}
    checkpoint = tmp_path / "checkpoint.txt"
    for mine, other in ((1, 2), (2, 1)):
        t, run = trials[mine], runs[str(mine)]
        assert t.state == State.FAIL and t.user_attrs["reason"] == "clash"
        assert run.info.status == "FAILED" and run.data.tags["reason"] == "clash"
        assert run.data.tags["clash"] == f"trial {trials[other].number} wrote {checkpoint} too while both ran"
        assert run.data.tags["error"].startswith(f"Clash: trial {trials[other].number} wrote {checkpoint} too")
    assert trials[3].state == State.COMPLETE and trials[3].value == pytest.approx(0.3)
    own = tmp_path / "mlruns" / "trials" / "clashing" / str(trials[3].number)
    assert (own / "checkpoint.txt").read_text() == "3" and "clash" not in runs["3"].data.tags
    assert "warning: 2 trials wrote a file that another trial wrote while both ran (trial " in proc.stderr
    assert "write it under {trial_dir} (in the command) or $BATCHSWEEP_TRIAL_DIR" in proc.stderr
    report = (tmp_path / "reports" / "clashing" / "report.md").read_text()
    assert "2 of 3 trials did not finish (2 clash); they are left out of the figures" in report


def test_a_cwd_of_trial_dir_runs_each_trial_in_its_own_folder(tmp_path):
    """cwd = "{trial_dir}" is filled as the command is: two trials that write ./checkpoint.txt at once (each waits
    for the other's write before it reads the file back) write one each, and neither is a clash."""
    events = tmp_path / "events"
    events.mkdir()
    path = study_file(tmp_path, "own_cwd", 'workers = 2\n[grid]\n"value+shared" = [[1, true], [2, true]]',
                      f'command = ["{{python}}", "{CLASH}", "{{value}}", "{events}", "{{shared}}", "{{trial_dir}}"]\n'
                      f'cwd = "{{trial_dir}}"')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    trials = {t.user_attrs["config"]["value"]: t for t in trials_of(storage, "own_cwd")}
    for value, t in trials.items():
        assert t.state == State.COMPLETE and t.value == pytest.approx(value / 10)
        own = tmp_path / "mlruns" / "trials" / "own_cwd" / str(t.number)
        assert (own / "checkpoint.txt").read_text() == str(value)
    assert sorted(trials) == [1, 2] and not (tmp_path / "checkpoint.txt").exists() and "clash" not in proc.stderr


def test_a_cwd_of_each_trials_own_with_a_script_beside_the_study_file_is_one_line(tmp_path):
    """The script named relative to the study file's folder would not be found in each trial's (new) folder."""
    (tmp_path / "train.py").write_text("")
    path = study_file(tmp_path, "moved", "", 'command = ["{python}", "train.py"]\ncwd = "{trial_dir}"')
    proc = sweep(tmp_path, "--study", str(path), "--dry-run")
    assert proc.returncode == 2 and proc.stderr == (
        f"error: {path}: program.cwd: each trial runs in {{trial_dir}}, where 'train.py' (a file in {tmp_path}) is "
        f"not: give its path from / in the command ({tmp_path / 'train.py'})\n"), proc.stderr


@pytest.mark.parametrize("body, arg, expected", [
    ("", "{accum_steps:03d}", "'{accum_steps:03d}' is no placeholder: a placeholder takes no format spec or "
     "conversion (':03d'): write {accum_steps}, which passes the value as it is, or give the value formatted so as a "
     "field of your own ([fixed] or [grid]); a literal brace is {{ or }}"),
    ("[fixed]\nrun = 3", "--name=r{run!r}", "'{run!r}' is no placeholder: a placeholder takes no format spec or "
     "conversion ('!r'): write {run}, which passes"),
    ("", "{x:03d}", "'{x:03d}' is no placeholder: a placeholder takes no format spec or conversion (':03d'): give the "
     "value formatted so as a field of your own ([fixed] or [grid]); a literal brace is {{ or }}"),  # (no {x})
    ("", "{accum steps}", "'{accum steps}' is no placeholder: write a placeholder as {name}, without spaces "
     "({accum_steps}), and a literal brace as {{ or }}"),  # (not {accumsteps})
])
def test_a_malformed_placeholder_is_one_line_that_suggests_one_that_exists(tmp_path, body, arg, expected):
    path = study_file(tmp_path, "spec", body, f'command = ["{{python}}", "t.py", "{arg}"]')
    (tmp_path / "t.py").write_text("")
    for dry in ([], ["--dry-run"]):
        proc = sweep(tmp_path, "--study", str(path), *dry)
        assert proc.returncode == 2 and proc.stderr.startswith(f"error: {path}: program.command: {expected}"), \
            proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "mlruns").exists()


def test_bytes_that_are_no_utf8_a_line_of_10_mb_and_a_read_of_stdin_pass(tmp_path):
    """Bytes that are no UTF-8 are shown as U+FFFD and a 10 MB line is kept whole in log.txt; a script that reads
    its standard input gets /dev/null (an end at once), not the terminal's, and does not hang."""
    path = study_file(tmp_path, "rude", '[grid]\nmode = ["bytes", "stdin"]',
                      f'command = ["{{python}}", "{RUDE}", "{{mode}}"]')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 0, proc.stderr
    storage, client = stores(tmp_path)
    assert [t.state for t in trials_of(storage, "rude")] == [State.COMPLETE] * 2
    runs = {r.data.params["mode"]: r for r in child_runs(client, "rude")[0]}
    log = Path(client.download_artifacts(runs["bytes"].info.run_id, "log.txt", str(tmp_path))).read_text()
    assert log.splitlines()[:2] == ["caf\ufffd \ufffd\ufffd not UTF-8", "x" * 10 * 2 ** 20]
    assert runs["bytes"].data.metrics["val_acc"] == 0.5
    assert runs["stdin"].data.metrics["stdin_bytes"] == 0


@pytest.mark.slow
def test_a_script_that_ignores_sigterm_is_killed_past_its_time_with_its_child(tmp_path):
    pids = tmp_path / "pids"
    path = study_file(tmp_path, "deaf", "", f'command = ["{{python}}", "{RUDE}", "deaf", "{pids}"]\n'
                                            f'timeout_minutes = 0.2')
    proc = sweep(tmp_path, "--study", str(path), "--no-report")
    assert proc.returncode == 1  # its only trial failed
    storage, client = stores(tmp_path)
    [trial] = trials_of(storage, "deaf")
    assert trial.state == State.FAIL and trial.user_attrs["reason"] == "error"
    [run], parents = child_runs(client, "deaf")
    assert run.info.status == "FAILED" and all(p.info.status == "FINISHED" for p in parents)
    assert run.data.tags["error"] == "ScriptFailed: timeout: ran past timeout_minutes = 0.2 and was stopped"
    assert all(gone(int(pid)) for pid in pids.read_text().split())
    # SIGTERM did not stop it: SIGKILL did, GRACE_S (10 s) after the timeout (12 s).
    assert run.data.tags["exit_status"] == "-9" and run.data.metrics["wall_time_s"] >= 22


def test_dry_run_shows_where_each_trial_has_its_own_folder(tmp_path):
    path = study_file(tmp_path, "places", '[grid]\nn = [1, 2]', 'command = ["{python}", "t.py", "--out", "{trial_dir}"]')
    (tmp_path / "t.py").write_text("")
    proc = sweep(tmp_path, "--study", str(path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    folder = tmp_path / "mlruns" / "trials" / "places"
    assert proc.stdout.count(f"t.py --out '{folder}/<trial number>'") == 2


def test_a_first_word_made_of_a_trials_values_is_checked_when_it_runs(tmp_path):
    path = study_file(tmp_path, "first_word", '[fixed]\ninterpreter = "python3"',
                      'command = ["{interpreter}", "t.py", "--out", "{trial_dir}"]')
    proc = sweep(tmp_path, "--study", str(path), "--dry-run")
    assert proc.returncode == 0 and "python3 t.py --out " in proc.stdout, proc.stderr


def test_the_files_a_script_saves_are_seen_however_it_writes_them(tmp_path):
    """torch.save to a path writes through its own C++ writer (open() never sees it), and an atomic save renames a
    temporary file onto the name: both are files another trial could read back. /dev/null is no such file."""
    from batchsweep.sweeps.launch import observed

    script = tmp_path / "saves.py"
    script.write_text("""import os, tempfile, torch
torch.save({"v": 1}, "ckpt.pt")
fd, tmp = tempfile.mkstemp(dir=".")
os.write(fd, b"2"); os.close(fd)
os.replace(tmp, "atomic.txt")
with open(os.devnull, "w") as f:
    print("quiet", file=f)
""")
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **observed.environment(trace)}
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, check=True)
    [log] = trace.glob("writes-*.txt")
    written = set(log.read_text().splitlines())
    assert {str(tmp_path / "ckpt.pt"), str(tmp_path / "atomic.txt")} <= written, written
    assert not [p for p in written if p.startswith("/dev/")], written


def test_an_epoch_or_step_that_is_no_finite_number_is_a_warning_not_a_failed_trial():
    """JSON's NaN and Infinity parse as numbers, and an MLflow step of them failed the whole trial (int(nan))."""
    from batchsweep.sweeps.launch.rows import Output

    output = Output(watched=("val_acc",))
    output.row('{"epoch": 1, "val_acc": 0.5}')
    assert output.row('{"epoch": NaN, "val_acc": 0.7}') == {"val_acc": 0.7}  # (no step: not logged as a row)
    assert output.row('{"step": Infinity, "loss": 2.0}') == {"loss": 2.0}
    notes = output.notes()
    assert notes[0].startswith("the script printed epoch as nan, not a finite number, in the row ") and \
        notes[0].endswith(": it is not logged; print epoch as a number"), notes
    assert notes[1].startswith("the script printed step as inf, not a finite number"), notes
