"""Data-parallel trials under torchrun (gloo, 2 ranks on the CPU) and micro-batches that shrink on
out-of-memory."""
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from batchsweep.trainers import ConfigError, TrainConfig, train

from .conftest import ROOT, run_script
from .test_shapes import SHAPED
from .test_workloads import TOKENS, rel_diff


def torchrun(tmp_path, jobs: list[dict]) -> list[dict]:
    """The jobs trained by 2 ranks in one torchrun launch; rank 0's results."""
    out = tmp_path / "results.pt"
    # (--standalone: a free port of its own; the default 29500 is taken by another test's launch run beside it)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "elastic"),  # (not a folder left in /tmp each launch)
                           str(ROOT / "tests/ddp_train.py"), json.dumps(jobs), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return torch.load(out, weights_only=True)


def model_of(config: TrainConfig, state: dict) -> torch.nn.Module:
    from batchsweep.trainers.loop import prepare

    model = prepare(replace(config, world_size=1, physical_batch=1, accum_steps=1)).model
    model.load_state_dict(state)
    return model


def windows_and_micro_batches(n: int, B: int, b: int, world: int) -> tuple[int, int]:
    """Optimizer steps per epoch, and the micro-batches one rank (rank 0, the larger shard) runs."""
    sizes = [B] * (n // B) + ([n % B] if n % B else [])
    return len(sizes), sum(max(1, -(-(-(-size // world)) // b)) for size in sizes)


@pytest.mark.slow
def test_data_parallel_equals_one_process_and_syncs_once_per_window(tmp_path, data_dir):
    mlp = dict(model="mlp", dataset="mnist1d", data_dir=data_dir, dtype="float64", device="cpu", epochs=1,
               physical_batch=16, accum_steps=4, world_size=2)
    gpt = {**TOKENS, "device": "cpu", "physical_batch": 2, "accum_steps": 3, "world_size": 2}
    jobs = [
        # MNIST-1D's 4,000 samples at B = 16 x 4 x 2 = 128: 31 full windows and one of 32.
        {"config": mlp, "no_sync": True},
        {"config": mlp, "no_sync": False},  # the control: an all-reduce after every micro-batch
        # Tokens, unequal per micro-batch; at B = 12 the last window of 53 holds 5: shards of 3 and 2,
        # two micro-batches on rank 0 and one on rank 1.
        {"config": {**gpt, "dataset": "tests.factories:tokens53"}, "no_sync": True},
        # Through the DataLoader path, where each rank counts the tokens of its own shard and the counts are
        # summed over the ranks; the last window of 49 holds one sequence, and rank 1's shard is empty.
        {"config": {**gpt, "dataset": "tests.factories:tokens49_read"}, "no_sync": True},
        {"config": {**gpt, "dataset": "tests.factories:tokens49"}, "no_sync": True},  # the same, in memory
        # A loss without counts(): each rank backwards its sums, and the gradients are divided by the window's
        # count summed over the ranks.
        {"config": {**gpt, "dataset": "tests.factories:tokens53", "loss": "tests.factories:tokens_without_counts"},
         "no_sync": True},
        # Mapping samples padded per micro-batch, a keyword model with `.logits`, the same kind of loss.
        {"config": {**SHAPED, "device": "cpu", "physical_batch": 2, "accum_steps": 3, "world_size": 2},
         "no_sync": True},
    ]
    results = torchrun(tmp_path, jobs)
    singles = [replace(TrainConfig(**job["config"]), world_size=1, physical_batch=12 if i > 1 else 128,
                       accum_steps=1) for i, job in enumerate(jobs)]
    singles[3] = replace(singles[3], dataset="tests.factories:tokens49")  # (the same rows, as tensors)
    for job, single, result in zip(jobs, singles, results):
        one = train(single)
        parallel = model_of(single, result["state"])
        assert rel_diff(parallel, one.model) <= 1e-12, job
        assert result["metrics"]["train_loss"] == pytest.approx(one.metrics["train_loss"], rel=1e-12)
        assert result["metrics"]["val_loss"] == pytest.approx(one.metrics["val_loss"], rel=1e-12)

    steps, micro = windows_and_micro_batches(4000, 128, 16, 2)
    assert (steps, micro) == (32, 125)
    synced_once, synced_always = results[0]["metrics"], results[1]["metrics"]
    assert synced_once["steps"] == steps
    # One bucket for this small net: one all-reduce per window; without no_sync, one per micro-batch.
    assert synced_once["allreduce_calls"] == steps
    assert synced_always["allreduce_calls"] == micro
    assert synced_always["allreduce_bytes"] / synced_once["allreduce_bytes"] == pytest.approx(micro / steps)


def test_a_world_size_that_is_not_the_processes_is_refused(data_dir, monkeypatch):
    with pytest.raises(ConfigError, match="world_size is 2 but 1 processes run"):
        train(TrainConfig(model="mlp", data_dir=data_dir, world_size=2, epochs=1))
    done = run_script("trainers/train.py", "--model", "mlp", "--data-dir", data_dir, "--world-size", "2",
                      "--epochs", "1")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: world_size is 2 but 1 processes run: start `torchrun --nproc-per-node 2 trainers/train.py ...`, "
        "or set world_size to the number of processes"]
    from batchsweep.trainers.distributed import check_launch

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    with pytest.raises(ConfigError, match="--sync-bn needs GPUs"):
        check_launch(TrainConfig(world_size=2, sync_bn=True, device="cpu"))
    check_launch(TrainConfig(world_size=2))


SHRINK = dict(model="tests.factories:fits_16", dataset="mnist1d", dtype="float64", device="cpu", epochs=2,
              schedule="cosine", warmup_epochs=0.5, optimizer="sgd", momentum=0.9)


def test_micro_batches_shrink_on_out_of_memory_to_what_fits(data_dir):
    # The model runs out of memory above 16 samples per micro-batch: from b = 64 at B = 64 it shrinks twice
    # (64, 32 fail; 16 fits) in the first window, never grows back, and ends where (16, 4) from the start ends.
    auto = train(TrainConfig(**SHRINK, data_dir=data_dir, physical_batch=64, accum_steps=1, shrink_on_oom=True))
    direct = train(TrainConfig(**SHRINK, data_dir=data_dir, physical_batch=16, accum_steps=4))
    assert (auto.metrics["physical_batch_used"], auto.metrics["oom_retries"]) == (16, 2)
    assert [(r["oom_retries"], r["oom_physical_batch"]) for r in auto.history] == [(2, 32), (2, 32)]
    assert rel_diff(auto.model, direct.model) == 0.0
    assert auto.metrics["train_loss"] == direct.metrics["train_loss"]
    assert auto.metrics["val_acc"] == direct.metrics["val_acc"]


@pytest.mark.slow
def test_physical_batch_auto_on_the_command_line(data_dir, tmp_path):
    done = run_script("trainers/train.py", "--model", "tests.factories:fits_16", "--data-dir", data_dir,
                      "--physical-batch", "auto", "--effective-batch", "48", "--epochs", "1", "--max-steps", "3")
    assert done.returncode == 0, done.stderr
    assert re.search(r"shrunk on out-of-memory +b = 12 after 2 retries", done.stdout)  # 48 -> 24 -> 12
    assert "48 x 1 = 48" in done.stdout
    without = run_script("trainers/train.py", "--model", "tests.factories:fits_16", "--data-dir", data_dir,
                         "--physical-batch", "32", "--epochs", "1")
    assert without.returncode == 3
    assert without.stderr.strip().splitlines()[-1].startswith("error: out of memory: lower --physical-batch")
    for args, message in [(["--physical-batch", "auto"], "--physical-batch auto needs the target"),
                          (["--physical-batch", "16", "--effective-batch", "40"], "is not a multiple of"),
                          (["--effective-batch", "64", "--accum-steps", "2"], "leave out --accum-steps")]:
        bad = run_script("trainers/train.py", "--data-dir", data_dir, *args)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr


DDP_STUDY = """name = "ddp"
launcher = "torchrun"
[fixed]
model = "tests.factories:holds"
dataset = "tests.factories:blobs1k"
epochs = 3
world_size = 2
device = "cpu"
schedule = "cosine"
[grid]
"physical_batch+accum_steps" = [[16, 2], [8, 4], [1024, 4]]
"""


@pytest.mark.slow
def test_a_torchrun_study_killed_mid_trial_resumes_without_losing_or_repeating_a_point(tmp_path):
    import time

    from mlflow import MlflowClient

    (tmp_path / "study.toml").write_text(DDP_STUDY)
    command = [sys.executable, str(ROOT / "sweeps/run.py"), "--study", "study.toml", "--no-report"]
    hold = tmp_path / "hold"
    hold.touch()
    # The first trial's job holds at its second evaluation, its first epoch checkpointed; the sweep is then
    # killed (SIGKILL, no chance to clean up).
    temp = tmp_path / "temp"  # the system's temporary folder, as the sweep and its jobs see it
    temp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BATCHSWEEP_TEST_HOLD": f"{hold}:2", "TMPDIR": str(temp)}
    sweep = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (tmp_path / "hold.held").exists():
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
        time.sleep(0.05)
    sweep.kill()
    sweep.communicate()
    # The job's ranks get SIGTERM when the worker that launched them dies: they are gone soon (a bound, not a
    # window: on a loaded machine they take longer, and the test waits for them).
    deadline = time.monotonic() + 60
    while (leftover := subprocess.run(["pgrep", "-f", f"trainers/train.py.*{tmp_path}"], capture_output=True,
                                      text=True).stdout) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover == "", "an orphaned torchrun job trains on"

    resumed = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "study ddp: 3 trials left" in resumed.stderr
    # The trainer's bad-input line, from inside the job, is the trial's (B = 1024 x 4 x 2 > 1,024 samples).
    assert "effective batch 8192 (physical_batch 1024 x accum_steps 4 x world_size 2) is larger than the " \
           "training set (1024 samples)" in resumed.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name("ddp").experiment_id
    runs = [r for r in client.search_runs([experiment]) if "mlflow.parentRunId" in r.data.tags]
    finished = [r for r in runs if r.info.status == "FINISHED"]
    killed = [r for r in runs if r.info.status == "KILLED"]
    (invalid,) = [r for r in runs if r.info.status == "FAILED"]
    assert invalid.data.tags["reason"] == "invalid" and invalid.data.params["physical_batch"] == "1024"
    points = sorted((r.data.params["physical_batch"], r.data.params["accum_steps"]) for r in finished)
    assert points == [("16", "2"), ("8", "4")] and len(killed) == 1  # each point once, none lost
    resumed_run = next(r for r in finished if r.data.tags.get("batchsweep.resumes_run") == killed[0].info.run_id)
    assert int(resumed_run.data.tags["resumed_after_epoch"]) == 1
    for run in finished:  # every epoch once
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [1, 2, 3]
        assert run.data.params["world_size"] == "2" and run.data.params["effective_batch"] == "64"
        assert run.data.metrics["allreduce_calls"] == 16  # an epoch of 1,024: 16 windows of 64
    # Nothing of the killed job, nor of torchrun's launches (a log folder each), is left behind once its point
    # is done. (torch's own compile cache, one a user, may stay.)
    left = [p.name for p in temp.iterdir() if p.name.startswith(("batchsweep-", "torchelastic_"))]
    left += [str(p.relative_to(tmp_path)) for p in (tmp_path / "mlruns" / "checkpoints").rglob("torchrun-*")]
    assert left == []


def test_a_study_that_needs_torchrun_or_cannot_use_it_says_so(tmp_path, capsys):
    from batchsweep.sweeps.cli import main

    study = tmp_path / "study.toml"
    storage = ["--storage", f"sqlite:///{tmp_path}/o.db"]
    study.write_text('name = "d"\n[fixed]\nworld_size = 2\n[grid]\naccum_steps = [1, 2]\n')
    assert main(["--study", str(study), "--dry-run", *storage]) == 2
    assert capsys.readouterr().err.strip() == ('error: world_size 2 trains data-parallel under torchrun: add '
                                               '--launcher torchrun (or launcher = "torchrun" in the study file)')
    assert main(["--study", str(study), "--dry-run", "--launcher", "torchrun", *storage]) == 0
    capsys.readouterr()
    assert main(["--study", "equivalence", "--dry-run", "--launcher", "torchrun", *storage]) == 2
    assert "an equivalence study compares two models in one process" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]  # nothing written


AUTO_STUDY = """name = "auto"
[fixed]
model = "tests.factories:fits_16"
dataset = "tests.factories:blobs1k"
physical_batch = "auto"
epochs = 2
[grid]
effective_batch = [16, 64]
"""


@pytest.mark.slow
def test_a_study_with_physical_batch_auto_and_a_planner_that_learns_from_it(tmp_path):
    from mlflow import MlflowClient

    from .test_sweeps import TINY, sweep

    (tmp_path / "auto.toml").write_text(AUTO_STUDY)
    done = sweep(tmp_path, "--study", "auto.toml", "--workers", "1")
    assert done.returncode == 0, done.stderr
    assert re.search(r"b used \(OOM retries\)", done.stdout)
    assert re.search(r"\b16 +16 \(0\)", done.stdout) and re.search(r"\b64 +16 \(2\)", done.stdout)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("auto").experiment_id], "params.effective_batch = '64'")
    (run,) = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert (run.data.params["physical_batch"], run.data.params["physical_batch_used"]) == ("64", "16")
    assert (run.data.metrics["oom_retries"], run.data.metrics["oom_physical_batch"]) == (2, 32)
    report = (tmp_path / "reports/auto/trials.csv").read_text().splitlines()
    assert "physical_batch_used" in report[0] and "oom_retries" in report[0]
    # The planner fits peak memory on b = 8 and 16 from a batch_memory study (32 and 64 run out of memory
    # there) and, from the run above, keeps its plan below b = 32, where memory alone would allow 512.
    assert sweep(tmp_path, *TINY, "--study", "batch_memory", "--model", "tests.factories:fits_16",
                 "--n-trials", "4").returncode == 0
    plan = sweep(tmp_path, "--plan", "--target-batch", "512", "--memory-budget", "1GiB", "--model",
                 "tests.factories:fits_16", "--dataset", "tests.factories:blobs1k")
    assert plan.returncode == 0, plan.stderr
    assert "note: kept below b = 32, the smallest that ran out of memory" in plan.stdout
    assert "plan: physical batch 16 x 32 accumulation steps = 512" in plan.stdout


@pytest.mark.slow
def test_a_torchrun_job_that_runs_out_of_memory_or_gets_bad_input_says_which(data_dir):
    from batchsweep.sweeps.launch import torchrun

    rows = []
    with pytest.raises(torch.OutOfMemoryError, match="out of memory: lower --physical-batch"):
        torchrun.train_job(TrainConfig(model="tests.factories:fits_16", data_dir=data_dir, physical_batch=32, epochs=1),
                   rows.append, None)
    with pytest.raises(ConfigError, match=r"effective batch 8192 .* is larger than the training set \(\d+ samples\)$"):
        torchrun.train_job(TrainConfig(model="mlp", data_dir=data_dir, physical_batch=8192, epochs=1), rows.append, None)
    assert rows == []


def test_a_data_parallel_run_with_dropout_resumes_bitwise(tmp_path):
    # 41 samples at B = 2 x 3 x 2: the last window of 5 splits 3 / 2, so the ranks draw different numbers of
    # dropout masks, and each must resume from its own RNG states, not rank 0's.
    config = dict(model="tests.factories:killable", dataset="tests.factories:jittered41", device="cpu", epochs=3,
                  physical_batch=2, accum_steps=3, world_size=2, optimizer="adamw", base_lr=0.01,
                  schedule="cosine", warmup_epochs=1)
    folder = str(tmp_path / "checkpoints")
    whole, stopped, resumed = torchrun(tmp_path, [
        {"config": config, "no_sync": True},
        {"config": config, "no_sync": True, "checkpoint": folder, "stop_after": 2},  # as if killed after epoch 2
        {"config": config, "no_sync": True, "checkpoint": folder}])
    assert stopped is None
    assert all(torch.equal(whole["state"][k], resumed["state"][k]) for k in whole["state"])

    def computed(history):
        return [{k: v for k, v in row.items() if k not in ("epoch_time_s", "samples_per_s")} for row in history]

    assert computed(resumed["history"]) == computed(whole["history"])
