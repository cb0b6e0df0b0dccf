"""One trial from its point to its outcome: its MLflow run and checkpoint folder, its training, and how it ended,
recorded in Optuna first (Optuna decides whether the point runs again), then in MLflow, by the row of
sweeps/stores/outcomes.py that the ending maps to."""
from __future__ import annotations

import gc
import math
import warnings
from typing import Any, Callable

import optuna
import torch

from batchsweep.trainers import Checkpointing, ConfigError, interrupt

from .checkpoints import claim, folder_of, resumes
from .objective import TrialLink, Trained
from .places import FIX, Clash, Place, trials_folder
from ..launch.rows import index_of
from ..stores.outcomes import OUTCOMES
from ..study.spec import Point, describe
from ..gpus.placement import system_metrics
from ..stores.mlflow_store import first_line, standard_tags


class TrialFailed(Exception):
    """The trial's own code raised (not the storage): its error, recorded, is the cause."""


class TrialRun:
    """A worker's trial at its point: `run()` trains it and records the outcome; returns Optuna's values."""

    def __init__(self, worker, trial: optuna.Trial, point: Point, seed: int):
        self.worker, self.trial, self.point = worker, trial, point
        inv = worker.inv
        self.config, self.own = inv.config(point, seed), inv.own(point)
        self.folder = folder_of(inv, self.config, trial.number) if inv.checkpoint_dir else None
        self.name = describe(point) + (f" seed {seed}" if len(inv.seeds) > 1 else "")  # 'b32 k4 linear seed 1'
        program = inv.study.program
        # The epoch a trial ends at: a script not given {epochs} runs its own, which batchsweep cannot know.
        self.last_epoch = self.config.epochs if program is None or "epochs" in program.placeholders() else None
        tags = {"optuna.trial_number": trial.number, "optuna.study_name": trial.study.study_name,
                "device_name": worker.device, "torch_version": torch.__version__, "study": inv.study.name,
                "batchsweep.program": " ".join(program.command) if program else None,
                "batchsweep.resumes_run": resumes(self.folder) if self.folder else None,
                **standard_tags(worker.commit)}
        self.run_id = worker.tracker.start_trial(worker.parent_run_id, f"{trial.number}: {self.name}",
                                                 worker.objective.params(self.config, self.own), tags)
        self.history: list[dict[str, float]] = []
        self.in_run: tuple[str, ...] = ()  # metrics the run holds already (a script logged them itself)
        self.placed: dict[str, Any] = {}  # on a GPU: its placement (sweeps/gpus/placement.py), as tags
        self.begun = False
        self.shown = True  # its start and epochs move the worker's bar (in a fused group, its first member's)
        self.fused: int | None = None  # trained as one of a group of this many (sweeps/trials/group.py)

    def begin(self) -> None:
        """Its run and folder claimed, its start shown; a point that breaks a constraint ends invalid here."""
        if self.begun:
            return
        self.begun, worker = True, self.worker
        self.trial.set_user_attr("mlflow_run_id", self.run_id)
        self.trial.set_user_attr("invocation", worker.parent_run_id)
        if self.folder:
            claim(self.folder, self.run_id)
        if self.shown:
            worker.hooks.trial_start(self.name, self.last_epoch)
        broken = worker.inv.broken(self.config, self.own)
        if broken:
            self.end("invalid", error=f"breaks the study's constraint {broken}")
            raise optuna.TrialPruned(f"breaks the constraint {broken}")

    def run(self, trained: Callable[[], Trained] | None = None) -> float | list[float]:
        """Train (or take what `trained` returns or raises: a fused member's result) and record the outcome."""
        worker = self.worker
        try:
            self.begin()
            trained, values = self._train(trained)
            if trained.health.get("clash"):  # its result may be another trial's: recorded, not counted
                self.end("clash", trained.metrics, trained.dataset, memory_source=trained.memory_source,
                         error=f"Clash: {trained.health['clash']}: this trial's result may be the other's; {FIX}",
                         **trained.health)
                raise TrialFailed() from Clash(f"{trained.health['clash']}: its result may be the other's")
            if trained.status == "diverged":
                self.end("diverged", trained.metrics, trained.dataset, **trained.health)
                raise optuna.TrialPruned("diverged: non-finite training loss")
            self.end("complete", trained.metrics, trained.dataset, memory_source=trained.memory_source,
                     resumed_after_epoch=trained.resumed_after or None, **trained.health)
            worker.log_dataset(trained.dataset)
            return values[0] if len(values) == 1 else values
        except KeyboardInterrupt:  # wherever it lands, training or recording a result that Optuna now fails
            if self.run_id in worker.tracker.open_runs:
                self.end("interrupted")
            raise
        except Exception:  # pruned and the like are ended already; a storage that refused a write is not
            if self.run_id in worker.tracker.open_runs:
                worker.tracker.end(self.run_id, "FAILED")
            raise

    def _train(self, given: Callable[[], Trained] | None = None) -> tuple[Trained, list[float] | None]:
        """Train, and map what stopped the training to its outcome."""
        worker, inv = self.worker, self.worker.inv
        placed_on = worker.placement.gpu.uuid if worker.placement else ""
        # (a fused member's samples are its group's, from the group's one monitor: sweeps/trials/group.py)
        monitor = system_metrics(self.run_id, inv.tracking_uri, placed_on) if inv.system_metrics and not given \
            else None
        urls = [v for v in self.own.values() if isinstance(v, str) and "://" in v]  # the study's own, too
        link = TrialLink(self.run_id, worker.tracker.experiment_id, inv.tracking_uri, self.own, self.report,
                         (inv.storage, inv.tracking_uri, *urls), self._place() if inv.study.program else None)

        def train() -> Trained:
            return worker.objective.train(self.config, self.on_epoch,
                                          Checkpointing(str(self.folder)) if self.folder else None, link)

        trained = None
        try:
            try:
                if given is not None:
                    trained = given()
                elif worker.placement is None:
                    trained = train()
                else:  # run again alone after an out-of-memory beside other trials: its rows come again too
                    trained = worker.placement.run(self.config, worker.objective.widest(self.config), train,
                                                   self.history.clear, self.placed)
            finally:
                if monitor is not None:
                    monitor.finish()
            self.in_run = trained.in_run
            return trained, worker.objective.values(trained.metrics) if trained.status == "ok" else None
        except optuna.TrialPruned:
            self.end("pruned", self._final())
            raise
        except torch.OutOfMemoryError as exc:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            metrics, tags = self._measured(trained or getattr(exc, "trained", None))
            self.end("oom", metrics, error=first_line(exc, inv.storage, inv.tracking_uri), **tags)
            raise optuna.TrialPruned("out of memory") from None
        except ConfigError as exc:  # e.g. b*k larger than the training set: the point cannot run
            self.end("invalid", error=exc.problem)
            worker.hooks.say(f"trial {self.trial.number} ({self.name}): {exc.problem}: skipped as invalid")
            raise optuna.TrialPruned(str(exc)) from None
        except Exception as exc:
            if interrupt.pending():  # a Ctrl-C that a library caught and replaced: the run was interrupted
                raise KeyboardInterrupt from exc
            metrics, tags = self._measured(trained or getattr(exc, "trained", None))  # (MetricMissing: trained)
            self.end("error", metrics, error=f"{type(exc).__name__}: {exc}"[:5000], **tags)
            raise TrialFailed() from exc

    def on_epoch(self, row: dict[str, float]) -> None:
        """Each epoch's row as it ends (or a script's row at a step): kept for the run's history, and reported
        to Optuna's pruner."""
        self.history.append(row)
        if "epoch" in row and self.shown:
            self.worker.hooks.epoch_done(row)
        self.report(row)

    def report(self, row: dict[str, float]) -> None:
        """A row's value to Optuna's pruner, at its epoch (or step); raises TrialPruned where it prunes."""
        value = self.worker.objective.epoch_value(row) if self.worker.inv.study.pruner != "none" else None
        if value is None:
            return
        where = index_of(row)  # (a row within an epoch at its step; Optuna ignored a second value at int(1.5))
        if where is None:  # a fraction of an epoch without a step: no place among the epochs (launch/rows.py)
            return
        self.trial.report(value, where[1])
        # A trial that trained its last epoch is complete: pruning it would throw its result away.
        last = self.last_epoch is not None and row.get("epoch", 0) >= self.last_epoch
        if not last and self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at {where[0]} {where[1]}")

    def end(self, name: str, metrics: dict[str, float] | None = None, dataset: dict[str, Any] | None = None,
            **extra: Any) -> None:
        """Record the outcome: Optuna first (it decides whether the point runs again), then MLflow."""
        outcome, trial = OUTCOMES[name], self.trial
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
            if extra.get("config_mismatch"):  # a script that did not run as asked: the table marks it
                trial.set_user_attr("config_mismatch", extra["config_mismatch"])
            if extra.get("clash"):  # the end of the study names the file
                trial.set_user_attr("clash", extra["clash"])
            if extra.get("error"):  # (as the MLflow tag: also where Optuna's own tools show a trial)
                trial.set_user_attr("error", extra["error"])
        finally:
            # A finished trial's run ends once Optuna has recorded it complete (see Worker): a kill between the
            # two then leaves a run that the next invocation closes by the trial's state.
            logged = {k: v for k, v in metrics.items() if k not in self.in_run} if metrics else metrics
            history = self.worker.objective.history(self.history)
            group = "group" if self.fused and self.worker.inv.system_metrics else None  # whose samples it holds
            error = self.worker.tracker.finish(self.run_id, outcome.status, history=history, metrics=logged,
                                               tags={"reason": reason, "state": outcome.state.name, **self.placed,
                                                     "fused_members": self.fused, "system_metrics_of": group,
                                                     **extra},
                                               end=name != "complete", dataset=dataset)
        if error:
            self.worker.hooks.say(f"trial {trial.number} ({self.name}): trained, but recording it in "
                                  f"MLflow failed ({error}); its result is kept in Optuna and its run is marked "
                                  f"FAILED with reason record_error")

    def _place(self) -> Place:
        """A [program] trial's own folder: its number, under a study of several searches its search's too."""
        names = self.worker.inv.study_names()
        name = self.trial.study.study_name
        number = f"{names.index(name)}-{self.trial.number}" if len(names) > 1 else str(self.trial.number)
        return Place(trials_folder(self.worker.inv.tracking_uri, self.worker.inv.study_name), number)

    def _final(self) -> dict[str, float] | None:
        return dict(self.history[-1]) if self.history else None

    def _measured(self, trained: Trained | None) -> tuple[dict[str, float] | None, dict[str, Any]]:
        """A failed trial's metrics and tags: its last row, and what was measured of it where it trained."""
        if trained is None:
            return self._final(), {}
        return {**(self._final() or {}), **trained.metrics}, {"memory_source": trained.memory_source,
                                                              **trained.health}
