"""A study is data: fixed trainer fields, a grid of points, the fields a sampler searches, and the objective.
Study files (sweeps/study/files.py) are read into it; the built-in studies are such files in sweeps/study/builtin/."""
from __future__ import annotations

import itertools
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any

from batchsweep.trainers import ConfigError, TrainConfig

from ..launch.program import Program

Point = dict[str, Any]  # the fields that vary between trials: TrainConfig's, and a [program] study's own

LAUNCHERS = ("process", "torchrun")  # where a trial trains: in the worker, or as a torchrun job
KINDS = ("train", "equivalence", "program")  # what a trial is: sweeps/trials/objective.py has a class for each
DIRECTIONS = ("maximize", "minimize")
OPERATORS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<": operator.lt,
             ">": operator.gt}
CONSTRAINT = re.compile(r"\s*([a-z_]+)\s*(<=|>=|==|!=|<|>)\s*([-+0-9.eE]+)\s*")


@dataclass(frozen=True)
class Param:
    """One field the sampler searches: Optuna's float, int or categorical distribution."""

    type: str  # float | int | categorical
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple = ()

    def distribution(self):
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.type == "categorical":
            return CategoricalDistribution(self.choices)
        kind = FloatDistribution if self.type == "float" else IntDistribution
        return kind(self.low, self.high, log=self.log)


@dataclass(frozen=True)
class Constraint:
    """`field op number` over a trial's configuration, derived values included (effective_batch, lr)."""

    text: str

    def parts(self) -> tuple[str, str, float]:
        name, op, number = CONSTRAINT.fullmatch(self.text).groups()
        return name, op, float(number)

    def holds(self, config: TrainConfig, own: dict[str, Any] | None = None) -> bool:
        name, op, number = self.parts()
        value = own[name] if own and name in own else getattr(config, name)
        return OPERATORS[op](value, number)


@dataclass(frozen=True)
class Study:
    name: str
    summary: str
    fixed: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields shared by every trial
    # axis -> values; every combination, in order. An axis "a+b" varies two fields together: its values are
    # (a, b) tuples.
    grid: dict[str, tuple] = field(default_factory=dict)
    tune: dict[str, Param] = field(default_factory=dict)  # fields the sampler searches at each grid point
    sampler: str = "grid"
    trials: int = 1  # per grid point and seed, for samplers other than grid
    pruner: str = "none"
    twins: bool = False
    fuse: bool = True  # its trials may train as fused groups (false: a study that measures each trial's time)
    constraints: tuple[Constraint, ...] = ()
    kind: str = "train"  # one of KINDS
    metrics: tuple[str, ...] = ("val_acc",)
    directions: tuple[str, ...] = ("maximize",)
    seeds: int = 1  # the default of --seeds
    workers: int = 1  # the default of --workers
    sampler_seed: int = 0
    launcher: str = "process"  # the default of --launcher
    auto_batch: bool = False  # physical_batch = "auto": points give effective_batch; b starts there, shrinks on OOM
    source: str = ""  # the file or import path it was read from
    program: Program | None = None  # the user's script that each trial runs (kind "program")

    @property
    def points(self) -> tuple[Point, ...]:
        """The grid's points in order (the last axis fastest), then the twins; each once."""
        axes = [key.split("+") for key in self.grid]
        points = []
        for values in itertools.product(*self.grid.values()):
            point: Point = {}
            for fields, value in zip(axes, values):
                point.update(zip(fields, value) if len(fields) > 1 else {fields[0]: value})
            points.append(_canonical(point))
        return tuple(_unique(twins(points) if self.twins else points))

    @property
    def size(self) -> int:
        """How many points the grid has at most (twins included), from its axes' lengths alone."""
        return math.prod(len(values) for values in self.grid.values()) * (2 if self.twins else 1)

    @property
    def varied(self) -> tuple[str, ...]:
        """The fields the study varies: its grid's axes, then the searched fields."""
        return tuple(f for key in self.grid for f in key.split("+")) + tuple(self.tune)

    @property
    def named(self) -> tuple[str, ...]:
        """Every field the study names: [fixed], [grid] and [tune]."""
        return (*self.fixed, *self.varied)

    @property
    def trials_per_unit(self) -> int:
        return 1 if self.sampler == "grid" else self.trials


def _canonical(point: Point) -> Point:
    """At k = 1 every BN momentum rule is the default one: points that differ only in it are one point."""
    if point.get("accum_steps", 1) == 1 and "bn_momentum_rule" in point:
        return {**point, "bn_momentum_rule": "default"}
    return point


def _unique(points: list[Point]) -> list[Point]:
    """The points in order, each once (in time linear in their number)."""
    first: dict[frozenset, Point] = {}
    for p in points:
        first.setdefault(frozenset(p.items()), p)
    return list(first.values())


def twins(points: list[Point]) -> list[Point]:
    """The points, then the true-batch twin (b*k, 1) of each accumulated one, at the same effective batch."""
    out = list(points)
    for p in points:
        if p.get("accum_steps", 1) > 1:
            out.append(_canonical({**p, "physical_batch": p["physical_batch"] * p["accum_steps"], "accum_steps": 1}))
    return out


MAX_UNITS = 100_000  # points x trials x seeds: a study this size takes days; beyond it, a typo


def check_size(study: Study, seeds: int, seeds_from: str) -> None:
    """Refuse a study with more than MAX_UNITS trials, counted from its axes before anything is enumerated."""
    units = study.size * study.trials_per_unit * seeds
    if units > MAX_UNITS:
        axes = " x ".join(str(len(v)) for v in study.grid.values()) or "1"
        raise ConfigError(f"{study.source or study.name}: {axes} grid values{' (and twins)' * study.twins} x "
                          f"{study.trials_per_unit} trials x {seeds} seeds ({seeds_from}) = up to {units:,} trials, "
                          f"more than the limit of {MAX_UNITS:,}: shorten the [grid] axes or lower the seeds")


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(name: str) -> str:
    """A study name becomes an Optuna study, an MLflow experiment and a folder under reports/: a plain name,
    never a path."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"study name {name!r} is not a plain name: use up to 100 letters, digits, '.', '_' or '-', "
                          f"starting with a letter or digit (no '/', no '..')")
    return name


def config_key(config: Point) -> str:
    """A stable id of a trial's varied fields, e.g. 'accum_steps=4,lr_rule=linear,physical_batch=32,seed=0'."""
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def point_key(point: Point, seed: int) -> str:
    return config_key({**point, "seed": seed})


def describe(point: Point) -> str:
    """A short run name: 'b32 k4 linear', 'b32 k8 base_lr=0.0316', 'k4 warmup 32 epochs=3', 'fixed B'. A word
    names itself; a number or a switch says its field (a bare '3' could be any of them)."""
    names = {"physical_batch": "b", "accum_steps": "k", "batch_warmup": "warmup "}

    def part(field: str, value) -> str:
        if field == "batch_warmup" and not value:
            return "fixed B"
        if field in names:
            return f"{names[field]}{value}"
        if isinstance(value, str):
            return value
        return f"{field}={value:.3g}" if isinstance(value, float) else f"{field}={value}"

    return " ".join(part(field, value) for field, value in point.items())
