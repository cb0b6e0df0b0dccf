"""Run a study: Optuna picks and records the trials, the trainer trains them, MLflow tracks them."""
from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import os
import random
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import optuna
import torch
from optuna.trial import TrialState

from trainers import ConfigError, TrainConfig, train
from trainers.config import BatchsweepError
from trainers.loop import device_name, resolve_device

from .studies import Point, Study, config_key, describe, point_key
from .tracking import HOST, Tracker, first_line, git_commit, pid_alive
from .urls import check_storage, redact, sqlite_path

FINAL = (TrialState.COMPLETE, TrialState.PRUNED)
RETRY_REASONS = ("duplicate",)  # a PRUNED trial with this reason did not run its point
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
class Plan:
    """What one invocation runs."""

    study: Study
    base: TrainConfig  # the study's fixed fields and the command line's overrides
    seeds: tuple[int, ...]
    study_name: str
    storage: str
    tracking_uri: str
    n_trials: int | None = None  # None: everything left
    fail_fast: bool = False

    def config(self, point: Point, seed: int) -> TrainConfig:
        return dataclasses.replace(self.base, **point, seed=seed)

    def units(self) -> list[tuple[str, Point, int]]:
        """(Optuna study name, point, seed): one Optuna study for a grid, one per point and seed when tuned."""
        # Each point's seeds follow each other, so that a partial run already has its error bars.
        if self.study.tune is None:
            return [(self.study_name, p, s) for p in self.study.points for s in self.seeds]
        return [(f"{self.study_name}/{point_key(p, s)}", p, s) for p in self.study.points for s in self.seeds]

    def study_names(self) -> list[str]:
        """The Optuna studies, in order, each once."""
        return list(dict.fromkeys(name for name, _, _ in self.units()))

    @property
    def direction(self) -> str:
        return "minimize" if self.study.kind == "equivalence" else "maximize"


def sampler_for(plan: Plan, unit: int, worker: int) -> optuna.samplers.BaseSampler:
    seed = plan.study.sampler_seed * 1000 + unit * 10 + worker  # workers must not repeat each other's draws
    if plan.study.tune is None:
        return optuna.samplers.RandomSampler(seed=seed)  # unused: grid values are fixed, see claim_point
    # Optuna 5 changed TPE's defaults; pin every setting that shapes the search.
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, n_ei_candidates=24, multivariate=False,
                                      group=False, constant_liar=False)


def pruner_for(plan: Plan) -> optuna.pruners.BasePruner:
    if plan.study.tune is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2)


def create_studies(plan: Plan, storage: optuna.storages.BaseStorage) -> None:
    """Create (or find) every Optuna study once, before any worker starts."""
    for name in plan.study_names():
        optuna.create_study(storage=storage, study_name=name, direction=plan.direction, load_if_exists=True)


def owner() -> str:
    return f"{HOST}:{os.getpid()}"


def fail_orphans(study: optuna.Study, trials: list[optuna.trial.FrozenTrial]) -> int:
    """Mark RUNNING trials whose process is gone as FAIL, so their points run again: those of a dead process on
    this host, and those that never got an owner (a process killed between Optuna creating the trial and its
    first heartbeat, which Optuna's own check never fails) once they are older than the heartbeat's grace."""
    failed, now = 0, datetime.datetime.now()
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        host, _, pid = t.user_attrs.get("owner", "").rpartition(":")
        if host == HOST and not pid_alive(int(pid)) or (
                not pid and (now - t.datetime_start).total_seconds() > HEARTBEAT_GRACE_S):
            try:
                study.tell(t.number, state=TrialState.FAIL)
                failed += 1
            except (RuntimeError, ValueError):  # another worker got there first
                pass
    return failed


def holds(t: optuna.trial.FrozenTrial) -> bool:
    """Whether a trial holds its point: running it, or done with it for good."""
    return t.state == TrialState.RUNNING or (t.state in FINAL and t.user_attrs.get("reason") not in RETRY_REASONS)


def taken_points(trials: list[optuna.trial.FrozenTrial], besides: int = -1) -> set[str]:
    return {config_key(t.user_attrs["config"]) for t in trials
            if "config" in t.user_attrs and t.number != besides and holds(t)}


def remaining(plan: Plan, storage) -> int:
    """Trials still to run in the whole study (grid points left, or tuning trials left)."""
    left = 0
    for name in plan.study_names():
        study = optuna.load_study(study_name=name, storage=storage)
        if plan.study.tune is None:
            keys = {point_key(p, s) for _, p, s in plan.units()}
            left += len(keys - taken_points(study.get_trials(deepcopy=False)))
        else:
            done = sum(1 for t in study.get_trials(deepcopy=False) if holds(t))
            left += max(plan.study.tune.trials_per_point - done, 0)
    return left


@dataclass
class Hooks:
    """How a worker reports progress; the defaults stay silent."""

    trial_done: Callable[[optuna.trial.FrozenTrial], None] = lambda t: None
    trial_start: Callable[[str, int], None] = lambda name, epochs: None
    epoch_done: Callable[[dict[str, float]], None] = lambda row: None
    say: Callable[[str], None] = lambda line: None


class Worker:
    """One process's loop: claim a trial, train it, record it, until the budget or the study is done."""

    def __init__(self, plan: Plan, parent_run_id: str, index: int = 0, hooks: Hooks | None = None):
        self.plan, self.parent_run_id, self.index = plan, parent_run_id, index
        self.hooks = hooks or Hooks()
        self.storage = open_storage(plan.storage)
        self.tracker = Tracker(plan.tracking_uri, plan.study_name)
        self.device = device_name(resolve_device(plan.base.device))
        self.commit = git_commit()
        self._last_number = -1  # the trial number of the last objective call
        self._trial_raised = False  # whether the last trial's own code (training) raised, not the storage
        self.failed_here: list[str] = []  # keys of the trials that failed in this process: not retried now
        self.storage_failures: list[str] = []  # consecutive failures of the storage, latest last

    def run(self, budget: int | None) -> int:
        """Run at most `budget` trials (None: until nothing is left); returns how many ran. Every MLflow run
        it started is ended, whatever raised."""
        try:
            return self._run(budget)
        finally:
            self.tracker.end_open_runs("KILLED")

    def _run(self, budget: int | None) -> int:
        ran = 0
        units = self.plan.units()
        for i, name in enumerate(self.plan.study_names()):
            study = optuna.load_study(study_name=name, storage=self.storage,
                                      sampler=sampler_for(self.plan, i, self.index), pruner=pruner_for(self.plan))
            mine = [(p, s) for n, p, s in units if n == name]
            self.failed_here = []
            while budget is None or ran < budget:
                try:
                    trials = study.get_trials(deepcopy=False)
                    fail_orphans(study, trials)
                except Exception as exc:
                    self._storage_failed(exc)
                    continue
                if not self._work_left(trials, mine):
                    break
                self._last_number, self._trial_raised = -1, False
                try:
                    # optimize() (not ask/tell) so that the RDB storage's heartbeat covers the trial;
                    # it marks a trial that raises as FAIL before passing the exception on.
                    study.optimize(lambda trial: self.objective(study, trial, mine), n_trials=1)
                except Exception as exc:
                    if is_storage_failure(exc) and not self._trial_raised:
                        self._storage_failed(exc)
                        continue
                    line = f"trial {self._last_number} failed: {first_line(exc, self.plan.storage)}"
                    if self.plan.fail_fast:
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
                run_id = last.user_attrs.get("mlflow_run_id")
                if run_id in self.tracker.open_runs:  # a trained trial, now recorded: its run ends
                    self.tracker.end(run_id, "FINISHED" if last.state == TrialState.COMPLETE else "FAILED")
                if last.state == TrialState.FAIL:
                    self.failed_here.append(config_key(last.user_attrs.get("config", {})))
                if last.user_attrs.get("reason") != "duplicate":
                    ran += 1
                    self.hooks.trial_done(last)
        return ran

    def _storage_failed(self, exc: Exception) -> None:
        """Count a failure to read, create or record a trial; give up after a few in a row."""
        self.storage_failures.append(first_line(exc, self.plan.storage))
        if len(self.storage_failures) >= STORAGE_FAILURES:
            raise StorageError(
                f"the Optuna storage {redact(self.plan.storage)} stopped accepting writes "
                f"({self.storage_failures[-1]}), {STORAGE_FAILURES} times in a row: check that its server runs, or "
                f"that its folder and disk are writable, then run the same command again to resume (finished "
                f"trials are kept)")
        time.sleep(0.5 * len(self.storage_failures))

    def _work_left(self, trials: list[optuna.trial.FrozenTrial], mine: list[tuple[Point, int]]) -> bool:
        if self.plan.study.tune is None:
            return bool({point_key(p, s) for p, s in mine} - taken_points(trials) - set(self.failed_here))
        tried = sum(1 for t in trials if holds(t)) + len(self.failed_here)
        return tried < self.plan.study.tune.trials_per_point

    def objective(self, study: optuna.Study, trial: optuna.Trial, mine: list[tuple[Point, int]]) -> float:
        self._last_number = trial.number
        trial.set_user_attr("owner", owner())
        if self.plan.study.tune is None:
            point, seed = self.claim_point(study, trial, mine)
        else:
            (point, seed), tune = mine[0], self.plan.study.tune
            point = {**point, tune.field: trial.suggest_float(tune.field, tune.low, tune.high, log=True)}
            trial.set_user_attr("config", {**point, "seed": seed})
        return self.run_trial(trial, point, seed)

    def claim_point(self, study: optuna.Study, trial: optuna.Trial,
                    mine: list[tuple[Point, int]]) -> tuple[Point, int]:
        """Take the next free grid point; yield it if another trial holds it too (no point runs twice)."""
        taken = taken_points(study.get_trials(deepcopy=False), besides=trial.number) | set(self.failed_here)
        free = [(p, s) for p, s in mine if point_key(p, s) not in taken]
        if free:
            point, seed = free[self.index % len(free)]
            # Grid values are chosen, not sampled: they are a user attribute, not Optuna params.
            trial.set_user_attr("config", {**point, "seed": seed})
            if point_key(point, seed) not in taken_points(study.get_trials(deepcopy=False), besides=trial.number):
                return point, seed  # checked after our claim is visible to the others
        trial.set_user_attr("reason", "duplicate")
        time.sleep(random.random() * 0.2)  # break the tie with a worker that claimed at the same moment
        raise optuna.TrialPruned("another trial holds this point")

    def run_trial(self, trial: optuna.Trial, point: Point, seed: int) -> float:
        config = self.plan.config(point, seed)
        tags = {"optuna.trial_number": trial.number, "optuna.study_name": trial.study.study_name,
                "device_name": self.device, "torch_version": torch.__version__, "git_commit": self.commit,
                "study": self.plan.study.name}
        run_id = self.tracker.start_trial(self.parent_run_id, f"{trial.number}: {describe(point)}",
                                          config.to_dict(), tags)
        try:
            trial.set_user_attr("mlflow_run_id", run_id)
        except Exception:
            self.tracker.end(run_id, "FAILED")
            raise
        self.hooks.trial_start(describe(point), config.epochs)
        history: list[dict[str, float]] = []
        tune = self.plan.study.tune

        def on_epoch(row: dict[str, float]) -> None:
            history.append(row)
            self.hooks.epoch_done(row)
            if tune is not None:
                trial.report(row["val_acc"] if math.isfinite(row["val_acc"]) else 0.0, int(row["epoch"]))
                # A trial that trained its last epoch is complete: pruning it would throw its result away.
                if row["epoch"] < config.epochs and trial.should_prune():
                    raise optuna.TrialPruned(f"pruned at epoch {int(row['epoch'])}")

        def end(status: str, reason: str | None, metrics: dict[str, float] | None = None, **extra: Any) -> None:
            state = {"FINISHED": "COMPLETE", "KILLED": "PRUNED" if reason == "pruned" else "FAIL"}.get(status, "FAIL")
            try:  # Optuna first: it decides whether the point runs again
                if reason:
                    trial.set_user_attr("reason", reason)
                if metrics:
                    trial.set_user_attr("metrics", {k: v for k, v in metrics.items() if math.isfinite(v)})
                if extra.get("health"):
                    trial.set_user_attr("health", extra["health"])
            finally:
                # A finished trial's run ends once Optuna has recorded it complete (see _run): a kill between
                # the two then leaves a run that the next invocation closes by the trial's state.
                error = self.tracker.finish(run_id, status, history=history, metrics=metrics,
                                            tags={"reason": reason, "state": state, **extra},
                                            end=status != "FINISHED")
            if error:
                self.hooks.say(f"trial {trial.number} ({describe(point)}): trained, but recording it in MLflow "
                               f"failed ({error}); its result is kept in Optuna and its run is marked FAILED "
                               f"with reason record_error")

        health: dict[str, Any] = {}  # verdict and warnings, for trials of one configuration
        try:
            if self.plan.study.kind == "equivalence":
                metrics, status, memory_source = self._equivalence(config, on_epoch)
            else:
                result = train(config, on_epoch=on_epoch)
                metrics, status, memory_source = result.metrics, result.status, result.memory_source
                health = {"health": result.health, "health_epoch": result.health_epoch,
                          "warnings": " | ".join(result.warnings) or None,
                          "noise_scale": "unavailable: accum_steps=1" if config.accum_steps == 1 else None}
        except optuna.TrialPruned:
            end("KILLED", "pruned", _final(history))
            raise
        except torch.OutOfMemoryError:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            end("FAILED", "oom", _final(history))
            raise optuna.TrialPruned("out of memory") from None
        except ConfigError as exc:  # e.g. b*k larger than the training set: the point cannot run
            end("FAILED", "invalid", error=str(exc))
            self.hooks.say(f"trial {trial.number} ({describe(point)}): {exc}")
            raise optuna.TrialPruned(str(exc)) from None
        except KeyboardInterrupt:
            end("KILLED", "interrupted")
            raise
        except Exception as exc:
            self._trial_raised = True
            end("FAILED", "error", error=f"{type(exc).__name__}: {exc}"[:5000])
            raise
        if status == "diverged":
            end("FAILED", "diverged", metrics, **health)
            raise optuna.TrialPruned("diverged: non-finite training loss")
        end("FINISHED", None, metrics, memory_source=memory_source, **health)
        return metrics["param_rel_diff" if self.plan.study.kind == "equivalence" else "val_acc"]

    def _equivalence(self, config: TrainConfig, on_epoch) -> tuple[dict[str, float], str, str]:
        """Train (b, k) and its true-batch twin (b*k, 1) from the same initial weights and compare; with
        BatchNorm also the ghost twin (b*k, 1, ghost_batch=b), which normalizes the same chunks of b, and that
        pair once more in float64: only if it agrees there is what remains in float32 rounding."""
        accum = train(config, on_epoch=on_epoch)
        true_config = dataclasses.replace(config, physical_batch=config.effective_batch, accum_steps=1)
        true = train(true_config)
        metrics = {**accum.metrics, "param_rel_diff": _rel_diff(accum.model, true.model),
                   "twin_val_acc": true.metrics["val_acc"], "acc_gap": accum.metrics["val_acc"] - true.metrics["val_acc"]}
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in accum.model.modules()):
            ghost_config = dataclasses.replace(true_config, ghost_batch=config.physical_batch)
            metrics["ghost_rel_diff"] = _rel_diff(accum.model, train(ghost_config).model)
            if config.dtype != "float64":
                in_f64 = [train(dataclasses.replace(c, dtype="float64")).model for c in (config, ghost_config)]
                metrics["ghost_rel_diff_fp64"] = _rel_diff(*in_f64)
        return metrics, "diverged" if "diverged" in (accum.status, true.status) else "ok", accum.memory_source


def _rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest relative difference between corresponding parameters."""
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))


def _final(history: list[dict[str, float]]) -> dict[str, float] | None:
    return dict(history[-1]) if history else None
