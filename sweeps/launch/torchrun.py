"""A trial as a torchrun job (`--launcher torchrun`): `torchrun --standalone --nproc-per-node N
trainers/train.py ...` with the trial's configuration as flags (N is its world_size). Rank 0 appends each
epoch's row to a file that this process follows, so the trial's MLflow run and its pruner see every epoch as
it ends; its checkpoint folder is the trainer's `--checkpoint-dir`, so a killed trial resumes as one trained
in the worker's own process does."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from batchsweep.trainers import BatchsweepError, Checkpointing, ConfigError, TrainConfig

from .processes import die_with_parent

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "trainers" / "train.py"
OUT_OF_MEMORY = "out of memory:"  # how trainers/cli.py's line for an out-of-memory not shrunk away begins


def flags(config: TrainConfig) -> list[str]:
    """The configuration as trainers/train.py's flags."""
    args = []
    for name, value in dataclasses.asdict(config).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def train_job(config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
        checkpoint: Checkpointing | None) -> dict[str, Any]:
    """Train `config` under torchrun and return the trainer's result (TrainResult.to_dict()). An exception
    raised by `on_epoch` (a pruned trial) stops the job. The trainer's bad-input line becomes a ConfigError,
    its out-of-memory a torch.OutOfMemoryError.

    The job's files (its rows, result and log, and torchrun's own log folders, which it would otherwise leave
    in the system's temporary folder at every launch) are in a folder of their own, inside the trial's
    checkpoint folder when it has one: a worker killed outright cannot remove them, and they go with that
    folder once the point is done."""
    if checkpoint:
        Path(checkpoint.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="torchrun-" if checkpoint else "batchsweep-torchrun-",
                                     dir=checkpoint.dir if checkpoint else None) as tmp:
        rows_path, result_path, log_path = Path(tmp, "rows.jsonl"), Path(tmp, "result.json"), Path(tmp, "log")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--log-dir",
                   str(Path(tmp, "elastic")), "--nproc-per-node", str(config.world_size), str(TRAIN_SCRIPT),
                   *flags(config), "--json", str(result_path), "--epochs-jsonl", str(rows_path)]
        if checkpoint:
            command += ["--checkpoint-dir", checkpoint.dir, "--checkpoint-every", str(checkpoint.every),
                        "--checkpoint-minutes", str(checkpoint.minutes)]
        rows_path.touch()
        errors = []  # the trainer's own errors, with their kind
        with open(log_path, "w") as log, open(rows_path) as rows:
            job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=die_with_parent())
            try:
                while True:
                    done = job.poll() is not None
                    for line in rows.readlines():  # (whole lines, each flushed)
                        row = json.loads(line)
                        if "error" in row:
                            errors.append(row)
                        else:
                            on_epoch(row)
                    if done:
                        break
                    time.sleep(0.1)
            except BaseException:  # pruned, interrupted: the job stops with the trial
                stop(job)
                raise
        if job.returncode == 0 or (job.returncode == 1 and result_path.exists()):  # 1: the run diverged
            return json.loads(result_path.read_text())
        raise _failure(job.returncode, log_path.read_text(errors="replace"), errors)


def stop(job: subprocess.Popen) -> None:
    """SIGTERM (torchrun passes it to its ranks), then SIGKILL after 10 s."""
    job.terminate()
    try:
        job.wait(10)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


def _failure(code: int, log: str, errors: list[dict[str, str]]) -> Exception:
    """What the job's failure means. torchrun exits 1 whatever its ranks' statuses were, so the trainer says it:
    its out-of-memory line (exit 3), or its error and the error's kind. Only a configuration error makes the
    point invalid for good; a damaged checkpoint or a full disk is an error, and the point runs again."""
    lines = [line[len("error: "):] for line in log.splitlines() if line.startswith("error: ")]
    if lines and lines[-1].startswith(OUT_OF_MEMORY):
        return torch.OutOfMemoryError(lines[-1])
    if errors:
        kind = ConfigError if errors[-1]["error"] == "ConfigError" else BatchsweepError
        return kind(errors[-1]["message"])
    tail = [line for line in log.splitlines() if line.strip()][-3:]
    return RuntimeError(f"the torchrun job exited with status {code}: {' / '.join(tail)[-1000:]}")
