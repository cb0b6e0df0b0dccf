"""Searches: what a study's trials are and how the next one is chosen, one class per kind, chosen by name as
Optuna chooses samplers. Both record every varied field as an Optuna param, so Optuna's importance evaluators,
optuna.visualization and optuna-dashboard see them.

- GridSearch ("grid"): one Optuna study; each (point, seed) once, claimed by the worker (Optuna's GridSampler
  runs points twice when several processes share a storage).
- SamplerSearch ("random", "tpe", "cmaes", "nsga2"): one Optuna study per (grid point, seed), in which the
  sampler searches the fields of [tune] for `trials` trials.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution

from ..stores.outcomes import holds
from batchsweep.trainers import BatchsweepError

from .spec import Param, Point, Study, config_key, point_key


@dataclass(frozen=True)
class Unit:
    """A unit of work: the Optuna study it lives in, a grid point and a seed."""

    study_name: str
    point: Point
    seed: int
    key: str = field(init=False, compare=False)  # point_key(point, seed), which every claim compares

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", point_key(self.point, self.seed))


class Duplicate(Exception):
    """Another trial holds the point this one claimed."""


class StudyChanged(BatchsweepError):
    """The study's grid or search space is not the one its Optuna study's earlier trials were recorded with."""


class Pinned(optuna.samplers.BaseSampler):
    """A sampler that returns given values for the grid's fields and asks its base sampler for the rest.

    Optuna's PartialFixedSampler does the same with values fixed when it is built; here a grid worker learns
    its point only inside the objective, once the trial has started under the study's sampler, so the values
    are set on the sampler in place (`values`) for each trial. (PartialFixedSampler is also still marked
    experimental in Optuna 5: a warning each time one is built.)"""

    def __init__(self, base: optuna.samplers.BaseSampler):
        self.base, self.values = base, {}

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        space = self.base.infer_relative_search_space(study, trial)
        return {k: v for k, v in space.items() if k not in self.values}

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        return self.base.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, name, distribution) -> Any:
        if name in self.values:
            return self.values[name]
        return self.base.sample_independent(study, trial, name, distribution)

    def before_trial(self, study, trial) -> None:
        self.base.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()


class Search:
    """The narrow interface: units of work, their sampler and pruner, the next point, the work left."""

    def __init__(self, study: Study, study_name: str, points: list[Point], seeds: tuple[int, ...]):
        self.study, self.study_name, self.points, self.seeds = study, study_name, points, seeds
        # Each grid field as a categorical over every value its axis takes (twins included): the same
        # distribution in every trial, as Optuna requires of a param.
        self.axes = {k: CategoricalDistribution(list(dict.fromkeys(p[k] for p in points)))
                     for k in dict.fromkeys(k for p in points for k in p)}
        self.held: dict[int, str | None] = {}  # a finished trial's id -> the point it holds (None: none)

    def units(self) -> list[Unit]:
        raise NotImplementedError

    def sampler(self, unit: int, worker: int, done: int = 0, liar: bool = False) -> Pinned:
        """The sampler of a unit's Optuna study for one worker, `done` trials into it. `liar`: trials are asked
        several at a time (a fused group), so TPE takes the running ones as bad (its constant liar) rather than
        draw the same neighbourhood for each."""
        raise NotImplementedError

    def pruner(self, epochs: int) -> optuna.pruners.BasePruner:
        """The study's pruner for trials of `epochs`; a script's rows count its own epochs, or steps, which
        Hyperband then learns from the first trial that completes (Optuna's max_resource="auto")."""
        return PRUNERS[self.study.pruner](None if self.study.program else epochs)

    def next_point(self, trial: optuna.Trial, mine: list[Unit], failed_here: set[str],
                   worker: int = 0) -> tuple[Point, int]:
        """Choose the trial's point and seed, record them (user attribute `config`, Optuna params) and return
        them; raise Duplicate if another trial holds them."""
        raise NotImplementedError

    def left(self, trials: list[optuna.trial.FrozenTrial], mine: list[Unit], failed_here: set[str]) -> int:
        """Trials still to run in one Optuna study."""
        raise NotImplementedError

    def taken(self, trials: list[optuna.trial.FrozenTrial], besides: int = -1) -> set[str]:
        """The points that trials hold (running them, or done with them for good). A finished trial never
        changes, so its point is worked out once: a claim costs the same in a study of 10,000 trials."""
        keys = set()
        for t in trials:
            key = self.held.get(t._trial_id, "")
            if key == "":
                key = config_key(t.user_attrs["config"]) if "config" in t.user_attrs and holds(t) else None
                if t.state.is_finished():
                    self.held[t._trial_id] = key
            if key is not None and t.number != besides:
                keys.add(key)
        return keys

    def study_names(self) -> list[str]:
        return list(dict.fromkeys(u.study_name for u in self.units()))

    def _seed(self, unit: int, worker: int, done: int) -> int:
        # Workers must not repeat each other's draws, nor a resumed search its own.
        return (self.study.sampler_seed * 1000 + unit * 10 + worker + done * 7919) % 2 ** 32

    def _record_axes(self, trial: optuna.Trial, point: Point) -> None:
        """The point's grid fields as Optuna params (the pinned sampler returns the point's values)."""
        for name in point:
            try:
                trial.suggest_categorical(name, self.axes[name].choices)
            except ValueError:  # Optuna refuses a categorical whose choices changed within a study
                raise StudyChanged(
                    f"the [grid] of study {self.study_name} changed since its first trials: {name} now takes "
                    f"{list(self.axes[name].choices)}; restore the grid, or run it under a new --study-name"
                ) from None

    def _record(self, trial: optuna.Trial, point: Point, seed: int) -> None:
        trial.set_user_attr("config", {**point, "seed": seed})


class GridSearch(Search):
    def units(self) -> list[Unit]:
        # Each point's seeds follow each other, so that a partial run already has its error bars.
        return [Unit(self.study_name, p, s) for p in self.points for s in self.seeds]

    def sampler(self, unit: int, worker: int, done: int = 0, liar: bool = False) -> Pinned:
        return Pinned(optuna.samplers.RandomSampler(seed=self._seed(unit, worker, done)))  # never asked: all pinned

    def next_point(self, trial: optuna.Trial, mine: list[Unit], failed_here: set[str],
                   worker: int = 0) -> tuple[Point, int]:
        """Take the next free point; yield it if another trial claimed it at the same moment."""
        study = trial.study
        taken = self.taken(study.get_trials(deepcopy=False), besides=trial.number) | failed_here
        free = [u for u in mine if u.key not in taken]
        if free:
            unit = free[worker % len(free)]  # workers start apart
            self._record(trial, unit.point, unit.seed)
            if unit.key not in self.taken(study.get_trials(deepcopy=False), besides=trial.number):
                study.sampler.values = dict(unit.point)  # checked after our claim is visible to the others
                self._record_axes(trial, unit.point)
                return unit.point, unit.seed
        time.sleep(random.random() * 0.2)  # break the tie with a worker that claimed at the same moment
        raise Duplicate("another trial holds this point")

    def left(self, trials, mine, failed_here) -> int:
        return len({u.key for u in mine} - self.taken(trials) - failed_here)


class SamplerSearch(Search):
    def units(self) -> list[Unit]:
        return [Unit(f"{self.study_name}/{point_key(p, s)}", p, s) for p in self.points for s in self.seeds]

    def sampler(self, unit: int, worker: int, done: int = 0, liar: bool = False) -> Pinned:
        seed = self._seed(unit, worker, done)
        pinned = Pinned(tpe(seed, liar=True) if liar and self.study.sampler == "tpe" else
                        SAMPLERS[self.study.sampler](seed))
        pinned.values = dict(self.units()[unit].point)
        return pinned

    def next_point(self, trial: optuna.Trial, mine: list[Unit], failed_here: set[str],
                   worker: int = 0) -> tuple[Point, int]:
        (unit,) = mine
        self._record_axes(trial, unit.point)
        try:
            tuned = {name: suggest(trial, name, param) for name, param in self.study.tune.items()}
        except ValueError as exc:  # Optuna refuses a param whose distribution changed within a study
            raise StudyChanged(f"the [tune] ranges of study {self.study_name} changed since its first trials "
                               f"({exc}): restore them, or run it under a new --study-name") from None
        point = {**unit.point, **tuned}
        self._record(trial, point, unit.seed)
        return point, unit.seed

    def left(self, trials, mine, failed_here) -> int:
        return max(self.study.trials - sum(1 for t in trials if holds(t)) - len(failed_here), 0)


def tpe(seed: int, liar: bool = False) -> optuna.samplers.TPESampler:
    """Optuna 5 changed TPE's defaults: every setting that shapes its search is pinned."""
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, n_ei_candidates=24, multivariate=False,
                                      group=False, constant_liar=liar)


# The samplers by name, each from its seed ("grid" is the GridSearch's own claiming, in order).
SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler] | None] = {
    "grid": None,
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
    "tpe": tpe,
    "cmaes": lambda seed: optuna.samplers.CmaEsSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
}
# The pruners by name, each from the trials' epochs (None: not known before a trial completes).
PRUNERS: dict[str, Callable[[int | None], optuna.pruners.BasePruner]] = {
    "none": lambda epochs: optuna.pruners.NopPruner(),
    "median": lambda epochs: optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=2),
    "hyperband": lambda epochs: optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(epochs, 1)
                                                               if epochs else "auto"),
}


def make_search(study: Study, study_name: str, points: list[Point], seeds: tuple[int, ...]) -> Search:
    return (GridSearch if study.sampler == "grid" else SamplerSearch)(study, study_name, points, seeds)


def suggest(trial: optuna.Trial, name: str, param: Param) -> Any:
    if param.type == "categorical":
        return trial.suggest_categorical(name, list(param.choices))
    if param.type == "int":
        return trial.suggest_int(name, int(param.low), int(param.high), log=param.log)
    return trial.suggest_float(name, param.low, param.high, log=param.log)

