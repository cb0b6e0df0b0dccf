"""A worker: Optuna picks and records the trials, the objective trains them, MLflow tracks them."""
from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import math
import os
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState

from trainers import ConfigError, TrainConfig, interrupt
from trainers.config import BatchsweepError
from trainers.checkpoint import Checkpointing
from trainers.loop import device_name, resolve_device

from .models import claim, folder_of, resumes, spare
from .objective import make_objective
from .outcomes import OUTCOMES, outcome_of
from .planner import start_batch
from .search import Duplicate, Search, StudyChanged, Unit, make_search
from .studies import Point, Study, config_key, describe
from .tracking import (HOST, PROCESSES, Tracker, first_line, git_commit, pid_alive, standard_tags,
                       system_metrics)
from .urls import check_storage, redact, sqlite_path

# Consecutive failures to read, create or record a trial in the Optuna storage before a worker gives up: a
# storage that stopped accepting writes (a folder turned read-only, a database server that went down) would
# otherwise fail every next trial forever.
STORAGE_FAILURES = 3
HEARTBEAT_GRACE_S = 120  # a trial whose process sent no heartbeat for this long is dead


class StorageError(BatchsweepError):
    """The Optuna storage cannot be opened, or stopped accepting writes."""


def is_storage_failure(exc: BaseException) -> bool:
    """Whether an exception came from the storage (Optuna's or SQLAlchemy's errors, a journal file's OSError)."""
    import sqlalchemy.exc

    return isinstance(exc, (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError, OSError))


def default_storage(root: str = "mlruns") -> str:
    return f"sqlite:///{Path(root).resolve()}/optuna.db"


def _heartbeat_failed(args: threading.ExceptHookArgs) -> None:
    """Optuna's heartbeat thread dies with a traceback when the storage refuses a write; one line instead (the
    worker's own loop stops the study in one line if the storage stays that way)."""
    if args.thread is not None and args.thread.name.endswith("(_record_heartbeat)"):
        print(f"warning: the Optuna storage refused the running trial's heartbeat ({args.exc_type.__name__}); "
              f"the trial goes on", file=sys.stderr)
        return
    threading.__excepthook__(args)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """SQLite, PostgreSQL or MySQL through Optuna's RDB storage, or `journal:PATH` for a journal file."""
    check_storage(url)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = url.removeprefix("journal:")
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(path))
        except OSError as exc:
            raise StorageError(f"cannot open the Optuna journal {path} ({exc.strerror}): make its folder "
                               f"writable or pass another --storage") from None
    scheme = url.split("://", 1)[0].split("+", 1)[0]
    connect = {"timeout": 60} if scheme == "sqlite" else {"connect_timeout": 3}  # a server that is down: an error in seconds
    if scheme == "sqlite":
        folder = sqlite_path(url).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the Optuna storage folder {folder} ({exc.strerror}): "
                               f"make it writable or pass --storage") from None
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeats are marked experimental; they have worked since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # Heartbeats let any worker fail a trial whose process died on another machine.
                return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect},
                                                  heartbeat_interval=30, grace_period=HEARTBEAT_GRACE_S)
        except Exception as exc:
            # Two machines starting at once both create the schema; the slower one finds it there next time.
            if "already exists" in str(exc) and attempt < 2:
                time.sleep(0.5 + random.random())
                continue
            raise StorageError(f"cannot open the Optuna storage {redact(url)} ({first_line(exc, url)}): check the "
                               f"URL and that the server runs") from None
    raise AssertionError("unreachable")


@dataclass
class Invocation:
    """What one invocation of a study runs: the study, its base configuration, seeds, stores and budget."""

    study: Study
    base: TrainConfig  # the study's fixed fields and the command line's overrides
    seeds: tuple[int, ...]
    study_name: str
    storage: str
    tracking_uri: str
    n_trials: int | None = None  # None: everything left
    fail_fast: bool = False
    system_metrics: bool = False  # MLflow's system metrics for every trial
    checkpoint_dir: str | None = None  # a folder per configuration beneath it (None: no checkpoints)
    log_models: str = "best"  # none | best | all: the models of this invocation's trials kept in MLflow
    launcher: str = "process"  # process: trials train in the worker; torchrun: each trial is a torchrun job

    def config(self, point: Point, seed: int) -> TrainConfig:
        if not self.study.auto_batch:
            return dataclasses.replace(self.base, **point, seed=seed)
        values = dict(point)
        target = values.pop("effective_batch")
        b = self.start_batch(target)
        return dataclasses.replace(self.base, **values, physical_batch=b, accum_steps=target // b, seed=seed,
                                   shrink_on_oom=True)

    def start_batch(self, target: int) -> int:
        """Where physical_batch = "auto" starts: the memory planner's b for the GPU's memory when a batch_memory
        study of this model and data is in the store, else b = B."""
        return start_batch(self.base, target, self.tracking_uri)

    def broken(self, config: TrainConfig) -> str | None:
        """The first of the study's constraints that a configuration breaks."""
        return next((c.text for c in self.study.constraints if not c.holds(config)), None)

    @functools.cached_property
    def dropped(self) -> list[tuple[Point, str]]:
        """Grid points that break a constraint: not run."""
        return [(p, why) for p in self.study.points if (why := self.broken(self.config(p, self.base.seed)))]

    @functools.cached_property
    def search(self) -> Search:
        dropped = [p for p, _ in self.dropped]
        return make_search(self.study, self.study_name, [p for p in self.study.points if p not in dropped],
                           self.seeds)

    def units(self) -> list[Unit]:
        return self.search.units()

    def study_names(self) -> list[str]:
        return self.search.study_names()


def create_studies(inv: Invocation, storage: optuna.storages.BaseStorage) -> None:
    """Create (or find) every Optuna study once, before any worker starts."""
    for name in inv.study_names():
        optuna.create_study(storage=storage, study_name=name, directions=list(inv.study.directions),
                            load_if_exists=True)


def owner() -> str:
    return f"{HOST}:{os.getpid()}"


def fail_orphans(study: optuna.Study, trials: list[optuna.trial.FrozenTrial]) -> int:
    """Mark RUNNING trials whose process is gone as FAIL, so their points run again: those of a dead process on
    this host (in this container), and those that never got an owner (a process killed between Optuna creating
    the trial and its first heartbeat, which Optuna's own check never fails) once older than the heartbeat's
    grace."""
    failed, now = 0, datetime.datetime.now()
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        host, _, pid = t.user_attrs.get("owner", "").rpartition(":")
        here = host == HOST and t.user_attrs.get("owner_processes", PROCESSES) == PROCESSES
        if here and not pid_alive(int(pid)) or (
                not pid and (now - t.datetime_start).total_seconds() > HEARTBEAT_GRACE_S):
            try:
                study.tell(t.number, state=TrialState.FAIL)
                failed += 1
            except (RuntimeError, ValueError):  # another worker got there first
                pass
    return failed


def free_dead_trials(inv: Invocation, storage) -> None:
    """Fail the RUNNING trials of processes that are gone: on this host, or silent past the heartbeat's grace."""
    for name in inv.study_names():
        study = optuna.load_study(study_name=name, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        fail_orphans(study, study.get_trials(deepcopy=False))


def remaining(inv: Invocation, storage) -> int:
    """Trials still to run in the whole study."""
    units = inv.units()
    return sum(inv.search.left(optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False),
                               [u for u in units if u.study_name == name], set())
               for name in inv.study_names())


@dataclass
class Hooks:
    """How a worker reports progress; the defaults stay silent."""

    trial_done: Callable[[optuna.trial.FrozenTrial], None] = lambda t: None
    trial_start: Callable[[str, int], None] = lambda name, epochs: None
    epoch_done: Callable[[dict[str, float]], None] = lambda row: None
    say: Callable[[str], None] = lambda line: None


class Worker:
    """One process's loop: claim a trial, train it, record it, until the budget or the study is done."""

    def __init__(self, inv: Invocation, parent_run_id: str, index: int = 0, hooks: Hooks | None = None):
        self.inv, self.parent_run_id, self.index = inv, parent_run_id, index
        self.hooks = hooks or Hooks()
        self.objective = make_objective(inv.study, inv.launcher)
        self.storage = open_storage(inv.storage)
        threading.excepthook = _heartbeat_failed
        self.tracker = Tracker(inv.tracking_uri, inv.study_name)
        self.device = device_name(resolve_device(inv.base.device))
        self.commit = git_commit()
        self._study: optuna.Study | None = None  # the study of the last objective call
        self._last_number = -1  # the trial number of the last objective call
        self._trial_raised = False  # whether the last trial's own code (training) raised, not the storage
        self.failed_here: set[str] = set()  # keys of the trials that failed in this process: not retried now
        self.storage_failures: list[str] = []  # consecutive failures of the storage, latest last
        self.datasets_logged: set[str] = set()  # digests logged as inputs of the parent run

    def run(self, budget: int | None) -> int:
        """Run at most `budget` trials (None: until nothing is left); returns how many ran. Every MLflow run
        it started is ended, whatever raised."""
        try:
            return self._run(budget)
        except KeyboardInterrupt:
            self._record_interrupted()
            raise
        finally:
            if self.tracker.open_runs:
                try:
                    for name in self.inv.search.study_names():
                        self._end_recorded(optuna.load_study(study_name=name, storage=self.storage)
                                           .get_trials(deepcopy=False))
                except Exception:  # the storage went away: what is still open ends KILLED
                    pass
            self.tracker.end_open_runs("KILLED")

    def _record_interrupted(self) -> None:
        """A Ctrl-C that lands in Optuna's own bookkeeping after the objective (its tell turns it into an
        UnboundLocalError) leaves the trial RUNNING: record it as if it had landed in training."""
        if self._study is None or self._last_number < 0:
            return
        try:
            trial = self._study.get_trials(deepcopy=False)[self._last_number]
            if trial.state != TrialState.RUNNING:
                return
            self.storage.set_trial_user_attr(trial._trial_id, "reason", "interrupted")
            self._study.tell(trial.number, state=TrialState.FAIL)
        except Exception:  # the storage went away: the next invocation fails the trial as its owner's is gone
            return
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id in self.tracker.open_runs:
            self.tracker.finish(run_id, OUTCOMES["interrupted"].status,
                                tags={"reason": "interrupted", "state": TrialState.FAIL.name})

    def _end_recorded(self, trials: list[optuna.trial.FrozenTrial]) -> None:
        """End the open runs of trials that Optuna has recorded finished: their end is skipped where reading the
        trial back failed, or failed itself, and a complete trial's run must not end KILLED."""
        for t in trials:
            run_id = t.user_attrs.get("mlflow_run_id")
            if run_id in self.tracker.open_runs and t.state.is_finished():
                self.tracker.end(run_id, "FINISHED" if t.state == TrialState.COMPLETE else "FAILED")

    def _run(self, budget: int | None) -> int:
        ran, search, units = 0, self.inv.search, self.inv.units()
        for i, name in enumerate(search.study_names()):
            study = optuna.load_study(study_name=name, storage=self.storage,
                                      pruner=search.pruner(self.inv.base.epochs))
            # Seeded by the trials already there too: a resumed search does not repeat its first draws.
            study.sampler = search.sampler(i, self.index, len(study.get_trials(deepcopy=False)))
            mine = [u for u in units if u.study_name == name]
            self.failed_here = set()
            self._study = study
            while budget is None or ran < budget:
                interrupt.check()  # one that something caught and turned into another error: no next trial
                try:
                    trials = study.get_trials(deepcopy=False)
                    if fail_orphans(study, trials):  # their points are free now
                        trials = study.get_trials(deepcopy=False)
                except Exception as exc:
                    self._storage_failed(exc)
                    continue
                self._end_recorded(trials)
                if not search.left(trials, mine, self.failed_here):
                    break
                self._last_number, self._trial_raised = -1, False
                try:
                    # optimize() (not ask/tell) so that the RDB storage's heartbeat covers the trial;
                    # it marks a trial that raises as FAIL before passing the exception on.
                    study.optimize(lambda trial: self.trial(trial, mine), n_trials=1)
                except StudyChanged:
                    raise  # every next trial would fail the same way: the study stops with one line
                except Exception as exc:
                    if interrupt.pending():  # Ctrl-C landed where Optuna turned it into another error
                        raise KeyboardInterrupt from None
                    if is_storage_failure(exc) and not self._trial_raised:
                        self._storage_failed(exc)
                        continue
                    line = f"trial {self._last_number} failed: {first_line(exc, self.inv.storage)}"
                    if self.inv.fail_fast:
                        raise BatchsweepError(f"{line} (stopped by --fail-fast)") from None
                    self.hooks.say(line)
                try:
                    last = study.get_trials(deepcopy=False)[self._last_number] if self._last_number >= 0 else None
                except Exception as exc:
                    self._storage_failed(exc)
                    continue
                self.storage_failures = []
                if last is None:
                    continue
                self._end_recorded([last])  # a trained trial, now recorded: its run ends
                if last.state == TrialState.FAIL:
                    self.failed_here.add(config_key(last.user_attrs.get("config", {})))
                if outcome_of(last) != OUTCOMES["duplicate"]:
                    ran += 1
                    self.hooks.trial_done(last)
                    try:
                        spare(self.inv, self.parent_run_id, self.storage, self.tracker)
                    except Exception as exc:  # checkpoints are removed at the end of the invocation anyway
                        self._storage_failed(exc)
        return ran

    def _storage_failed(self, exc: Exception) -> None:
        """Count a failure to read, create or record a trial; give up after a few in a row."""
        self.storage_failures.append(first_line(exc, self.inv.storage))
        if len(self.storage_failures) >= STORAGE_FAILURES:
            raise StorageError(
                f"the Optuna storage {redact(self.inv.storage)} stopped accepting writes "
                f"({self.storage_failures[-1]}), {STORAGE_FAILURES} times in a row: check that its server runs, or "
                f"that its folder and disk are writable, then run the same command again to resume (finished "
                f"trials are kept)")
        time.sleep(0.5 * len(self.storage_failures))

    def trial(self, trial: optuna.Trial, mine: list[Unit]) -> float | list[float]:
        """Optuna's objective: take a point, train it, return the objective's values."""
        self._last_number = trial.number
        trial.set_user_attr("owner", owner())
        trial.set_user_attr("owner_processes", PROCESSES)  # a container that shares the host name sees others
        try:
            point, seed = self.inv.search.next_point(trial, mine, self.failed_here, self.index)
        except Duplicate as exc:
            trial.set_user_attr("reason", "duplicate")
            raise optuna.TrialPruned(str(exc)) from None
        return self.run_trial(trial, point, seed)

    def run_trial(self, trial: optuna.Trial, point: Point, seed: int) -> float | list[float]:
        config = self.inv.config(point, seed)
        folder = folder_of(self.inv, config, trial.number) if self.inv.checkpoint_dir else None
        previous = resumes(folder) if folder else None
        tags = {"optuna.trial_number": trial.number, "optuna.study_name": trial.study.study_name,
                "device_name": self.device, "torch_version": torch.__version__, "study": self.inv.study.name,
                "batchsweep.resumes_run": previous, **standard_tags(self.commit)}
        run_id = self.tracker.start_trial(self.parent_run_id, f"{trial.number}: {describe(point)}",
                                          config.to_dict(), tags)
        history: list[dict[str, float]] = []
        prunes = self.inv.study.pruner != "none"

        def on_epoch(row: dict[str, float]) -> None:
            history.append(row)
            self.hooks.epoch_done(row)
            value = self.objective.epoch_value(row) if prunes else None
            if value is not None:
                trial.report(value, int(row["epoch"]))
                # A trial that trained its last epoch is complete: pruning it would throw its result away.
                if row["epoch"] < config.epochs and trial.should_prune():
                    raise optuna.TrialPruned(f"pruned at epoch {int(row['epoch'])}")

        def end(name: str, metrics: dict[str, float] | None = None, dataset: dict[str, Any] | None = None,
                **extra: Any) -> None:
            """Record the outcome: Optuna first (it decides whether the point runs again), then MLflow."""
            outcome = OUTCOMES[name]
            reason = None if name == "complete" else name
            try:
                # Optuna's constraint: TPE and NSGA-II leave the neighbourhood of a point that could not run.
                with warnings.catch_warnings():  # set already where a Ctrl-C lands while a result is recorded
                    warnings.filterwarnings("ignore", "The constraint value is ignored")
                    trial.set_constraint("infeasible", 1.0 if outcome.infeasible else 0.0)
                if reason:
                    trial.set_user_attr("reason", reason)
                if metrics:
                    trial.set_user_attr("metrics", {k: v for k, v in metrics.items() if math.isfinite(v)})
                if extra.get("health"):
                    trial.set_user_attr("health", extra["health"])
            finally:
                # A finished trial's run ends once Optuna has recorded it complete (see _run): a kill between
                # the two then leaves a run that the next invocation closes by the trial's state.
                error = self.tracker.finish(run_id, outcome.status, history=history, metrics=metrics,
                                            tags={"reason": reason, "state": outcome.state.name, **extra},
                                            end=name != "complete", dataset=dataset)
            if error:
                self.hooks.say(f"trial {trial.number} ({describe(point)}): trained, but recording it in MLflow "
                               f"failed ({error}); its result is kept in Optuna and its run is marked FAILED "
                               f"with reason record_error")

        try:
            trial.set_user_attr("mlflow_run_id", run_id)
            trial.set_user_attr("invocation", self.parent_run_id)
            if folder:
                claim(folder, run_id)
            self.hooks.trial_start(describe(point), config.epochs)
            broken = self.inv.broken(config)
            if broken:
                end("invalid", error=f"breaks the study's constraint {broken}")
                raise optuna.TrialPruned(f"breaks the constraint {broken}")
            monitor = system_metrics(run_id, self.inv.tracking_uri) if self.inv.system_metrics else None
            try:
                try:
                    trained = self.objective.train(config, on_epoch, Checkpointing(str(folder)) if folder else None)
                finally:
                    if monitor is not None:
                        monitor.finish()
                values = self.objective.values(trained.metrics) if trained.status == "ok" else None
            except optuna.TrialPruned:
                end("pruned", _final(history))
                raise
            except torch.OutOfMemoryError:
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                end("oom", _final(history))
                raise optuna.TrialPruned("out of memory") from None
            except ConfigError as exc:  # e.g. b*k larger than the training set: the point cannot run
                end("invalid", error=str(exc))
                self.hooks.say(f"trial {trial.number} ({describe(point)}): {exc}")
                raise optuna.TrialPruned(str(exc)) from None
            except Exception as exc:
                if interrupt.pending():  # a Ctrl-C that a library caught and replaced: the run was interrupted
                    raise KeyboardInterrupt from exc
                self._trial_raised = True
                end("error", error=f"{type(exc).__name__}: {exc}"[:5000])
                raise
            if trained.status == "diverged":
                end("diverged", trained.metrics, trained.dataset, **trained.health)
                raise optuna.TrialPruned("diverged: non-finite training loss")
            end("complete", trained.metrics, trained.dataset, memory_source=trained.memory_source,
                resumed_after_epoch=trained.resumed_after or None, **trained.health)
            if trained.dataset and trained.dataset["digest"] not in self.datasets_logged:
                # The parent run (the row the UI shows first) names the data its trials trained on, too.
                self.datasets_logged.add(trained.dataset["digest"])
                try:
                    self.tracker.log_dataset(self.parent_run_id, trained.dataset)
                except Exception:  # the trial is recorded; the parent's Dataset column is a convenience
                    pass
            return values[0] if len(values) == 1 else values
        except KeyboardInterrupt:  # wherever it lands, training or recording a result that Optuna now fails
            if run_id in self.tracker.open_runs:
                end("interrupted")
            raise
        except Exception:  # pruned and the like are ended already; a storage that refused a write is not
            if run_id in self.tracker.open_runs:
                self.tracker.end(run_id, "FAILED")
            raise


def _final(history: list[dict[str, float]]) -> dict[str, float] | None:
    return dict(history[-1]) if history else None
