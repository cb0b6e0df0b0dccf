"""Checkpoints: a run killed anywhere resumes after its last finished epoch and ends bitwise where an
uninterrupted run ends; bad checkpoints are one line."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, in_process, run_script
from tests.test_train_cli import one_line_error

# BatchNorm, dropout, a seeded augmentation read through the DataLoader, AdamW, warmup and a cosine schedule,
# the noise scale (k = 2) and the health statistics: every state a resumed run must get back.
ARGS = ["--model", "tests.factories:killable", "--dataset", "tests.factories:jittered", "--physical-batch", "4",
        "--accum-steps", "2", "--epochs", "6", "--optimizer", "adamw", "--base-lr", "0.01", "--schedule", "cosine",
        "--warmup-epochs", "1", "--device", "cpu"]
TIMINGS = {"epoch_time_s", "samples_per_s", "wall_time_s"}
# The 5th checkpoint's write (of epoch 5) cut to half its length and killed before its fsync, once (while the
# marker file exists).
KILL_WHILE_WRITING = """
import os, signal, sys
real, calls = os.fsync, []
def fsync(fd):
    calls.append(fd)
    if len(calls) == 5 and os.path.exists(sys.argv[1]):
        os.unlink(sys.argv[1])
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    real(fd)
os.fsync = fsync
from batchsweep.trainers.cli import main
sys.exit(main(sys.argv[2:]))
"""


def train_once(folder, *extra, kill=None, marker=None):
    """The trainer's command with checkpoints in `folder`: killed as `kill` says in a process of its own, or to the
    end in this one (its imports paid once; what it restores comes from the checkpoint, not a fresh process)."""
    from batchsweep.trainers.cli import main

    args = [*ARGS, "--checkpoint-dir", str(folder), "--json", str(folder / "result.json"), *extra]
    if not kill:
        return in_process(main, ROOT, *args)
    marker.write_text("kill once")
    if kill == "writing":
        return subprocess.run([sys.executable, "-c", KILL_WHILE_WRITING, str(marker), *args], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return run_script("trainers/train.py", *args, env={"BATCHSWEEP_TEST_KILL": f"{marker}:{kill}"})


def outcome(folder):
    result = json.loads((folder / "result.json").read_text())
    history = [{k: v for k, v in row.items() if k not in TIMINGS} for row in result["history"]]
    metrics = {k: v for k, v in result["metrics"].items() if k not in TIMINGS}
    state = torch.load(folder / "checkpoint.pt", weights_only=True)
    return history, metrics, result["status"], result["health"], state["model"], state["optimizer"]["state"]


@pytest.mark.slow
def test_a_run_killed_anywhere_resumes_bitwise(tmp_path):
    done = train_once(tmp_path / "whole")
    assert done.returncode == 0, done.stderr
    reference = outcome(tmp_path / "whole")
    # Where the kill lands, and the epoch of the last checkpoint that survives it: in epoch 3's training
    # (its 25th micro-batch), in epoch 4's evaluation, while epoch 5's checkpoint is being written.
    for kill, resumes_after, extra in (("train:25", 2, ["--num-workers", "1"]), ("eval:4", 3, []),
                                       ("writing", 4, [])):
        folder = tmp_path / kill.replace(":", "-")
        killed = train_once(folder, kill=kill, marker=tmp_path / "marker")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        assert torch.load(folder / "checkpoint.pt", weights_only=True)["progress"]["epoch"] == resumes_after
        resumed = train_once(folder, *extra)  # the same command again (another number of loader processes)
        assert resumed.returncode == 0, resumed.stderr
        assert "resuming from" in resumed.stderr and f"after epoch {resumes_after} (from its checkpoint)" in resumed.stdout
        assert not list(folder.glob("*.tmp-*"))  # the half-written file is gone
        history, metrics, status, health, weights, moments = outcome(folder)
        assert (history, metrics, status, health) == reference[:4], kill
        assert weights.keys() == reference[4].keys()
        assert all(torch.equal(weights[k], reference[4][k]) for k in weights), kill  # bitwise, buffers too
        assert all(torch.equal(moments[i][k], reference[5][i][k]) for i in moments for k in moments[i]), kill
    again = train_once(tmp_path / "whole")  # a finished run, run again: nothing is trained twice
    assert again.returncode == 0 and "after epoch 6 (from its checkpoint)" in again.stdout
    assert outcome(tmp_path / "whole")[:4] == reference[:4]


def test_bad_checkpoints_are_one_line(capsys, tmp_path):
    folder = tmp_path / "run"
    args = ["--model", "mlp", "--dataset", "tests.factories:blobs", "--epochs", "2", "--device", "cpu",
            "--checkpoint-dir", str(folder)]
    from batchsweep.trainers.cli import main

    assert main(args) == 0
    line = one_line_error(capsys, [*args, "--accum-steps", "3", "--base-lr", "0.1"])
    assert line == (f"error: checkpoint {folder}/checkpoint.pt is of another configuration (accum_steps 1 there, "
                    f"3 here; base_lr 0.05 there, 0.1 here): pass another --checkpoint-dir, or remove it to start "
                    f"over")
    (folder / "checkpoint.pt").write_bytes(b"\x00not a checkpoint" * 10)
    line = one_line_error(capsys, args)
    assert line.startswith(f"error: checkpoint {folder}/checkpoint.pt cannot be read (")
    assert line.endswith("): it is damaged; remove it to start the run over, or pass another --checkpoint-dir")
    assert (folder / "checkpoint.pt").read_bytes() == b"\x00not a checkpoint" * 10  # left as it was
    (tmp_path / "a-file").write_text("")
    line = one_line_error(capsys, [*args[:-1], str(tmp_path / "a-file/run")])
    assert line == (f"error: cannot write checkpoints to {tmp_path}/a-file/run (Not a directory): make it "
                    f"writable or pass another --checkpoint-dir")
    line = one_line_error(capsys, [*args, "--checkpoint-every", "-1"])
    assert "--checkpoint-every and --checkpoint-minutes must be >= 0" in line


@pytest.mark.parametrize("every,minutes,written", [(1, 0, [1, 2, 3, 4]), (3, 0, [3, 4]), (0, 0, [4]),
                                                   (0, 1e-9, [1, 2, 3, 4])])
def test_checkpoint_interval(tmp_path, every, minutes, written):
    from batchsweep.trainers import TrainConfig
    from batchsweep.trainers.checkpoint import Checkpointer, Checkpointing, Progress

    checkpointer = Checkpointer(Checkpointing(str(tmp_path), every, minutes), TrainConfig())
    assert [e for e in range(1, 5) if checkpointer.due(Progress(epoch=e, finished=e == 4))] == written


STUDY = """name = "resume"
[fixed]
model = "tests.factories:killable"
dataset = "tests.factories:jittered"
epochs = 6
optimizer = "adamw"
base_lr = 0.01
schedule = "cosine"
warmup_epochs = 1
device = "cpu"
[grid]
physical_batch = [4]
accum_steps = [2]
"""


@pytest.mark.slow
def test_a_study_killed_mid_trial_resumes_it_bitwise(tmp_path):
    import mlflow.pytorch
    from mlflow import MlflowClient

    from batchsweep.analysis import cli as report_cli
    from batchsweep.sweeps import cli

    def study(cwd, env=None):
        """The study from `cwd`: killed as `env` says in a process of its own, or to its end in this one."""
        cwd.mkdir(exist_ok=True)
        (cwd / "study.toml").write_text(STUDY)
        args = ["--study", "study.toml", "--seeds", "1", "--no-report", "--log-models", "all"]
        if env is None:
            return in_process(cli.main, cwd, *args)
        return subprocess.run([sys.executable, str(ROOT / "sweeps/run.py"), *args], capture_output=True, text=True,
                              cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env})

    def trial_runs(cwd):
        client = MlflowClient(f"sqlite:///{cwd}/mlruns/mlflow.db")
        experiment = client.get_experiment_by_name("resume").experiment_id
        runs = client.search_runs([experiment], "tags.`mlflow.parentRunId` != ''", order_by=["start_time ASC"])
        return client, [r for r in runs if "mlflow.parentRunId" in r.data.tags]

    def weights(run):  # of either kind of logged model (torch 2.4 cannot export `killable`: its state dict)
        if run.data.tags["batchsweep.model"] == "pytorch":
            state = mlflow.pytorch.load_model(f"{run.info.artifact_uri}/model").state_dict()
        else:
            state = torch.load(Path(run.info.artifact_uri.removeprefix("file://")) / "model/state_dict.pt",
                               weights_only=True)
        return [state[k] for k in sorted(state)]

    assert study(tmp_path / "whole").returncode == 0
    marker = tmp_path / "marker"
    marker.write_text("kill once")
    killed = study(tmp_path / "killed", {"BATCHSWEEP_TEST_KILL": f"{marker}:train:25"})  # in epoch 3
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = study(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert "study resume: 1 trials left" in resumed.stderr
    client, (whole,) = trial_runs(tmp_path / "whole")
    client_k, (dead, done) = trial_runs(tmp_path / "killed")
    assert dead.info.status == "KILLED" and done.info.status == "FINISHED"
    assert done.data.tags["batchsweep.resumes_run"] == dead.info.run_id
    assert done.data.tags["resumed_after_epoch"] == "2"
    for key in ("train_loss", "val_loss", "grad_norm", "noise_scale"):  # one history, every epoch once, bitwise
        ours = [(m.step, m.value) for m in client_k.get_metric_history(done.info.run_id, key)]
        theirs = [(m.step, m.value) for m in client.get_metric_history(whole.info.run_id, key)]
        assert ours == theirs and len({step for step, _ in ours}) == len(ours), key
    assert all(torch.equal(a, b) for a, b in zip(weights(done), weights(whole)))  # the final weights, bitwise
    assert not list((tmp_path / "killed/mlruns/checkpoints").rglob("checkpoint.pt"))  # done: removed
    report = in_process(report_cli.main, tmp_path / "killed", "--study", "resume")
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "killed/reports/resume/report.md").read_text()
    load = f"mlflow.pytorch.load_model('runs:/{done.info.run_id}/model')" if \
        done.data.tags["batchsweep.model"] == "pytorch" else "state_dict.pt, built as model.json says"
    assert load in text.split("## Trained models")[1]
    models = text.split("## Trained models")[1].split("\n## ")[0]
    assert "| kept as |" in models and "| every trial (--log-models all) |" in models, models  # (and why)


def test_models_chosen_and_logged(tmp_path):
    import mlflow
    import optuna
    from mlflow import MlflowClient

    from batchsweep.sweeps.trials.checkpoints import chosen, log_model
    from batchsweep.sweeps.stores.mlflow_store import Tracker
    from batchsweep.trainers import TrainConfig, train
    from batchsweep.trainers.checkpoint import Checkpointing

    trials = [optuna.trial.create_trial(values=v) for v in ([0.9, 5.0], [0.8, 1.0], [0.7, 2.0], [0.95, 9.0])]
    assert [t.values for t in chosen(trials, ("maximize", "minimize"), "best")] == [[0.9, 5.0], [0.8, 1.0],
                                                                                    [0.95, 9.0]]  # the front
    assert chosen(trials[:3], ("maximize",), "best") == [trials[0]] and chosen(trials, ("minimize",), "none") == []
    assert chosen(trials, ("maximize",), "all") == trials
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db", "models")
    # MLflow's PyTorch flavour saves through torch.export from 3.16 on, which cannot trace branchy's branch on the
    # data; before, it pickled the module, branch and all.
    exports = tuple(int(n) for n in mlflow.__version__.split(".")[:2]) >= (3, 16)
    for model, kind in (("mlp", "pytorch"), ("tests.factories:branchy", "state_dict" if exports else "pytorch")):
        config = TrainConfig(model=model, dataset="tests.factories:blobs", epochs=1, device="cpu")
        trained = train(config, checkpoint=Checkpointing(str(tmp_path / model)))
        run = tracker.client.create_run(tracker.experiment_id).info
        assert log_model(tracker, run.run_id, config, tmp_path / model) == kind
        names = {f.path for f in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").list_artifacts(run.run_id, "model")}
        if kind == "pytorch":  # the flavour: loads without batchsweep's code, same outputs
            import mlflow.pytorch

            loaded = mlflow.pytorch.load_model(f"{run.artifact_uri}/model")
            x = torch.randn(3, 4)
            assert torch.equal(loaded(x), trained.model.eval()(x)) and "model/MLmodel" in names
        else:
            assert {"model/state_dict.pt", "model/model.json"} <= names
            weights = torch.load(f"{run.artifact_uri.removeprefix('file://')}/model/state_dict.pt", weights_only=True)
            assert all(torch.equal(weights[k], v) for k, v in trained.model.state_dict().items())
            built = json.loads(Path(f"{run.artifact_uri.removeprefix('file://')}/model/model.json").read_text())
            from batchsweep.trainers import TrainConfig, prepare  # as model.json says to build it

            assert built["build"].startswith("batchsweep.trainers.prepare(TrainConfig(**config)).model")
            prepare(TrainConfig(**built["config"])).model.load_state_dict(weights)


LOG_A_MODEL = """
import sys
from pathlib import Path
from batchsweep.sweeps.trials.checkpoints import log_model
from batchsweep.sweeps.stores.mlflow_store import Tracker
from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.checkpoint import Checkpointing
config = TrainConfig(model="mlp", dataset="tests.factories:blobs", epochs=1, device="cpu")
train(config, checkpoint=Checkpointing(str(Path(sys.argv[1]) / "mlp")))
tracker = Tracker(f"sqlite:///{sys.argv[1]}/mlflow.db", "models")
run = tracker.client.create_run(tracker.experiment_id).info
print(log_model(tracker, run.run_id, config, Path(sys.argv[1]) / "mlp"))
print("pytorch_lightning" in sys.modules)
import pytorch_lightning
print(pytorch_lightning.LightningModule.__name__)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="Lightning is not installed")
def test_a_model_is_logged_without_importing_lightning_which_stays_importable(tmp_path):
    """mlflow.pytorch imports Lightning, where it is installed, for a callback batchsweep never uses: seconds
    at the end of every study. Logging a model leaves Lightning out, and importable after."""
    proc = subprocess.run([sys.executable, "-c", LOG_A_MODEL, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.split() == ["pytorch", "False", "LightningModule"], proc.stderr[-2000:]
