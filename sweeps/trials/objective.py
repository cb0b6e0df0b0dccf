"""Objectives: what a trial trains and the values it returns to Optuna, one class per [objective] kind."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import difflib

import torch
from mlflow import MlflowClient

from batchsweep.trainers import METRICS, BatchsweepError, Checkpointing, ConfigError, TrainConfig, train

from ..launch import observed, program, torchrun
from ..launch.rows import Output, place
from .places import Place, clash_sentence
from ..study.spec import Study
from ..stores.urls import scrub


class MetricMissing(BatchsweepError):
    """A study's objective names a metric that the trial did not log."""


@dataclass
class Trained:
    metrics: dict[str, float]
    status: str  # "ok" or "diverged"
    memory_source: str
    health: dict[str, Any] = field(default_factory=dict)  # verdict and warnings, as MLflow tags
    dataset: dict[str, Any] = field(default_factory=dict)  # name, digest and sizes of what it trained on
    resumed_after: int = 0  # the epoch of the checkpoint it went on from
    in_run: tuple[str, ...] = ()  # metrics the trial's MLflow run holds already (a script logged them itself)


@dataclass
class TrialLink:
    """What an objective may need of its trial besides the configuration: the trial's MLflow run, the study's
    own fields, and the pruner for values that are in the run already."""

    run_id: str
    experiment_id: str
    tracking_uri: str
    own: dict[str, Any]  # fields of the user's own ([program] studies): not trainer fields
    report: Callable[[dict[str, float]], None]  # a row for the pruner alone
    secrets: tuple[str, ...] = ()  # URLs whose passwords never reach a log
    place: Place | None = None  # a [program] trial's own folder, and what it wrote elsewhere


class Objective:
    logs = METRICS  # the metrics its trials can log, known before anything runs

    def __init__(self, study: Study, launcher: str = "process"):
        self.metrics, self.directions, self.launcher = study.metrics, study.directions, launcher
        own = bool(study.fixed.get("metrics"))  # the study's own metric functions log val_<name>
        unknown = [m for m in self.metrics if m not in self.logs and not m.startswith("loss/") and
                   not (own and m.startswith("val_"))]
        if unknown:
            close = difflib.get_close_matches(unknown[0], self.logs, n=1)
            raise ConfigError(f"{study.source or study.name}: objective.metrics: {unknown[0]!r} is not a metric its "
                              f"trials log" + (f" (did you mean {close[0]!r}?)" if close else "") +
                              f"; they log {', '.join(self.logs)}, loss/<term> for a loss with named terms, and "
                              f"val_<name> for the functions of [fixed] metrics")

    def params(self, config: TrainConfig, own: dict[str, Any]) -> dict[str, Any]:
        """A trial's MLflow params."""
        return config.to_dict()

    def train(self, config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
              checkpoint: Checkpointing | None = None, link: TrialLink | None = None) -> Trained:
        if self.launcher == "torchrun":
            result = torchrun.train_job(config, on_epoch, checkpoint)
        else:
            result = train(config, on_epoch=on_epoch, checkpoint=checkpoint).to_dict()
        return self.trained(config, result)

    def fuses(self) -> bool:
        """Whether its trials may train as fused groups (sweeps/trials/group.py): one configuration each, in the
        worker's process."""
        return type(self) is Objective and self.launcher == "process"

    def trained(self, config: TrainConfig, result: dict[str, Any]) -> Trained:
        """What a trial records of a result of `train` (`TrainResult.to_dict()`)."""
        health = {"health": result["health"], "health_epoch": result["health_epoch"],
                  "warnings": " | ".join(result["warnings"]) or None,
                  "noise_scale": "unavailable: accum_steps=1" if config.accum_steps == 1 else None}
        return Trained(result["metrics"], result["status"], result["memory_source"], health, result["dataset"],
                       result["resumed_after"])

    def widest(self, config: TrainConfig) -> int:
        """The largest physical batch a trial trains at: what its memory is predicted for on a GPU."""
        return config.physical_batch

    def values(self, metrics: dict[str, float]) -> list[float]:
        """The objective's values, one per metric; a metric that was not logged is an error of the study."""
        missing = [m for m in self.metrics if m not in metrics]
        if missing:
            raise MetricMissing(f"the objective's metric {missing[0]!r} was not logged; this trial logged "
                                f"{', '.join(sorted(metrics))}: change [objective] metrics in the study")
        return [metrics[m] for m in self.metrics]

    def history(self, rows: list[dict[str, float]]) -> list[dict[str, float]]:
        """A trial's rows (each epoch's, as they came) as its run logs them."""
        return rows

    def epoch_value(self, row: dict[str, float]) -> float | None:
        """The value a pruner compares after an epoch: the (single) metric, when the epoch logged it."""
        if len(self.metrics) != 1 or self.metrics[0] not in row:
            return None
        value = row[self.metrics[0]]
        if math.isfinite(value):
            return value
        return -math.inf if self.directions[0] == "maximize" else math.inf


class Equivalence(Objective):
    """(b, k) against its true-batch twin (b*k, 1) from the same initial weights; with BatchNorm also the ghost
    twin (b*k, 1, ghost_batch=b), which normalizes the same chunks of b, and that pair once more in float64:
    only if it agrees there is what remains float32 rounding. A pair without BatchNorm that parts by `recheck`
    or more (the report's line between rounding and a change) is trained once more in float64 too: rounding
    that training amplified agrees there, a real difference does not."""

    logs = METRICS + ("param_rel_diff", "twin_val_acc", "acc_gap", "ghost_rel_diff", "ghost_rel_diff_fp64",
                      "param_rel_diff_fp64")
    recheck = 1e-4

    def widest(self, config: TrainConfig) -> int:
        return config.effective_batch  # the true-batch twin

    def train(self, config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
              checkpoint: Checkpointing | None = None, link: TrialLink | None = None) -> Trained:
        accum = train(config, on_epoch=on_epoch, checkpoint=checkpoint)  # the twins are trained again
        true_config = dataclasses.replace(config, physical_batch=config.effective_batch, accum_steps=1)
        true = train(true_config)
        metrics = {**accum.metrics, "param_rel_diff": rel_diff(accum.model, true.model),
                   "twin_val_acc": true.metrics["val_acc"],
                   "acc_gap": accum.metrics["val_acc"] - true.metrics["val_acc"]}
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in accum.model.modules()):
            ghost_config = dataclasses.replace(true_config, ghost_batch=config.physical_batch)
            metrics["ghost_rel_diff"] = rel_diff(accum.model, train(ghost_config).model)
            if config.dtype != "float64":
                metrics["ghost_rel_diff_fp64"] = in_float64(config, ghost_config)
        elif config.dtype != "float64" and metrics["param_rel_diff"] >= self.recheck:
            metrics["param_rel_diff_fp64"] = in_float64(config, true_config)
        status = "diverged" if "diverged" in (accum.status, true.status) else "ok"
        return Trained(metrics, status, accum.memory_source, dataset=accum.dataset, resumed_after=accum.resumed_after)


def in_float64(*configs: TrainConfig) -> float:
    """rel_diff of two configurations trained again in float64."""
    return rel_diff(*[train(dataclasses.replace(c, dtype="float64")).model for c in configs])


class ScriptFailed(BatchsweepError):
    """A [program] trial's script failed: its exit and the last lines of its stderr."""


class Script(Objective):
    """The user's own script ([program]): launched with the trial's values, its metrics read from its JSON lines
    and from its MLflow run (which batchsweep opens and hands to it), its process tree's memory measured."""

    POLL_S = 2.0  # how often a script's MLflow run is read for the pruner

    def __init__(self, study: Study, launcher: str = "process"):
        self.metrics, self.directions, self.launcher = study.metrics, study.directions, launcher
        self.program, self.named, self.prunes = study.program, study.named, study.pruner != "none"

    def params(self, config: TrainConfig, own: dict[str, Any]) -> dict[str, Any]:
        return self.program.params({**config.to_dict(), **own}, self.named)

    def history(self, rows: list[dict[str, float]]) -> list[dict[str, float]]:
        """A script's rows placed, each metric on one scale, so that its last value in the run is its final one."""
        return place(rows).history

    def train(self, config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
              checkpoint: Checkpointing | None = None, link: TrialLink | None = None) -> Trained:
        place = link.place
        values = {**config.to_dict(), **link.own, "trial_dir": str(place.folder)}
        env = {**program.handoff(link.tracking_uri, link.run_id, link.experiment_id),
               "BATCHSWEEP_TRIAL_DIR": str(place.folder), **self.program.environment(values)}
        timeout = self.program.timeout_minutes * 60 if self.program.timeout_minutes else None
        output, client = Output(watched=self.metrics), MlflowClient(link.tracking_uri)
        watch = RunWatch(client, link, self.metrics[0]) if self.prunes else None
        place.open()
        try:
            cwd = self.program.folder(values)
            Path(cwd).mkdir(parents=True, exist_ok=True)  # (one of each trial's own, as "{trial_dir}/work", is new)
            env.update(observed.environment(place.trace, noise=config.accum_steps > 1, losses=True,
                                            pythonpath=env.get("PYTHONPATH")))
            try:
                ended = program.run(self.program.argv(values), env, cwd, timeout, output, on_epoch,
                                    every=watch.poll if watch else lambda: None)
            finally:
                try:
                    client.log_text(link.run_id, scrub(output.text(), *link.secrets), "log.txt")
                except Exception:  # the store failed: recording the trial's outcome fails next and says why
                    pass
            trace = observed.read(place.trace)
        finally:  # (a stopped trial's writes, too, for the trials that ran beside it)
            clashes = place.close()
        measured, tags = self.measured(ended, output, link, clashes)
        in_run = {k: v for k, v in client.get_run(link.run_id).data.metrics.items() if not k.startswith("system/")}
        metrics = {**in_run, **measured}
        source = ended.memory_source
        if trace is not None and trace.peak_allocated_bytes:  # on a GPU: the trainer's measure, the process's beside
            metrics["process_peak_memory_bytes"] = metrics.get("peak_memory_bytes", 0.0)
            metrics["peak_memory_bytes"], source = float(trace.peak_allocated_bytes), "cuda_allocator"
        seen, notes = as_observed(trace, config), output.notes() + ended.notes()
        for name, value in (("samples_per_s", trace and trace.samples_per_s()),
                            ("tokens_per_s", trace and trace.tokens_per_s())):
            if value and name not in metrics:  # (what the script logged itself stays)
                metrics[name] = value
        if trace is None:
            notes.append(observed.UNSEEN)
        elif config.accum_steps > 1 and "noise_scale" not in metrics:
            scale = observed.noise_scale(trace)
            if isinstance(scale, str):
                notes.append(f"the noise scale is not measured: {scale}")
            else:
                metrics.update(noise_scale=scale[0], noise_scale_reliable=float(scale[1]))
        losses = observed.window_losses(trace) if trace is not None and "train_loss" not in metrics else []
        if losses:  # a script that reports no train_loss: the losses it backwarded, as the tracer saw them
            metrics["train_loss"] = observed.train_loss(losses)
            log_window_losses(client, link.run_id, losses)
        finite = all(math.isfinite(metrics[m]) for m in self.metrics if m in metrics)
        return Trained(metrics, "ok" if finite else "diverged", source,
                       {**tags, "warnings": " | ".join(notes) or None, **seen},
                       in_run=tuple(k for k in in_run if k not in output.final))

    def measured(self, ended: program.Ended, output: Output, link: TrialLink,
                 clashes: list[tuple[str, str]]) -> tuple[dict[str, float], dict[str, Any]]:
        """What was measured of a script run, and its tags. A script that failed raises, its exception carrying
        both (`exc.trained`): its record keeps its exit, time and memory."""
        measured = {**output.final, "wall_time_s": ended.wall_time_s}
        if ended.peak_memory_bytes:
            measured["peak_memory_bytes"] = float(ended.peak_memory_bytes)
        tags = {"exit_status": ended.code, "processes_left": ", ".join(ended.left) or None,
                "clash": clash_sentence(clashes) if clashes else None}
        if ended.stopped == "timeout":
            exc = ScriptFailed(f"timeout: ran past timeout_minutes = {self.program.timeout_minutes:g} and was stopped")
        elif ended.code != 0:
            why = program.out_of_memory(ended, output)
            exc = torch.OutOfMemoryError(scrub(why, *link.secrets)) if why else \
                ScriptFailed(scrub(program.failure(ended, output), *link.secrets))
        else:
            return measured, tags
        exc.trained = Trained(measured, "ok", ended.memory_source,
                              {**tags, "warnings": " | ".join(output.notes() + ended.notes()) or None})
        raise exc


def log_window_losses(client: MlflowClient, run_id: str, losses: list[tuple[int, float]]) -> None:
    """Each optimizer step's window loss, at its step (`window_loss`: train_loss is their end, over the last ones)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    rows = [Metric("window_loss", loss, now, step) for step, loss in losses if math.isfinite(loss)]
    for start in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics a call
        client.log_batch(run_id, metrics=rows[start:start + 1000])


def as_observed(trace: observed.Trace | None, config: TrainConfig) -> dict[str, Any]:
    """The tags of what a script did, as the tracer saw it: b and k of its steps after the first, and where
    either is not what the trial passed, `config_mismatch` in one sentence. b is the first dimension of the
    model's first input; a layout with the batch elsewhere (sequence first) is no mismatch where b is one of the
    input's dimensions."""
    if trace is None:
        return {}
    # With several optimizers (a GAN's), each one's steps are its windows: the script accumulates as asked where any
    # optimizer's windows hold k micro-batches (a discriminator that backwards real and fake apart holds 2k).
    seen = [trace.observed(opt) for opt in trace.optimizers()]
    b, k = next((pair for pair in seen if pair[1] == config.accum_steps), seen[0])
    tags = {"observed_physical_batch": b, "observed_accum_steps": k, "observed_effective_batch": b * k}
    wrong = []
    if k != config.accum_steps:
        wrong.append(f"accum_steps {config.accum_steps} passed, {k} observed: the script does not accumulate as asked")
    shapes = [s.shape for s in trace.steps[1:] or trace.steps if s.shape]
    if b != config.physical_batch and not any(config.physical_batch in shape for shape in shapes):
        wrong.append(f"physical_batch {config.physical_batch} passed, {b} observed (the first dimension of the "
                     f"model's input): the script does not use the micro-batch it is given")
    if wrong:
        tags["config_mismatch"] = "; ".join(wrong)
    return tags


class RunWatch:
    """The objective's metric as a script logs it into its MLflow run, passed to the pruner as it comes."""

    def __init__(self, client: MlflowClient, link: TrialLink, metric: str):
        self.client, self.link, self.metric = client, link, metric
        self.seen: set[tuple[int, int]] = set()
        self.next = time.monotonic() + Script.POLL_S

    def poll(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + Script.POLL_S
        for m in self.client.get_metric_history(self.link.run_id, self.metric):
            if (m.step, m.timestamp) not in self.seen:
                self.seen.add((m.step, m.timestamp))
                self.link.report({"step": m.step, self.metric: m.value})


# The [objective] kinds by name. train: one configuration; equivalence: (b, k) against (b*k, 1); program: the
# user's own script (a study file's [program]).
OBJECTIVES = {"train": Objective, "equivalence": Equivalence, "program": Script}


def make_objective(study: Study, launcher: str = "process") -> Objective:
    return OBJECTIVES[study.kind](study, launcher)


def rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest relative difference between corresponding parameters."""
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))
