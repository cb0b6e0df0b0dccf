"""Fused trials in a study: a grid's group trains as one and each member is recorded as its solo trial is (in
float64 the same metrics, history, peak memory, params and tags), with the tag fused_members; --no-fuse trains
each alone; a member that the pruner stops ends alone; a killed group's members go on from their checkpoints."""

import optuna
import pytest

from tests.test_sweeps import child_runs, stores, sweep

GRID = """name = "accum_lr"
[grid]
physical_batch = [32]
accum_steps = [1, 2, 4]
lr_rule = ["none", "linear"]
"""
ARGS = ["--model", "tests.factories:bn_mlp", "--dataset", "tests.factories:blobs300", "--epochs", "2", "--seeds", "1",
        "--workers", "1", "--set", "warmup_epochs=0", "--set", "dtype=float64", "--log-models", "none",
        "--no-report"]
TIMES = {"epoch_time_s", "samples_per_s", "wall_time_s"}  # a fused member's are the group's, named so
RUN_OWN = {"mlflow.runName", "optuna.trial_number", "fused_members", "mlflow.source.git.commit"}


def run(folder, *extra, grid=GRID):
    folder.mkdir()
    (folder / "study.toml").write_text(grid)
    done = sweep(folder, "--study", str(folder / "study.toml"), *ARGS, *extra)
    assert done.returncode == 0, done.stderr
    return done


def recorded(folder):
    """Each finished trial's run by its point: params, final metrics, per-epoch history and tags."""
    _, client = stores(folder)
    children, _ = child_runs(client)
    runs = {}
    for r in children:
        if r.info.status != "FINISHED":  # (a killed invocation's)
            continue
        history = {m: [(h.step, h.value) for h in client.get_metric_history(r.info.run_id, m)]
                   for m in r.data.metrics}
        runs[(r.data.params["accum_steps"], r.data.params["lr_rule"])] = (r, history)
    return runs


def test_each_member_is_recorded_as_its_solo_trial_in_float64(tmp_path):
    run(tmp_path / "fused")
    run(tmp_path / "alone", "--no-fuse")
    fused, alone = recorded(tmp_path / "fused"), recorded(tmp_path / "alone")
    assert fused.keys() == alone.keys() and len(fused) == 6
    for point, (mine, my_history) in fused.items():
        theirs, their_history = alone[point]
        assert mine.data.params == theirs.data.params
        assert mine.info.status == theirs.info.status == "FINISHED"
        assert mine.data.tags["fused_members"] == "6" and "fused_members" not in theirs.data.tags
        assert {k: v for k, v in mine.data.tags.items() if k not in RUN_OWN and not k.startswith("mlflow.")} == \
            {k: v for k, v in theirs.data.tags.items() if k not in RUN_OWN and not k.startswith("mlflow.")}
        # Every metric, its history included, but the times: the group's time is no member's own.
        assert set(mine.data.metrics) == {f"group_{m}" if m in TIMES else m for m in theirs.data.metrics}
        same = set(theirs.data.metrics) - TIMES
        assert mine.data.metrics["peak_memory_bytes"] == theirs.data.metrics["peak_memory_bytes"]  # measured alone
        assert {m: mine.data.metrics[m] for m in same} == pytest.approx(
            {m: theirs.data.metrics[m] for m in same}, rel=1e-9, abs=1e-12)
        for m in same:
            assert [s for s, _ in my_history[m]] == [s for s, _ in their_history[m]], m
            assert [v for _, v in my_history[m]] == pytest.approx([v for _, v in their_history[m]], rel=1e-9,
                                                                  abs=1e-12), m


PRUNED = GRID.replace("[grid]", "[search]\npruner = \"median\"\n[grid]")


def test_a_member_that_the_pruner_stops_ends_alone_and_the_others_go_on(tmp_path):
    """Seed 0's group completes; the median pruner (after 3 complete trials, from epoch 2) then stops members of
    seed 1's group each at its own epoch, while the rest of its group trains on."""
    run(tmp_path / "s", "--epochs", "5", "--seeds", "2", grid=PRUNED)
    storage, client = stores(tmp_path / "s")
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    second = [t for t in trials if t.user_attrs["config"]["seed"] == 1]
    pruned = [t for t in second if t.state == optuna.trial.TrialState.PRUNED]
    assert len(second) == 6 and pruned
    runs = {r.info.run_id: r for r in child_runs(client)[0]}
    reached = {t.number: max(t.intermediate_values) for t in second}
    first_stop = min(reached[t.number] for t in pruned)
    assert max(reached.values()) > first_stop  # the others went on after the first member stopped
    for t in second:
        r = runs[t.user_attrs["mlflow_run_id"]]
        assert r.data.tags["fused_members"] == "6"
        assert [m.value for m in client.get_metric_history(r.info.run_id, "val_acc")] == \
            [t.intermediate_values[e] for e in sorted(t.intermediate_values)]  # its own rows, to where it stopped
        if t in pruned:
            assert r.info.status == "KILLED" and r.data.tags["reason"] == "pruned"
        else:
            assert t.state == optuna.trial.TrialState.COMPLETE and reached[t.number] == 5


@pytest.mark.slow
def test_a_killed_group_goes_on_from_its_members_checkpoints(tmp_path):
    """A sweep killed while its group evaluates epoch 2 (every member's epoch-1 checkpoint written): the same
    command again resumes the members fused from epoch 1, and each ends where an uninterrupted run's member ends."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT
    from tests.test_sweeps import held

    linear = ["--model", "tests.factories:holds", "--epochs", "3"]  # (after ARGS: these win)
    folder = tmp_path / "killed"
    folder.mkdir()
    (folder / "study.toml").write_text(GRID)
    (folder / "hold").touch()
    args = ["--study", str(folder / "study.toml"), *ARGS, *linear]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "BATCHSWEEP_TEST_HOLD": f"{folder / 'hold'}:2"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), *args], cwd=folder, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    held(folder / "hold", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = sweep(folder, *args)
    assert again.returncode == 0, again.stderr
    assert "study accum_lr: 6 trials left" in again.stderr
    whole = tmp_path / "whole"
    run(whole, *linear)
    resumed, straight = recorded(folder), recorded(whole)
    for point, (mine, _) in resumed.items():
        theirs, _ = straight[point]
        assert mine.data.tags["resumed_after_epoch"] == "1" and mine.data.tags["batchsweep.resumes_run"]
        assert mine.data.tags["fused_members"] == "6"
        assert mine.data.metrics["val_loss"] == pytest.approx(theirs.data.metrics["val_loss"], rel=1e-12)


def test_a_ctrl_c_in_a_group_ends_every_member_interrupted(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that a library caught and replaced lands in the group's third stacked forward: the study stops
    (130) and each member is recorded interrupted (its point runs again), its run KILLED."""
    from tests.test_sweep_outcomes import TINY, main_with_its_sigint_handler, runs_by_trial

    monkeypatch.chdir(tmp_path)
    assert main_with_its_sigint_handler([*TINY, "--model", "tests.factories:swallows_ctrl_c", "--n-trials", "3"]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    storage, client = stores(tmp_path)
    trials = optuna.load_study(study_name="accum_lr", storage=storage).trials
    assert len(trials) == 3
    assert all(t.state == optuna.trial.TrialState.FAIL and t.user_attrs["reason"] == "interrupted" for t in trials)
    for r in runs_by_trial(client, trials):
        assert (r.info.status, r.data.tags["reason"]) == ("KILLED", "interrupted")


def findings(folder) -> list[str]:
    """The sentences of a study's report under its findings headings, in order."""
    from tests.conftest import run_script

    proc = run_script("analysis/report.py", "--study", "accum_lr", "--tracking-uri",
                      f"sqlite:///{folder}/mlruns/mlflow.db", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    sentences, inside = [], False
    for line in (folder / "reports/accum_lr/report.md").read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith("## Findings")
        elif inside and line.startswith("- "):
            sentences.append(line[2:])
    return sentences


@pytest.mark.slow
def test_the_default_studys_report_says_the_same_fused_as_alone(tmp_path):
    """accum_lr's grid at a tiny size (mlp on 1,000 blobs, 2 seeds, 2 epochs, float64), run fused and with
    --no-fuse: its report's findings are the same sentences, figures included (a member's metrics are its solo
    trial's). Time to a target is the one thing a fused run does not measure per trial: its sentence is left out
    there, not worded from the group's time."""
    args = ["--model", "mlp", "--dataset", "tests.factories:blobs1k", "--epochs", "2", "--seeds", "2", "--workers",
            "1", "--set", "warmup_epochs=0", "--set", "dtype=float64", "--log-models", "none", "--no-report"]
    for name, extra in (("fused", []), ("alone", ["--no-fuse"])):
        (tmp_path / name).mkdir()
        done = sweep(tmp_path / name, "--study", "accum_lr", *args, *extra)
        assert done.returncode == 0, done.stderr
    fused, alone = findings(tmp_path / "fused"), findings(tmp_path / "alone")
    timed = [s for s in alone if "time to the target" in s or "fastest" in s or "shortest" in s]
    assert len(fused) > 5 and fused == [s for s in alone if s not in timed], (fused, alone)


def test_a_samplers_trials_are_asked_four_at_a_time_and_train_fused(tmp_path):
    """TPE over the base LR of one grid point: its 6 trials are asked as groups of at most 4 (its random start-up
    first), each group trained as one, every trial its own and complete."""
    run(tmp_path / "tpe", grid="""name = "accum_lr"
[grid]
physical_batch = [32]
accum_steps = [2]
[tune.base_lr]
type = "float"
low = 1e-3
high = 0.5
log = true
[search]
sampler = "tpe"
trials = 6
""")
    storage, client = stores(tmp_path / "tpe")
    (name,) = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name.startswith("accum_lr/")]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    assert len({t.params["base_lr"] for t in trials}) == 6
    runs = {r.info.run_id: r for r in child_runs(client)[0]}
    assert [runs[t.user_attrs["mlflow_run_id"]].data.tags["fused_members"] for t in trials] == ["4"] * 4 + ["2"] * 2


@pytest.mark.slow
def test_two_workers_share_a_fused_grid_and_cover_it_once(tmp_path):
    """12 points of one group and 2 workers: each worker takes at most its share (6) at a time, so the other is
    left points to train; every point once, complete, and fused (the study's last point may train alone: a share of
    one is a trial alone, with no `fused_members` tag)."""
    from tests.test_sweeps import SMALL, grid_trials
    from batchsweep.sweeps.study.spec import config_key

    (tmp_path / "small.toml").write_text(SMALL)
    done = sweep(tmp_path, "--study", str(tmp_path / "small.toml"), "--model", "mlp", "--dataset",
                 "tests.factories:blobs1k", "--epochs", "2", "--seeds", "1", "--workers", "2", "--set",
                 "warmup_epochs=0", "--log-models", "none", "--no-report", process=True)
    assert done.returncode == 0, done.stderr
    storage, client = stores(tmp_path)
    trials = grid_trials(storage)
    assert len({config_key(t.user_attrs["config"]) for t in trials}) == len(trials) == 12
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    sizes = [int(r.data.tags.get("fused_members", 1)) for r in child_runs(client)[0]]
    # (which worker trains which points depends on when the second starts: the share caps a group whatever it is)
    assert len(sizes) == 12 and 2 <= max(sizes) <= 6


def test_a_study_that_measures_each_trials_time_trains_it_alone(tmp_path):
    """batch_memory measures samples/s per trial: its file says fuse = false, and a study file that says so trains
    each trial alone, with its own time."""
    from batchsweep.sweeps.study.files import load

    assert load("batch_memory").fuse is False and load("accum_lr").fuse is True
    run(tmp_path / "alone", grid=GRID.replace("[grid]", "[search]\nfuse = false\n[grid]"))
    for r, _ in recorded(tmp_path / "alone").values():
        assert "fused_members" not in r.data.tags and "samples_per_s" in r.data.metrics


def test_each_member_holds_its_groups_system_metrics(tmp_path, monkeypatch):
    """With --system-metrics, one monitor samples while the group trains and each member's run holds its samples
    (the same steps and values in every member's), tagged as the group's."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.01")  # (the group trains for far longer)
    run(tmp_path / "s", "--system-metrics", "--epochs", "5")
    _, client = stores(tmp_path / "s")
    samples = []
    for r, _ in recorded(tmp_path / "s").values():
        assert r.data.tags["fused_members"] == "6" and r.data.tags["system_metrics_of"] == "group"
        assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(r.data.metrics)
        history = client.get_metric_history(r.info.run_id, "system/cpu_utilization_percentage")
        samples.append([(m.step, m.value, m.timestamp) for m in history])
    assert len(samples) == 6 and samples[0] and all(s == samples[0] for s in samples)
    assert sorted(step for step, _, _ in samples[0]) == list(range(len(samples[0])))  # each sample once
