"""A worker: Optuna picks and records the trials, the objective trains them, MLflow tracks them."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from batchsweep.trainers import BatchsweepError, device_name, interrupt, resolve_device

from .checkpoints import Cleanup
from .group import GROUP_TIMES, Group
from .invocation import Invocation
from .objective import make_objective
from ..stores.outcomes import INTERRUPTED, OUTCOMES, outcome_of
from ..gpus.placement import Placement
from ..launch.program import machine
from .record import TrialFailed, TrialRun
from ..study.search import Duplicate, StudyChanged, Unit
from ..stores.optuna_store import StorageError, fail_orphans, heartbeat_failed, is_storage_failure, open_storage, owner
from ..study.spec import config_key
from ..stores.mlflow_store import PROCESSES, Tracker, first_line, git_commit
from ..stores.urls import redact

# Consecutive failures to read, create or record a trial in the Optuna storage before a worker gives up: a
# storage that stopped accepting writes (a folder turned read-only, a database server that went down) would
# otherwise fail every next trial forever.
STORAGE_FAILURES = 3


@dataclass
class Progress:
    """How a worker reports progress; the defaults stay silent."""

    trial_done: Callable[[optuna.trial.FrozenTrial], None] = lambda t: None
    trial_start: Callable[[str, int | None], None] = lambda name, epochs: None
    epoch_done: Callable[[dict[str, float]], None] = lambda row: None
    say: Callable[[str], None] = lambda line: None


class Worker:
    """One process's loop: claim a trial, train it, record it, until the budget or the study is done."""

    def __init__(self, inv: Invocation, parent_run_id: str, index: int = 0, hooks: Progress | None = None,
                 placement: Placement | None = None):
        self.inv, self.parent_run_id, self.index = inv, parent_run_id, index
        self.hooks = hooks or Progress()
        self.placement = placement  # its GPU and the ledger of the machine's GPUs; None: trains where it is
        self.objective = make_objective(inv.study, inv.launcher)
        self.storage = open_storage(inv.storage)
        threading.excepthook = heartbeat_failed
        self.tracker = Tracker(inv.tracking_uri, inv.study_name)
        # A [program] trains where its script puts it: the machine's GPUs, or its CPU.
        self.device = machine() if inv.study.program else device_name(resolve_device(inv.base.device))
        self.commit = git_commit()
        self._study: optuna.Study | None = None  # the study of the last objective call
        self._last_number = -1  # the trial number of the last objective call
        self.failed_here: set[str] = set()  # keys of the trials that failed in this process: not retried now
        self.storage_failures: list[str] = []  # consecutive failures of the storage, latest last
        self.datasets_logged: set[str] = set()  # digests logged as inputs of the parent run
        self.cleanup = Cleanup(inv, self.storage, self.tracker)
        # Trials train as fused groups where they can (sweeps/trials/group.py), on a GPU holding the sum of the
        # members' predicted peaks.
        self.fuses = inv.fuse and inv.study.fuse and self.objective.fuses() \
            and not set(inv.study.metrics) & set(GROUP_TIMES)  # (an objective of time: a member's is not its own)
        self.said: set[str] = set()  # why groups trained alone, said once

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
            self.storage.set_trial_user_attr(trial._trial_id, "reason", INTERRUPTED.name)
            self._study.tell(trial.number, state=INTERRUPTED.state)
        except Exception:  # the storage went away: the next invocation fails the trial as its owner's is gone
            return
        run_id = trial.user_attrs.get("mlflow_run_id")
        if run_id in self.tracker.open_runs:
            self.tracker.finish(run_id, INTERRUPTED.status,
                                tags={"reason": INTERRUPTED.name, "state": INTERRUPTED.state.name})

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
            study.sampler = search.sampler(i, self.index, len(study.get_trials(deepcopy=False)), liar=self.fuses)
            mine = [u for u in units if u.study_name == name]
            self.failed_here = set()
            self._study = study
            group = Group(self, study, mine) if self.fuses else None
            trials = None  # as read after the last trial: the next one starts from that read
            while budget is None or ran < budget:
                interrupt.check()  # one that something caught and turned into another error: no next trial
                try:
                    trials = study.get_trials(deepcopy=False) if trials is None else trials
                    if fail_orphans(study, trials):  # their points are free now
                        trials = study.get_trials(deepcopy=False)
                except Exception as exc:
                    trials = None
                    self._storage_failed(exc)
                    continue
                self._end_recorded(trials)
                # A point that clashed in this invocation, in any worker, would clash again beside the same trials.
                self.failed_here |= {config_key(t.user_attrs.get("config", {})) for t in trials
                                     if t.user_attrs.get("reason") == "clash"
                                     and t.user_attrs.get("invocation") == self.parent_run_id}
                if not search.left(trials, mine, self.failed_here):
                    break
                trials = None
                if group is not None:
                    numbers = self._group(group, None if budget is None else budget - ran)
                elif self._one_trial(study, mine):
                    numbers = [self._last_number]
                else:
                    continue
                try:
                    trials = study.get_trials(deepcopy=False)
                except Exception as exc:
                    self._storage_failed(exc)
                    continue
                ran += sum(self._recorded(trials, number) for number in numbers)
        return ran

    def _one_trial(self, study: optuna.Study, mine: list[Unit]) -> bool:
        """Claim, train and record one trial; False where the storage failed and nothing is to be read back."""
        self._last_number = -1
        try:
            # optimize() (not ask/tell) so that the RDB storage's heartbeat covers the trial;
            # it marks a trial that raises as FAIL before passing the exception on. A stop waits until the
            # objective has given the new trial its owner (trial() releases it).
            interrupt.hold()
            study.optimize(lambda trial: self.trial(trial, mine), n_trials=1)
        except Exception as exc:
            return self.trial_failed(exc, self._last_number)
        finally:
            interrupt.release()  # (where the objective never ran)
        return True

    def _group(self, group: Group, most: int | None) -> list[int]:
        """Claim, train and record a fused group; the trial numbers it told (none where the storage failed)."""
        self._last_number = -1  # (a stop is recorded by the group itself)
        try:
            return group.run(most)
        except BatchsweepError:  # --fail-fast, a changed study, a storage that stopped: the study stops
            raise
        except Exception as exc:
            self.trial_failed(exc, -1)
            return group.told

    def trial_failed(self, exc: Exception, number: int) -> bool:
        """A trial that raised: one line (or the stop of --fail-fast); False where the storage failed."""
        if isinstance(exc, StudyChanged):
            raise exc  # every next trial would fail the same way: the study stops with one line
        if interrupt.pending():  # Ctrl-C landed where Optuna turned it into another error
            raise KeyboardInterrupt from None
        if is_storage_failure(exc) and not isinstance(exc, TrialFailed):
            self._storage_failed(exc)
            return False
        cause = exc.__cause__ if isinstance(exc, TrialFailed) else exc
        line = f"{f'trial {number}' if number >= 0 else 'a fused group'} failed: {first_line(cause, self.inv.storage)}"
        if self.inv.fail_fast:
            raise BatchsweepError(f"{line} (stopped by --fail-fast)") from None
        self.hooks.say(line)
        return True

    def _recorded(self, trials: list[optuna.trial.FrozenTrial], number: int) -> int:
        """After a trial, with the study's trials read back: end its run, count it (1) unless it yielded its
        point to another trial (0), and remove the checkpoints that no longer serve."""
        self.storage_failures = []
        if number < 0:
            return 0
        last = trials[number]
        self._end_recorded([last])  # a trained trial, now recorded: its run ends
        if last.state == TrialState.FAIL:
            self.failed_here.add(config_key(last.user_attrs.get("config", {})))
        if outcome_of(last) == OUTCOMES["duplicate"]:
            return 0
        self.hooks.trial_done(last)
        try:
            self.cleanup.spare(self.parent_run_id, trials if len(self.inv.search.study_names()) == 1 else None)
        except Exception as exc:  # checkpoints are removed at the end of the invocation anyway
            self._storage_failed(exc)
        return 1

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
        """Optuna's objective: take a point, train it, return the objective's values. A stop that lands before the
        trial's run exists leaves Optuna to fail the trial: its reason says it was interrupted, not an error."""
        self._last_number = trial.number
        try:
            trial.set_user_attr("owner", owner())
            trial.set_user_attr("owner_processes", PROCESSES)  # a container that shares the host name sees others
            interrupt.release()  # a stop held since the ask lands now, on a trial with its owner
            try:
                point, seed = self.inv.search.next_point(trial, mine, self.failed_here, self.index)
            except Duplicate as exc:
                trial.set_user_attr("reason", "duplicate")
                raise optuna.TrialPruned(str(exc)) from None
            return TrialRun(self, trial, point, seed).run()
        except KeyboardInterrupt:
            if "reason" not in trial.user_attrs:  # (once its run exists, the trial's record says it)
                trial.set_user_attr("reason", INTERRUPTED.name)
            raise

    def log_dataset(self, dataset: dict[str, Any]) -> None:
        """The parent run (the row the UI shows first) names the data its trials trained on, too: once each."""
        if not dataset or dataset["digest"] in self.datasets_logged:
            return
        self.datasets_logged.add(dataset["digest"])
        try:
            self.tracker.log_dataset(self.parent_run_id, dataset)
        except Exception:  # the trial is recorded; the parent's Dataset column is a convenience
            pass
