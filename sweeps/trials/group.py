"""Fused groups: a worker's pending trials whose configurations share `group_key` (the model, the data, b, the seed,
the epochs...) train as one through trainers/fused.py. Each member stays a trial in every other way: its own
Optuna trial (asked and told here, with its heartbeat), its own MLflow run, history, checkpoint and outcome,
recorded by TrialRun as a solo trial is, with the tag `fused_members` beside. A member that the pruner stops or
that diverges ends alone; the others go on. A group that cannot train as one trains its members alone, after
one line saying why."""
from __future__ import annotations

import warnings
from typing import Callable

import optuna
import torch
from optuna.storages._heartbeat import get_heartbeat_thread  # what study.optimize runs around each trial
from optuna.trial import TrialState

from batchsweep.trainers import Checkpointing, NotFusable, format_bytes, group_key, interrupt, load, train_fused

from .objective import Trained
from .record import TrialRun
from ..gpus.placement import system_metrics
from ..stores.mlflow_store import PROCESSES
from ..stores.optuna_store import owner
from ..study.search import Duplicate, Unit

MAX_MEMBERS = 32  # a grid's group's members at most: their stacked weights and activations are held at once
# A sampler's group at most: TPE's first 4 trials are its random start-up, and each later group then draws from
# the trials before it (with the running ones taken as bad: its constant liar), not all blind at once.
SAMPLED_MEMBERS = 4
# A member's training time is the group's (its own alone was not measured): recorded under these names, so that
# nothing reads it as the member's own (the report's times to a target, its throughput figure).
GROUP_TIMES = {"epoch_time_s": "group_epoch_time_s", "samples_per_s": "group_samples_per_s",
               "wall_time_s": "group_wall_time_s"}


class Group:
    """One worker's fused groups of one Optuna study: `run` claims the next group, trains and records it."""

    def __init__(self, worker, study: optuna.Study, mine: list[Unit]):
        self.worker, self.study = worker, study
        inv = worker.inv
        self.keys = {u.key: group_key(inv.config(u.point, u.seed)) for u in mine}
        self.mine = mine
        self.told: list[int] = []  # the trial numbers of the last group, told to Optuna
        self.beats: list = []

    def run(self, most: int | None) -> list[int]:
        """Claim up to `most` trials (None: as many as the group holds), train them and record them; returns their
        trial numbers. A trial whose recording failed on the storage raises that failure once the others are told."""
        self.told, self.beats = [], []
        members: list[TrialRun] = []
        try:
            inv = self.worker.inv
            # Its share of what is left: at the end of a study, a last group split between the workers keeps
            # every core busy, rather than one worker training it while the others wait.
            share = -(-inv.search.left(self.study.get_trials(deepcopy=False), self.mine, self.worker.failed_here)
                      // inv.workers)
            first = self._claim(self.mine)
            if first is not None:
                members.append(first)
                key = group_key(first.config)
                same = [u for u in self.mine if key is not None and self.keys[u.key] == key]
                if most is not None and self.worker.inv.study.sampler == "grid":
                    same = self._within(same, most - 1)
                most_here = MAX_MEMBERS if inv.study.sampler == "grid" else SAMPLED_MEMBERS
                cap = min(most_here, most or most_here, max(share, 1))
                while same and len(members) < cap and self.worker.inv.search.left(
                        self.study.get_trials(deepcopy=False), same, self.worker.failed_here):
                    member = self._claim(same)
                    if member is not None:
                        members.append(member)
            self._train(members)
        except BaseException:  # a stop, or --fail-fast at a member: the members not recorded yet run again later
            for member in members:
                if member.trial.number not in self.told:
                    if member.run_id in self.worker.tracker.open_runs:
                        member.end("interrupted")
                    self._tell(member, state=TrialState.FAIL)
            raise
        finally:
            for beat in self.beats:
                beat.join()
        return self.told

    def _within(self, same: list[Unit], most: int) -> list[Unit]:
        """Those of `same` among the next `most` free points in the grid's order: a budget (--n-trials) runs the
        points a solo run would (each point's seeds in turn), not every point of one seed first."""
        taken = self.worker.inv.search.taken(self.study.get_trials(deepcopy=False)) | self.worker.failed_here
        window = {u.key for u in [u for u in self.mine if u.key not in taken][:most]}
        return [u for u in same if u.key in window]

    def _claim(self, units: list[Unit]) -> TrialRun | None:
        """Ask Optuna for a trial and take the next free point among `units` (None: another trial holds it)."""
        worker = self.worker
        interrupt.hold()  # a stop waits until the new trial has its owner, then lands where it is recorded
        try:
            with warnings.catch_warnings():  # Optuna's note that heartbeats are meant for optimize(): we run it here
                warnings.filterwarnings("ignore", "Heartbeat of storage")
                trial = self.study.ask()
            beat = get_heartbeat_thread(trial._trial_id, worker.storage)
            beat.start()
            self.beats.append(beat)
            trial.set_user_attr("owner", owner())
            trial.set_user_attr("owner_processes", PROCESSES)
        except BaseException:
            interrupt.release()
            raise
        try:
            interrupt.release()
            point, seed = worker.inv.search.next_point(trial, units, worker.failed_here, worker.index)
        except Duplicate:
            trial.set_user_attr("reason", "duplicate")
            self.study.tell(trial, state=TrialState.PRUNED)
            self.told.append(trial.number)
            return None
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                trial.set_user_attr("reason", "interrupted")
            self.study.tell(trial, state=TrialState.FAIL)
            raise
        return TrialRun(worker, trial, point, seed)

    def _train(self, members: list[TrialRun]) -> None:
        """Begin each member (an invalid one ends there), train those left as one, record each."""
        for member in members:
            member.shown = len(members) == 1
            self._settle(member, member.begin, tell=False)
        live = [m for m in members if m.trial.number not in self.told]
        key = group_key(live[0].config) if live else None
        apart = [m for m in live if group_key(m.config) != key]  # (a sampler's draw of b, say)
        live = [m for m in live if m not in apart]
        for member in apart + (live if len(live) < 2 else []):
            self._alone(member)
        if len(live) < 2:
            return
        results = self._fused(live)
        for member, result in zip(live, results or [None] * len(live)):
            if results is None:  # trained alone, each as a solo trial (from its checkpoint, where the group wrote one)
                member.history.clear()
                self._alone(member)
            else:
                member.fused = len(live)
                self._settle(member, lambda m=member, r=result: m.run(lambda: self._trained(m, r)))

    def _alone(self, member: TrialRun) -> None:
        if not member.shown:
            member.shown = True
            self.worker.hooks.trial_start(member.name, member.last_epoch)
        self._settle(member, member.run)

    def _fused(self, live: list[TrialRun]) -> list | None:
        """The members trained as one (each its TrainResult, or what its own epoch raised); None where they must
        train alone (one line says why, unless each member's own run will say it)."""
        worker = self.worker
        worker.hooks.trial_start(f"{live[0].name} +{len(live) - 1} fused", live[0].last_epoch)
        shown: set[int] = set()

        def callback(member: TrialRun) -> Callable[[dict[str, float]], None]:
            def on_epoch(row: dict[str, float]) -> None:
                if row.get("epoch") not in shown:  # the worker's bar moves once an epoch
                    shown.add(row.get("epoch"))
                    worker.hooks.epoch_done(row)
                member.on_epoch(group_times(row))
            return on_epoch

        configs = [m.config for m in live]

        def train() -> list:
            return train_fused(configs, [callback(m) for m in live], data=load(configs[0]),
                               checkpoints=[Checkpointing(str(m.folder)) if m.folder else None for m in live])

        # With --system-metrics, one monitor for the group: its samples, the group's, go to every member's run.
        monitor = system_metrics(live[0].run_id, worker.inv.tracking_uri,
                                 worker.placement.gpu.uuid if worker.placement else "",
                                 [m.run_id for m in live[1:]]) if worker.inv.system_metrics else None
        try:
            if worker.placement is None:
                return train()
            return self._placed(live, train, shown)
        except NotFusable as exc:
            self._say(f"trials {', '.join(str(m.trial.number) for m in live)} train alone: {exc}")
        except Exception as exc:  # a member that cannot run (b*k above the data, say) records it alone
            if interrupt.pending():  # a Ctrl-C that a library caught and replaced: the group was interrupted
                raise KeyboardInterrupt from exc
            if any(m.history for m in live):
                self._say(f"trials {', '.join(str(m.trial.number) for m in live)} train alone: the group raised "
                          f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        finally:
            if monitor is not None:
                monitor.finish()
        return None

    def _placed(self, live: list[TrialRun], train: Callable[[], list], shown: set) -> list | None:
        """On a GPU: the group holds the sum of its members' predicted peaks (their stacked weights, optimizer
        states and activations are each member's own, held at once). A group that does not fit the GPU, or runs
        out of memory even alone on it, trains its members alone (None), each then placed as a solo trial."""
        placement = self.worker.placement
        needs = [placement.need(m.config, self.worker.objective.widest(m.config))[0] for m in live]
        numbers = ", ".join(str(m.trial.number) for m in live)
        if sum(needs) > placement.capacity:
            self._say(f"trials {numbers} train alone: fused they would need {format_bytes(sum(needs))}, more than "
                      f"the {format_bytes(placement.capacity)} this GPU offers")
            return None
        tags: dict = {}

        def again() -> None:  # (an out-of-memory beside other trials: the members' rows come again, alone)
            shown.clear()
            for member in live:
                member.history.clear()

        try:
            results = placement.run(live[0].config, 0, train, again, tags, need=sum(needs))
        except torch.OutOfMemoryError:
            again()
            self._say(f"trials {numbers} train alone: fused, they ran out of memory alone on the GPU")
            return None
        for member, need in zip(live, needs):
            member.placed.update(tags, gpu_memory_held_bytes=need, group_gpu_memory_held_bytes=tags[
                "gpu_memory_held_bytes"])
        return results

    def _trained(self, member: TrialRun, result) -> Trained:
        if isinstance(result, BaseException):
            raise result
        trained = self.worker.objective.trained(member.config, result.to_dict())
        trained.metrics = group_times(trained.metrics)
        return trained

    def _settle(self, member: TrialRun, work: Callable, tell: bool = True) -> None:
        """Run a member's step; tell Optuna how it ended where it ended (a finished `work`, pruned, or raised)."""
        try:
            values = work()
        except optuna.TrialPruned:
            return self._tell(member, state=TrialState.PRUNED)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            self._tell(member, state=TrialState.FAIL)
            self.worker.trial_failed(exc, member.trial.number)
            return None
        if tell:
            self._tell(member, values=values)

    def _tell(self, member: TrialRun, **how) -> None:
        if member.trial.number in self.told:
            return
        self.told.append(member.trial.number)
        self.study.tell(member.trial, **how)

    def _say(self, line: str) -> None:
        why = line.partition(": ")[2]
        if why not in self.worker.said:  # once a worker: each next group would say the same
            self.worker.said.add(why)
            self.worker.hooks.say(line)


def group_times(row: dict[str, float]) -> dict[str, float]:
    return {GROUP_TIMES.get(name, name): value for name, value in row.items()}
