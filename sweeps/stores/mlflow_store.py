"""MLflow tracking: one parent run per invocation, one nested child run per trial, batched writes."""
from __future__ import annotations

import csv
import getpass
import json
import logging
import os
import random
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from mlflow.utils.mlflow_tags import (MLFLOW_DATASET_CONTEXT, MLFLOW_GIT_COMMIT, MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NOTE,
                                     MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_USER)

from batchsweep.trainers import BatchsweepError, interrupt, pid_alive

from .outcomes import INTERRUPTED
from .urls import redact, sqlite_path, unreachable

HOST = socket.gethostname()


class Once(logging.Filter):
    """Each message once. MLflow's GPU monitor warns at every sample where NVML cannot read a metric (a MIG
    slice has no utilization or power of its own): once a second, for every trial, between the bars."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.said:
            return False
        self.said.add(message)
        return True


def quiet_library_logs() -> None:
    """Keep the stores' libraries to what matters, in the commands and in every worker process (spawned, so
    they start with Python's defaults): MLflow's and alembic's INFO lines would break the progress bars, and a
    Ctrl-C inside a fetch from SQLite leaves a cursor that SQLAlchemy's pool cannot close: it logs that with a
    traceback and goes on, while the interrupt itself is handled (exit 130, how to resume). MLflow's GPU monitor
    says each of its warnings once."""
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("sqlalchemy.pool").setLevel(logging.CRITICAL)
    gpu_monitor = logging.getLogger("mlflow.system_metrics.metrics.gpu_monitor")
    if not any(isinstance(f, Once) for f in gpu_monitor.filters):
        gpu_monitor.addFilter(Once())


def _processes() -> str:
    """Which processes this one can see: the kernel's boot (machines that share a host name differ) and the
    PID namespace (containers on one kernel differ). A process id is judged only where this matches."""
    def read(how) -> str:
        try:
            return how()
        except OSError:
            return "?"
    return (read(lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()) + "/" +
            read(lambda: os.readlink("/proc/self/ns/pid")))


PROCESSES = _processes()
# History keys logged with their epoch as step; throughput and memory are logged once, for the whole run.
RUN_LEVEL = ("samples_per_s", "peak_memory_bytes", "wall_time_s")
T = TypeVar("T")


class TrackingError(BatchsweepError):
    """The MLflow store cannot be reached or written."""


def default_tracking_uri(root: str = "mlruns") -> str:
    return f"sqlite:///{Path(root).resolve()}/mlflow.db"


# Errors that another writer causes and that pass: SQLite's lock, and a row that two machines insert at once (MLflow
# writes an experiment's tag or a dataset by SELECT then INSERT, so the slower one hits the unique key; tried
# again, it finds the row).
TRANSIENT = ("locked", "UNIQUE constraint failed", "duplicate key value violates unique constraint")
# Two machines that open a new database at once (MLflow's tracking store, Optuna's storage) both create its
# tables: the one whose CREATE collided finds them made (in one transaction, on PostgreSQL) when it tries again.
TABLES_RACE = (*TRANSIENT, "already exists")


def retry(call: Callable[[], T], attempts: int = 8, transient: tuple[str, ...] = TRANSIENT) -> T:
    """Back off and try again while another worker's write is in the way."""
    for attempt in range(attempts):
        try:
            return call()
        except Exception as exc:  # MlflowException, RestException or SQLAlchemy's OperationalError
            if not any(marker in str(exc) for marker in transient) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2 ** attempt * (1 + random.random()))
    raise AssertionError("unreachable")


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def standard_tags(commit: str | None) -> dict[str, str]:
    """MLflow's own tags, which fill the UI's Source, Version and User columns."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container whose uid has no name
        user = str(os.getuid())
    tags = {MLFLOW_SOURCE_NAME: "sweeps/run.py", MLFLOW_SOURCE_TYPE: "LOCAL", MLFLOW_USER: user}
    if commit:
        tags[MLFLOW_GIT_COMMIT] = commit
    return tags


def first_line(exc: BaseException, *urls: str) -> str:
    """An exception as 'Type: first line of its message', with any password in `urls` scrubbed."""
    from .urls import scrub

    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    return scrub(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, *urls)


def _strings(values: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in values.items() if v is not None}


def quote(value: str) -> str:
    """A value inside an MLflow filter string, in whichever quote it does not hold (MLflow's filter parser
    has no escapes)."""
    value = str(value)
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise BatchsweepError(f"{value!r} holds both kinds of quote, which an MLflow filter cannot express: rename it")


def step_of(row: dict[str, float]) -> int:
    """A history row's MLflow step: its epoch (the report reads curves by epoch), or a script's step for a row
    that has no whole epoch."""
    epoch = row.get("epoch")
    if epoch is not None and (float(epoch).is_integer() or "step" not in row):
        return int(epoch)
    return int(row["step"])


class Tracker:
    """The study's MLflow experiment (named like the study) on one tracking URI."""

    def __init__(self, uri: str, experiment: str):
        self.uri = uri
        why = unreachable(uri)
        if why:
            raise TrackingError(why)
        if sqlite_path(uri) is not None:
            db = sqlite_path(uri)
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
                probe = db.parent / f".write-test-{os.getpid()}"
                probe.touch()
                probe.unlink()
            except OSError as exc:
                raise TrackingError(f"cannot write the MLflow store in {db.parent} ({exc.strerror}): "
                                    f"make it writable or pass --tracking-uri") from None
        self.artifact_uris: dict[str, str] = {}  # run id -> artifact URI, for the runs this tracker started
        self.open_runs: set[str] = set()  # started here and not ended yet
        try:
            # A damaged SQLite store already fails here, and a new database's tables are made here.
            self.client = retry(lambda: MlflowClient(tracking_uri=uri), transient=TABLES_RACE)
            self.experiment_id = retry(lambda: self._experiment(experiment))
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"cannot use the MLflow tracking store {redact(uri)} ({first_line(exc, uri)}): "
                                f"start the server, check --tracking-uri, or move a damaged store aside") from None

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None and found.lifecycle_stage == "deleted":  # in the UI's trash: no run can start there
            raise TrackingError(f"the MLflow experiment {name} is deleted: restore it (mlflow experiments restore "
                                f"--experiment-id {found.experiment_id}) or pass another --study-name")
        if found is not None:
            return found.experiment_id
        location = None
        if self.uri.startswith("sqlite:///"):  # artifacts beside the database, not in the current directory
            location = (Path(self.uri.removeprefix("sqlite:///")).parent / "artifacts").resolve().as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # another machine created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _owner_tags(self) -> dict[str, str]:
        return {"batchsweep.host": HOST, "batchsweep.pid": str(os.getpid()), "batchsweep.processes": PROCESSES}

    def start_parent(self, run_name: str, params: dict[str, Any], tags: dict[str, Any]) -> str:
        run = retry(lambda: self.client.create_run(self.experiment_id, run_name=run_name,
                                                   tags={**_strings(tags), **self._owner_tags()}))
        self.open_runs.add(run.info.run_id)
        self.log(run.info.run_id, params=params)
        return run.info.run_id

    def start_trial(self, parent_run_id: str, run_name: str, params: dict[str, Any],
                    tags: dict[str, Any]) -> str:
        # A stop that lands after the store made the run RUNNING but before it is known here would leave it
        # RUNNING after the study ends: held until the run is one of open_runs, which every way out ends.
        interrupt.hold()
        try:
            run = retry(lambda: self.client.create_run(
                self.experiment_id, run_name=run_name,
                tags={**_strings(tags), **self._owner_tags(), MLFLOW_PARENT_RUN_ID: parent_run_id}))
            self.artifact_uris[run.info.run_id] = run.info.artifact_uri
            self.open_runs.add(run.info.run_id)
        finally:
            interrupt.release()
        self.log(run.info.run_id, params=params)
        return run.info.run_id

    def log(self, run_id: str, params: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
            history: list[dict[str, float]] | None = None, tags: dict[str, Any] | None = None) -> None:
        """Everything in one batched call: params, final metrics, per-epoch metrics with their step, tags."""
        now = int(time.time() * 1000)
        last_step = step_of(history[-1]) if history else 0
        rows = [Metric(k, float(v), now, last_step) for k, v in (metrics or {}).items()]
        for row in history or []:
            rows += [Metric(k, float(v), now, step_of(row)) for k, v in row.items()
                     if k not in ("epoch", "step") and k not in RUN_LEVEL]
        params_list = [Param(k, v) for k, v in _strings(params or {}).items()]
        tags_list = [RunTag(k, v) for k, v in _strings(tags or {}).items()]
        for start in range(0, max(len(rows), 1), 1000):  # MLflow takes at most 1000 metrics a call
            batch = rows[start:start + 1000]
            retry(lambda: self.client.log_batch(run_id, metrics=batch, params=params_list if start == 0 else [],
                                                tags=tags_list if start == 0 else []))

    def finish(self, run_id: str, status: str, history: list[dict[str, float]] | None = None,
               metrics: dict[str, float] | None = None, tags: dict[str, Any] | None = None,
               end: bool = True, dataset: dict[str, Any] | None = None) -> str | None:
        """Log the results and the history as CSV, and end the run as FINISHED, FAILED or KILLED (with
        end=False a successful run stays open for the caller to end once Optuna has recorded the trial). The
        run is ended whatever fails; a failure to record returns its message (the run then ends FAILED with
        tags `reason` = `record_error` and `error`) instead of raising, so that a trained trial is not lost.
        `dataset` (name, digest, train_size, test_size) becomes the run's input: the UI's Dataset column."""
        keys = {k for row in history or [] for k in row}
        params = None
        if metrics:  # per-epoch keys are in the history already; their last step is the final value
            metrics = {k: v for k, v in metrics.items() if k in RUN_LEVEL or k not in keys}
            if "physical_batch_used" in metrics:  # where out-of-memory shrank b: a param, like physical_batch
                params = {"physical_batch_used": int(metrics.pop("physical_batch_used"))}
        error = None
        try:
            self.log(run_id, params=params, metrics=metrics, history=history, tags=tags)
            if history:
                self._log_history_csv(run_id, history)
            if dataset and dataset.get("digest"):
                self.log_dataset(run_id, dataset)
        except Exception as exc:  # whatever the store raised: the run must still end, the trial stays trained
            error = first_line(exc, self.uri)
            status = "FAILED"
            try:
                retry(lambda: self.client.log_batch(run_id, tags=[RunTag("reason", "record_error"),
                                                                  RunTag("error", error)]))
            except Exception:
                pass
        if end or error:
            self.end(run_id, status)
        return error

    def log_dataset(self, run_id: str, info: dict[str, Any]) -> None:
        profile = {"num_rows": info["train_size"], "num_test_rows": info["test_size"]}
        dataset = Dataset(name=info["name"], digest=info["digest"], source_type="code",
                          source=json.dumps({"dataset": info["name"]}), profile=json.dumps(profile))
        retry(lambda: self.client.log_inputs(run_id, datasets=[
            DatasetInput(dataset, tags=[InputTag(MLFLOW_DATASET_CONTEXT, "train")])]))

    def describe(self, run_id: str | None, text: str) -> None:
        """The description that the UI shows: of a run, or (run_id None) of the experiment."""
        if run_id is None:
            retry(lambda: self.client.set_experiment_tag(self.experiment_id, MLFLOW_RUN_NOTE, text))
        else:
            retry(lambda: self.client.set_tag(run_id, MLFLOW_RUN_NOTE, text))

    def end(self, run_id: str, status: str) -> None:
        """End a run this tracker started, once; a store that refuses even this leaves it to close_orphans."""
        try:
            retry(lambda: self.client.set_terminated(run_id, status))
        except Exception:
            return
        self.open_runs.discard(run_id)

    def log_artifacts(self, run_id: str, folder: str, path: str) -> None:
        retry(lambda: self._artifacts(run_id).log_artifacts(folder, path))

    def _artifacts(self, run_id: str):
        # Straight to the run's artifact repository: client.log_text would first fetch the whole run
        # (get_run, about 55 ms on SQLite) only to learn the artifact URI that create_run returned.
        uri = self.artifact_uris.get(run_id) or self.client.get_run(run_id).info.artifact_uri
        return get_artifact_repository(uri, tracking_uri=self.uri)

    def end_open_runs(self, status: str, reason: str | None = None) -> None:
        for run_id in list(self.open_runs):
            if reason:
                try:
                    retry(lambda: self.client.set_tag(run_id, "reason", reason))
                except Exception:  # the store refuses: the run still ends, or close_orphans ends it later
                    pass
            self.end(run_id, status)

    def _log_history_csv(self, run_id: str, history: list[dict[str, float]]) -> None:
        # Every key of every row: some metrics first appear after epoch 1 (noise_scale after a warmup).
        columns = list(dict.fromkeys(k for row in history for k in row))
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "history.csv"
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(history)
            retry(lambda: self._artifacts(run_id).log_artifact(str(path)))

    def close_orphans(self, complete: set[str] = frozenset()) -> int:
        """End the RUNNING runs whose process on this host (and in this container) is gone (killed, crashed):
        FINISHED for the runs in `complete` (their Optuna trial was recorded complete before the process died),
        else KILLED."""
        runs = retry(lambda: self.client.search_runs(
            [self.experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`batchsweep.host` = "
                                                f"{quote(HOST)}",
            max_results=10_000))
        closed = 0
        for run in runs:
            pid = int(run.data.tags.get("batchsweep.pid", "0"))
            seen_here = run.data.tags.get("batchsweep.processes", PROCESSES) == PROCESSES
            if pid and seen_here and not pid_alive(pid):
                if run.info.run_id in complete:
                    retry(lambda: self.client.set_terminated(run.info.run_id, "FINISHED"))
                else:
                    retry(lambda: self.client.set_tag(run.info.run_id, "reason", INTERRUPTED.name))
                    retry(lambda: self.client.set_terminated(run.info.run_id, INTERRUPTED.status))
                closed += 1
        return closed
