"""An invocation of a study: what one `sweeps/run.py` command runs, and each trial's configuration."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from typing import Any

from batchsweep.trainers import DERIVED, FIELDS, TrainConfig

from ..gpus.planner import start_batch
from ..study.search import Search, Unit, make_search
from ..study.spec import Point, Study


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
    fuse: bool = True  # trials that can train as one fused group do (sweeps/trials/group.py)
    workers: int = 1  # worker processes of this invocation (a fused group takes at most its share of the work)

    def config(self, point: Point, seed: int) -> TrainConfig:
        point = {k: v for k, v in point.items() if k in FIELDS or k in DERIVED}  # not a [program]'s own fields
        if not self.study.auto_batch:
            return dataclasses.replace(self.base, **point, seed=seed)
        values = dict(point)
        target = values.pop("effective_batch")
        b = self.start_batch(target)
        return dataclasses.replace(self.base, **values, physical_batch=b, accum_steps=target // b, seed=seed,
                                   shrink_on_oom=True)

    def own(self, point: Point) -> dict[str, Any]:
        """A [program] study's own fields at a point: those of [fixed], then the point's."""
        return {k: v for k, v in {**self.study.fixed, **point}.items() if k not in FIELDS and k not in DERIVED}

    def start_batch(self, target: int) -> int:
        """Where physical_batch = "auto" starts: the memory planner's b for the GPU's memory when a batch_memory
        study of this model and data is in the store, else b = B."""
        return start_batch(self.base, target, self.tracking_uri)

    def broken(self, config: TrainConfig, own: dict[str, Any] | None = None) -> str | None:
        """The first of the study's constraints that a configuration breaks."""
        return next((c.text for c in self.study.constraints if not c.holds(config, own)), None)

    @functools.cached_property
    def dropped(self) -> list[tuple[Point, str]]:
        """Grid points that break a constraint: not run."""
        return [(p, why) for p in self.study.points
                if (why := self.broken(self.config(p, self.base.seed), self.own(p)))]

    @functools.cached_property
    def search(self) -> Search:
        dropped = [p for p, _ in self.dropped]
        return make_search(self.study, self.study_name, [p for p in self.study.points if p not in dropped],
                           self.seeds)

    def units(self) -> list[Unit]:
        return self.search.units()

    def study_names(self) -> list[str]:
        return self.search.study_names()
