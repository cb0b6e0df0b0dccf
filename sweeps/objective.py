"""Objectives: what a trial trains and the values it returns to Optuna, one class per [objective] kind."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import difflib

from trainers import METRICS, BatchsweepError, Checkpointing, ConfigError, TrainConfig, train

from . import torchrun
from .studies import Study


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


class Objective:
    logs = METRICS  # the metrics its trials can log, known before anything runs

    def __init__(self, study: Study, launcher: str = "process"):
        self.metrics, self.directions, self.launcher = study.metrics, study.directions, launcher
        unknown = [m for m in self.metrics if m not in self.logs and not m.startswith("loss/")]
        if unknown:
            close = difflib.get_close_matches(unknown[0], self.logs, n=1)
            raise ConfigError(f"{study.source or study.name}: objective.metrics: {unknown[0]!r} is not a metric its "
                              f"trials log" + (f" (did you mean {close[0]!r}?)" if close else "") +
                              f"; they log {', '.join(self.logs)}, and loss/<term> for a loss with named terms")

    def train(self, config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
              checkpoint: Checkpointing | None = None) -> Trained:
        if self.launcher == "torchrun":
            result = torchrun.train_job(config, on_epoch, checkpoint)
        else:
            result = train(config, on_epoch=on_epoch, checkpoint=checkpoint).to_dict()
        health = {"health": result["health"], "health_epoch": result["health_epoch"],
                  "warnings": " | ".join(result["warnings"]) or None,
                  "noise_scale": "unavailable: accum_steps=1" if config.accum_steps == 1 else None}
        return Trained(result["metrics"], result["status"], result["memory_source"], health, result["dataset"],
                       result["resumed_after"])

    def values(self, metrics: dict[str, float]) -> list[float]:
        """The objective's values, one per metric; a metric that was not logged is an error of the study."""
        missing = [m for m in self.metrics if m not in metrics]
        if missing:
            raise MetricMissing(f"the objective's metric {missing[0]!r} was not logged; this trial logged "
                                f"{', '.join(sorted(metrics))}: change [objective] metrics in the study")
        return [metrics[m] for m in self.metrics]

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
    only if it agrees there is what remains float32 rounding."""

    logs = METRICS + ("param_rel_diff", "twin_val_acc", "acc_gap", "ghost_rel_diff", "ghost_rel_diff_fp64")

    def train(self, config: TrainConfig, on_epoch: Callable[[dict[str, float]], None],
              checkpoint: Checkpointing | None = None) -> Trained:
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
                in_f64 = [train(dataclasses.replace(c, dtype="float64")).model for c in (config, ghost_config)]
                metrics["ghost_rel_diff_fp64"] = rel_diff(*in_f64)
        status = "diverged" if "diverged" in (accum.status, true.status) else "ok"
        return Trained(metrics, status, accum.memory_source, dataset=accum.dataset, resumed_after=accum.resumed_after)


# The [objective] kinds by name. train: one configuration; equivalence: (b, k) against (b*k, 1).
OBJECTIVES = {"train": Objective, "equivalence": Equivalence}


def make_objective(study: Study, launcher: str = "process") -> Objective:
    return OBJECTIVES[study.kind](study, launcher)


def rel_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest relative difference between corresponding parameters."""
    return max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(a.parameters(), b.parameters()))
