"""The audit's runs of the script: each one launched with the tracer inside, stopped after N optimizer steps, and
what it left (its trace and its weights) read back."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchsweep.trainers import BatchsweepError, TrainConfig

from ..launch import observed, program
from ..stores.urls import scrub

if TYPE_CHECKING:
    import torch

    from ..launch.observed import Step
    from ..stores.mlflow_store import Tracker

BATCHNORM = ("running_mean", "running_var", "num_batches_tracked")  # its statistics, not weights
REUSED = ("accumulated", "true batch", "one rank")  # made once, whichever step of the audit asks for them again
# Bytes of weights and windows' gradients each process of a run keeps after each of its first steps, from which a
# run to one of those steps is read instead of made: 16 steps of a model of 1M float32 parameters, 1 of 16M.
KEEP = 128 * 2 ** 20


class AuditError(BatchsweepError):
    """A script run of the audit that failed, or a study the audit cannot use."""


@dataclass
class ScriptRun:
    """One run of the script: where it stopped and what it left."""

    name: str
    b: int
    k: int
    max_steps: int
    lr: float
    epochs: int  # the {epochs} it was given: 1, or the study's where its schedule follows them
    nproc: int = 1  # the ranks it ran on ({world_size})
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the parameters the optimizer trains
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the rest of the state (BatchNorm's statistics)
    trace: observed.Trace | None = None
    steps: list[Step] = field(default_factory=list)  # the optimizer steps the tracer saw, in order
    folder: Path | None = None  # what the tracer wrote: start.pt, state.pt, grad-<s>.pt
    others: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # ranks above 0: their weights
    rank_traces: dict[int, observed.Trace] = field(default_factory=dict)  # every rank's, where it ran ranks

    @property
    def losses(self) -> list[float]:
        """Each step's loss: the sum of its backward() calls' losses (nan where a backward had no scalar)."""
        return [s.loss if s.loss is not None else float("nan") for s in self.steps]

    @property
    def lrs(self) -> list[float]:
        """Each step's LR (of the first param group); none where a group had no "lr"."""
        lrs = [s.lrs[0] if s.lrs else None for s in self.steps]
        return [] if None in lrs else lrs


class Auditor:
    """Runs the script with the study's values, one MLflow run each under the audit's parent run."""

    def __init__(self, study, config: TrainConfig, own: dict[str, Any], tracker: Tracker, parent: str,
                 folder: Path, epochs: int, nproc: int = 1):
        self.study, self.config, self.own, self.tracker, self.parent, self.folder = (
            study, config, own, tracker, parent, folder)
        self.nproc = nproc  # the ranks of the runs at (b, k) and (b*k, 1) ({world_size}); the one-rank run's is 1
        self.epochs = epochs  # the study's: what a schedule over {epochs} spans in its training
        self.bar = None  # _main's bar over the steps of the run being made (how many runs is not known ahead)
        self.runs: list[ScriptRun] = []

    def _cwd(self, values: dict) -> str | None:
        """Where the script runs: the study's cwd with its placeholders filled ("{trial_dir}": each run's own)."""
        cwd = self.study.program.folder(values)
        if cwd is not None:
            Path(cwd).mkdir(parents=True, exist_ok=True)
        return cwd

    def run(self, name: str, b: int, k: int, max_steps: int, nproc: int | None = None) -> ScriptRun:
        """The script at (b, k) on `nproc` ranks (default: the audit's), stopped by the tracer after `max_steps`
        optimizer steps (0: an epoch, or the script's own length where its command takes no {epochs}); an
        accumulated, true-batch or one-rank run made already with the config's epochs is not made again; a
        "repeat" run is made again on purpose."""
        nproc = nproc or self.nproc
        done = next((r for r in self.runs if name == r.name and name in REUSED and (r.b, r.k, r.nproc) == (b, k, nproc)
                     and r.epochs == self.config.epochs and
                     (r.max_steps == max_steps or r.max_steps == 0 and len(r.steps) == max_steps)), None)
        done = done or self.kept(name, b, k, max_steps, nproc)
        if done:
            return done
        config = dataclasses.replace(self.config, physical_batch=b, accum_steps=k, max_steps=max_steps)
        values = {**config.to_dict(), **self.own, "world_size": nproc}
        record = ScriptRun(name, b, k, max_steps, values["lr"], config.epochs, nproc,
                           folder=self.folder / str(len(self.runs)))
        record.folder.mkdir()
        state = record.folder / "own.pt"  # where a script that saves its weights for batchsweep puts them (unread)
        trial = record.folder / "trial"  # {trial_dir}: each run's own, as a trial's
        trial.mkdir()
        values["trial_dir"] = str(trial)
        over = f" of {config.epochs} epochs" if config.epochs > 1 else ""
        on = f" on {nproc} ranks" if nproc > 1 else ""
        run_id = self.tracker.start_trial(self.parent, f"{name}: b{b} k{k}{on} steps {max_steps}{over}",
                                          {"physical_batch": b, "accum_steps": k, "max_steps": max_steps,
                                           "epochs": config.epochs, "lr": values["lr"], "seed": config.seed,
                                           **({"nproc": nproc} if nproc > 1 else {})},
                                          {"audit.role": name})
        env = {"BATCHSWEEP_STATE": str(state), "BATCHSWEEP_TRIAL_DIR": str(trial),
               **program.handoff(self.tracker.uri, run_id, self.tracker.experiment_id),
               **self.study.program.environment(values)}
        env.update(observed.environment(record.folder, stop=max_steps, save=True, grads=(1, max_steps or "last"),
                                        keep=KEEP, losses=True, data=True, pythonpath=env.get("PYTHONPATH")))
        output = program.Output()
        self.started(record)
        try:
            ended = program.run(self.study.program.argv(values), env, self._cwd(values), None, output,
                                lambda row: self.read(row))
        finally:
            self.tracker.client.log_text(run_id, scrub(output.text(), self.tracker.uri), "log.txt")
            self.bar.refresh()  # the run's last step, however soon the next run starts
        if ended.code != 0:
            self.tracker.end(run_id, "FAILED")
            raise AuditError(f"the {name} run failed: {scrub(failure(ended, output), self.tracker.uri)}")
        trace = observed.read(record.folder)
        if trace is None or not (record.folder / "state.pt").exists():
            self.tracker.end(run_id, "FAILED")
            raise AuditError(f"the {name} run: {observed.unobservable(record.folder) or observed.UNSEEN}"
                             if trace is None else
                             f"the {name} run: the tracer saw optimizer steps but no module train (a model "
                             f"called in training mode with grad enabled), so it has no weights to compare" +
                             ("; the model is compiled in place (module.compile()), whose forwards run inside "
                              "the compiled graph where the tracer cannot see them: audit it without compiling, "
                              "or with torch.compile(model)" if trace.compiled else ""))
        self.bar.n = len(trace.steps)  # the rows a script prints (if any) stop one short where the tracer stopped it
        self.bar.refresh()
        read_back(record, trace)
        self.tracker.finish(run_id, "FINISHED", metrics={"steps": float(len(record.steps))})
        self.runs.append(record)
        return record

    def kept(self, name: str, b: int, k: int, max_steps: int, nproc: int) -> ScriptRun | None:
        """A run to step `max_steps` read from a longer one made with the same values, whose tracer kept the weights
        after that step and its window's gradient on every rank: what a run stopped there leaves, unless the command
        passes {max_steps} on (a script may plan its schedule over it); None where there is none."""
        if name not in REUSED or not max_steps or "max_steps" in self.study.program.placeholders():
            return None
        longer = next((r for r in self.runs if (r.name, r.b, r.k, r.nproc, r.epochs) ==
                       (name, b, k, nproc, self.config.epochs) and len(r.steps) > max_steps and
                       all((r.folder / f"state-{max_steps}{f'-r{rank}' if rank else ''}.pt").exists()
                           for rank in (0, *r.others))), None)
        if longer is None:
            return None
        record = ScriptRun(name, b, k, max_steps, longer.lr, longer.epochs, nproc, folder=longer.folder)
        read_back(record, longer.trace, after=max_steps)
        return record

    def started(self, record: ScriptRun) -> None:
        """One frame: the run's number, what it is, at step 0 of its max_steps (of an epoch: a count)."""
        from ..trials.driver import start_trial

        steps = f"to step {record.max_steps}" if record.max_steps else "an epoch"
        start_trial(self.bar, f"run {len(self.runs) + 1}: {record.name} b{record.b} k{record.k}, {steps}",
                    record.max_steps or None)

    def read(self, row: dict[str, float]) -> None:
        """A row the script printed: shown on the bar (what the audit compares comes from the tracer)."""
        from ..trials.driver import end_epoch

        if "loss" in row:
            end_epoch(self.bar, {"loss": f"{row['loss']:.4g}"})

    def start(self) -> ScriptRun:
        """The weights before the first update, as the tracer saved them in the first run (every run starts from
        them: the script is seeded alike, which the repeat run checks)."""
        import torch

        first = self.runs[0]
        state, buffers = split(torch.load(first.folder / "start.pt", map_location="cpu", weights_only=True),
                               first.trace.trained)
        return ScriptRun("start", first.b, first.k, 0, first.lr, first.epochs, state=state, buffers=buffers)


def failure(ended: program.Ended, output: program.Output) -> str:
    """The script's failure in one line; where ranks ran, the first rank's own error in it (torchrun ends with its
    report of the child that failed, whose last lines say nothing of why)."""
    said = program.failure(ended, output)
    why = next((line.strip() for line in output.lines if RANK_ERROR.match(line.strip())), None)
    return f"{said.split(':')[0]}: {why}" if why else said


RANK_ERROR = re.compile(r"\[rank\d+\]: \w+(Error|Exception)\b")


def read_back(record: ScriptRun, trace: observed.Trace, after: int = 0) -> None:
    """What the tracer left of a run: its steps, rank 0's weights (and the rest of its state), and on ranks each
    rank's trace and the weights of every rank above 0. `after`: of its first `after` steps alone, with the weights
    the tracer kept after that step (a run read from a longer one)."""
    import torch

    at = f"-{after}" if after else ""

    def weights_of(name: str) -> tuple[dict, dict]:
        return split(torch.load(record.folder / name, map_location="cpu", weights_only=True), trace.trained)

    def cut(t: observed.Trace) -> observed.Trace:  # (a run stopped after a step backwards nothing more)
        return dataclasses.replace(t, steps=t.steps[:after], dangling="") if after else t

    record.trace = cut(trace)
    record.steps = record.trace.steps
    record.state, record.buffers = weights_of(f"state{at}.pt")
    if record.nproc > 1:  # the windows compared are the ranks' together
        record.rank_traces = {rank: cut(t) for rank, t in observed.ranks(record.folder).items()}
        record.steps = observed.merged(record.rank_traces) or record.steps
        record.others = {rank: weights_of(f"state{at}-r{rank}.pt")[0] for rank in record.rank_traces
                         if rank and (record.folder / f"state{at}-r{rank}.pt").exists()}


def split(state: dict[str, torch.Tensor], trained: list[str] | None) -> tuple[dict, dict]:
    """(the weights: the parameters the optimizer trains, the rest): buffers are not weights, nor are frozen
    parameters. Without the tracer's list, every floating-point tensor but BatchNorm's statistics is a weight."""
    if trained is None:
        trained = [key for key, t in state.items() if t.is_floating_point() and not key.endswith(BATCHNORM)]
    keep = set(trained)
    return ({key: t for key, t in state.items() if key in keep},
            {key: t for key, t in state.items() if key not in keep})
