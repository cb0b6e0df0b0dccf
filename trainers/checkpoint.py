"""Checkpoints: everything the rest of a run depends on, written atomically at the end of an epoch, so that
running the same command again goes on after the last finished epoch and ends bitwise where an uninterrupted
run ends (on the CPU; timings aside)."""
from __future__ import annotations

import dataclasses
import io
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import FIELDS, TrainConfig
from .errors import CheckpointError, ConfigError

FILE = "checkpoint.pt"
FORMAT = 2
ENTRIES = {"format", "config", "progress", "model", "optimizer", "probes", "rng"}  # and rng_ranks under torchrun
# How the data is read, not what is computed: a run may resume with other values of these.
HOW_NOT_WHAT = ("num_workers", "pin_memory", "prefetch_factor", "data_dir")


HOST = socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process runs. A zombie does not: a killed worker whose parent died too stays one where nothing
    reaps it (a container's PID 1 that reaps nothing, or a subreaper that waits only for its own children), and
    its trial must still be run again."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often: every `every` epochs (0: never by count), and at the end of an epoch once `minutes`
    have passed since the last checkpoint (0: never by time). The last epoch is always written."""

    dir: str
    every: int = 1
    minutes: float = 0.0

    def __post_init__(self) -> None:
        if self.every < 0 or not self.minutes >= 0:
            raise ConfigError(f"--checkpoint-every and --checkpoint-minutes must be >= 0, got {self.every} and "
                              f"{self.minutes}")

    @property
    def path(self) -> Path:
        return Path(self.dir) / FILE


@dataclass
class Progress:
    """The loop's position and what it has gathered: with the weights, the optimizer, the probes and the RNG
    states, a checkpoint."""

    epoch: int = 0  # the last finished epoch
    step: int = 0
    status: str = "ok"
    finished: bool = False  # the last epoch ran, the run diverged or reached max_steps
    history: list[dict[str, float]] = field(default_factory=list)
    train_time: float = 0.0
    wall_time: float = 0.0
    samples: int = 0
    physical_batch: int = 0  # the b in use, when out-of-memory shrank it (0: the configuration's)
    oom_retries: int = 0
    oom_batch: int = 0  # the smallest b that ran out of memory (0: none did)
    evals: list[dict[str, float]] = field(default_factory=list)  # the evaluations within epochs, by step


def rng_states() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            # (a CUDA that was never initialized has drawn nothing; initializing it would cost a context)
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "python": random.getstate(),
            # as a tensor: loading with weights_only (no pickled code from a shared folder) refuses numpy arrays
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():  # (a run saved on a GPU may resume on the CPU)
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def make_writable_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {folder} ({exc.strerror or exc}): make it writable or "
                              f"pass another --checkpoint-dir") from None


class Checkpointer:
    """Writes a run's checkpoints into one folder and reads the last one back. Under torchrun every rank reads
    it and rank 0 alone writes (`writes=False` elsewhere)."""

    def __init__(self, spec: Checkpointing, config: TrainConfig, writes: bool = True):
        self.spec, self.config, self.writes = spec, config, writes
        self.last_write = time.monotonic()
        self.writer: threading.Thread | None = None
        self.failure: str | None = None
        if not writes:
            return
        folder = Path(spec.dir)
        make_writable_folder(folder)  # before the first epoch, not after it
        for stale in folder.glob(f"{FILE}.tmp-{HOST}-*"):  # a write that was killed: the checkpoint before it stands
            pid = stale.name.rpartition("-")[2]  # (another live writer's is left alone: its rename is to come)
            if pid.isdigit() and not pid_alive(int(pid)):
                stale.unlink(missing_ok=True)

    def due(self, progress: Progress) -> bool:
        """Whether this epoch is written (by rank 0's clock, under torchrun: the loop asks every rank to agree)."""
        every, minutes = self.spec.every, self.spec.minutes
        return progress.finished or bool(every and progress.epoch % every == 0) or bool(
            minutes and time.monotonic() - self.last_write >= 60 * minutes)

    def save(self, progress: Progress, model, optimizer, probes, rng: list[dict[str, Any]]) -> None:
        """Serialize now (the weights move on in the next epoch), write in the background: the file's write and
        fsync, most of the cost, overlap the next epoch's training. Writes land in order. `rng` holds every
        rank's RNG states, in rank order (ranks whose shards differ in size have drawn differently)."""
        if not self.writes:
            return
        state = {"format": FORMAT, "config": self.config.to_dict(), "progress": vars(progress),
                 "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "probes": [(type(p).__name__, p.state()) for p in probes], "rng": rng[0]}
        if len(rng) > 1:
            state["rng_ranks"] = rng
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.wait()
        self.writer = threading.Thread(target=self._write, args=(buffer.getbuffer(),), name="checkpoint")
        self.writer.start()
        self.last_write = time.monotonic()

    def _write(self, data: memoryview) -> None:
        target = self.spec.path
        temporary = target.with_name(f"{FILE}.tmp-{HOST}-{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # on the disk before the rename: a power cut leaves old or new, not half
            # Atomic: a reader sees the old checkpoint or the new one. (The folder is not fsynced: a rename
            # lost to a power cut leaves the previous checkpoint, which is whole.)
            os.replace(temporary, target)
        except OSError as exc:
            self.failure = f"cannot write checkpoint {target} ({exc.strerror or exc})"
            temporary.unlink(missing_ok=True)

    def join(self) -> None:
        """Until the last checkpoint is on the disk (or its write failed)."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def wait(self) -> None:
        """Until the last checkpoint is on the disk; a write that failed is raised here."""
        self.join()
        if self.failure:
            raise CheckpointError(f"{self.failure}: free space or make the folder writable, then run the same "
                                  f"command again")

    def load(self) -> dict[str, Any] | None:
        """The last checkpoint, checked against this run's configuration; None when there is none."""
        path = self.spec.path
        if not path.exists():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                raise ValueError(f"format {state.get('format') if isinstance(state, dict) else None!r}, not {FORMAT}")
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} cannot be read ({_reason(exc)}): it is damaged; remove it to "
                                  f"start the run over, or pass another --checkpoint-dir") from None
        wrong = _malformed(state)
        if wrong:
            raise CheckpointError(f"checkpoint {path} is not one of this run's ({wrong}): remove it to start over, "
                                  f"or pass another --checkpoint-dir")
        theirs = state["config"]
        differing = [f"{name} {theirs.get(name)!r} there, {getattr(self.config, name)!r} here" for name in FIELDS
                     if name not in HOW_NOT_WHAT and theirs.get(name) != getattr(self.config, name)]
        if differing:
            raise CheckpointError(f"checkpoint {path} is of another configuration ({'; '.join(differing[:4])}"
                                  f"{'; …' if len(differing) > 4 else ''}): pass another --checkpoint-dir, or "
                                  f"remove it to start over")
        wrong = _out_of_place(state["progress"], self.config)
        if wrong:
            raise CheckpointError(f"checkpoint {path} is not one of this run's ({wrong}): remove it to start over, "
                                  f"or pass another --checkpoint-dir")
        return state


def _reason(exc: BaseException) -> str:
    return (str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)[:200]


def _malformed(state: dict[str, Any]) -> str | None:
    """What makes a readable checkpoint unfit to resume anything from: entries missing or of another shape."""
    missing, unknown = ENTRIES - state.keys(), state.keys() - ENTRIES - {"rng_ranks"}
    if missing or unknown:
        return f"{'no ' + ', '.join(sorted(missing)) if missing else 'unknown ' + ', '.join(sorted(unknown))}"
    progress, fields = state["progress"], {f.name for f in dataclasses.fields(Progress)}
    if not isinstance(state["config"], dict) or not isinstance(progress, dict) or progress.keys() != fields:
        return "its config or progress is not of this version's shape"
    return None


def _out_of_place(progress: dict[str, Any], config: TrainConfig) -> str | None:
    """What makes the progress of a checkpoint of this very configuration impossible (the configuration is compared
    first, so that a run of other epochs is told as that)."""
    if not isinstance(progress["epoch"], int) or not 0 <= progress["epoch"] <= config.epochs:
        return f"it stands at epoch {progress['epoch']!r} of a {config.epochs}-epoch run"
    if progress["finished"] and progress["epoch"] < config.epochs and progress["status"] == "ok" \
            and not config.max_steps:
        return f"it is marked finished at epoch {progress['epoch']} of {config.epochs}"
    return None


def restore(state: dict[str, Any], model, optimizer, probes, rank: int = 0, where: Path | str = FILE) -> Progress:
    """Put a checkpoint back into a freshly prepared run (this rank's RNG states); returns where it stood."""
    saved = state["probes"]
    names = [type(p).__name__ for p in probes]
    if [name for name, _ in saved] != names:
        raise CheckpointError(f"the checkpoint was written with the probes {[n for n, _ in saved]}, this run has "
                              f"{names}: resume with the same probes, or pass another --checkpoint-dir")
    try:  # weights of another shape, a missing optimizer entry, RNG states of another kind
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for probe, (_, probe_state) in zip(probes, saved):
            probe.load_state(probe_state)
        set_rng_states(state["rng_ranks"][rank] if "rng_ranks" in state else state["rng"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint {where} does not fit this run's model ({_reason(exc)}): remove it to "
                              f"start over, or pass another --checkpoint-dir") from None
    return Progress(**state["progress"])
