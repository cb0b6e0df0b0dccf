"""The study registry. A study is data: fixed trainer fields, the points it visits, how each is searched."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trainers.config import ConfigError

Point = dict[str, Any]  # TrainConfig fields that vary between trials


@dataclass(frozen=True)
class Tune:
    """TPE over one field per point, log-uniform in [low, high], with a median pruner on val_acc per epoch."""

    field: str
    low: float
    high: float
    trials_per_point: int


@dataclass(frozen=True)
class Study:
    name: str
    summary: str
    fixed: dict[str, Any]  # TrainConfig fields shared by every trial
    points: tuple[Point, ...]  # grid studies: every point once per seed; tuned studies: one TPE search each
    tune: Tune | None = None
    kind: str = "train"  # "train": objective val_acc; "equivalence": (b, k) against (b*k, 1)
    sampler_seed: int = 0
    seeds: int = 1  # the default of --seeds: enough that a finding is not one seed's noise
    workers: int = 1  # the default of --workers


def twins(points: list[Point]) -> list[Point]:
    """Each accumulated point and its true-batch twin (b*k, 1) at the same effective batch. A BN momentum
    rule does nothing at k = 1, so the twins of several rules are one twin."""
    out = list(points)
    for p in points:
        if p.get("accum_steps", 1) > 1:
            twin = {**p, "physical_batch": p["physical_batch"] * p["accum_steps"], "accum_steps": 1}
            if "bn_momentum_rule" in twin:
                twin["bn_momentum_rule"] = "default"
            if twin not in out:
                out.append(twin)
    return out


K = (1, 2, 4, 8, 16)
# The protocol under which LR-scaling rules are claimed to hold (Goyal et al. 2017): a linear warmup, then a
# decay to zero, weight decay as usual with SGD; three seeds so that a finding is not one seed's noise. On a
# 2-core CPU the default study takes about 4 minutes with its two workers (docs/science.md).
PROTOCOL = dict(epochs=12, warmup_epochs=2, schedule="cosine", weight_decay=5e-4)

STUDIES = {s.name: s for s in [
    Study("accum_lr", "b=32, k in 1..16 x LR rule none/linear/sqrt, with true-batch twins; warmup and cosine; "
                      "objective val_acc",
          fixed=dict(**PROTOCOL, base_lr=0.05, base_batch=32),
          points=tuple(twins([dict(physical_batch=32, accum_steps=k, lr_rule=r)
                              for k in K for r in ("none", "linear", "sqrt")])), seeds=3, workers=2),
    Study("bn_momentum", "k in 4, 16 x BN momentum rule default/scaled/matched on cnn1d, with k = 1 and the "
                         "true-batch twins; warmup and cosine",
          fixed=dict(**PROTOCOL, model="cnn1d", norm="batch", base_lr=0.05, lr_rule="sqrt"),
          points=tuple(twins([dict(physical_batch=32, accum_steps=1, bn_momentum_rule="default")]
                             + [dict(physical_batch=32, accum_steps=k, bn_momentum_rule=r)
                                for k in (4, 16) for r in ("default", "scaled", "matched")])), seeds=3, workers=2),
    Study("batch_memory", "b in 8..1024 x k in 1, 4, one epoch: peak memory and samples/s",
          fixed=dict(epochs=1),
          points=tuple(dict(physical_batch=2 ** i, accum_steps=k) for k in (1, 4) for i in range(3, 11))),
    Study("lr_search", "TPE over base LR for each effective batch B in 32..1024 (b=32), median pruner",
          fixed=dict(epochs=8, lr_rule="none", warmup_epochs=1, schedule="cosine", weight_decay=5e-4),
          points=tuple(dict(physical_batch=32, accum_steps=2 ** i) for i in range(6)),
          tune=Tune("base_lr", 1e-3, 2.0, trials_per_point=8)),
    Study("equivalence", "(b, k) against (b*k, 1) from the same weights, mlp (no BN) and cnn1d (BN)",
          fixed=dict(epochs=3),
          points=tuple(dict(model=m, physical_batch=32, accum_steps=k) for m in ("mlp", "cnn1d") for k in (2, 4, 8)),
          kind="equivalence"),
]}


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_name(name: str) -> str:
    """A study name becomes an Optuna study, an MLflow experiment and a folder under reports/: a plain name,
    never a path."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"study name {name!r} is not a plain name: use up to 100 letters, digits, '.', '_' or '-', "
                          f"starting with a letter or digit (no '/', no '..')")
    return name


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}: choose one of {', '.join(STUDIES)} (see --list)")
    return STUDIES[name]


def config_key(config: Point) -> str:
    """A stable id of a trial's varied fields, e.g. 'accum_steps=4,lr_rule=linear,physical_batch=32,seed=0'."""
    return ",".join(f"{k}={v}" for k, v in sorted(config.items()))


def point_key(point: Point, seed: int) -> str:
    return config_key({**point, "seed": seed})


def describe(point: Point) -> str:
    """A short run name: 'b32 k4 linear', 'b32 k8 base_lr=0.0316'."""
    names = {"physical_batch": "b", "accum_steps": "k"}
    return " ".join(f"{names[k]}{v}" if k in names else f"{k}={v:.3g}" if isinstance(v, float) else str(v)
                    for k, v in point.items())
