"""A study's MLflow runs as tidy pandas frames: one row per trial, and the per-epoch history."""
from __future__ import annotations

import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import PurePath

import numpy as np
import pandas as pd
from mlflow import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from scipy import stats
from tqdm import tqdm

from batchsweep.sweeps import commands

# Run-level tags worth a column; the rest stay in MLflow.
TAGS = ("state", "reason", "device_name", "memory_source", "torch_version", "optuna.trial_number", "health",
        "health_epoch", "warnings", "batchsweep.model", "batchsweep.model_kept", "batchsweep.program",
        "config_mismatch", "observed_accum_steps")


class AnalysisError(Exception):
    """Something the user can fix: printed as one line."""


@dataclass
class StudyRuns:
    name: str
    trials: pd.DataFrame  # one row per trial run, typed params, metrics, tags
    history: pd.DataFrame  # one row per (run_id, epoch)
    parent_run_id: str | None  # the latest invocation's run: the report's artifacts go there
    tracking_uri: str  # as it may be shown: any password as ***
    varied: tuple[str, ...] = ()  # the fields the study varies (its grid axes and searched fields)
    objectives: tuple[tuple[str, str], ...] = (("val_acc", "maximize"),)  # (metric, direction) as Optuna saw them
    evals: pd.DataFrame | None = None  # evaluations within epochs (eval_every_steps): one row per (run_id, step)
    run_as: str = ""  # the arguments of `run` that run this study again: --study (and --study-name where it differs)

    def __post_init__(self):
        self.trials = typed(self.trials, [m for m, _ in self.objectives])
        self.history = typed(self.history, ["val_acc"])


METRICS = ("val_acc", "val_loss", "train_loss", "samples_per_s", "peak_memory_bytes", "noise_scale")


def typed(frame: pd.DataFrame, metrics: list[str] = ()) -> pd.DataFrame:
    """A frame whose numbers may be strings (MLflow params and tags, a CSV read back as text) with each column
    given back its type; a metric that is not a number (`metrics`, and the names every study logs) is refused in
    one line, as every comparison of it would fail."""
    text = [c for c in frame.columns if frame[c].dtype == object or pd.api.types.is_string_dtype(frame[c])]
    if not text:
        return frame
    metrics = list(dict.fromkeys([*metrics, *METRICS]))
    missing = {"nan": math.nan, "NaN": math.nan, "None": math.nan, "": math.nan}  # (a metric not logged, as text)
    frame = frame.assign(**{c: _typed(frame[c].replace(missing) if c in metrics else frame[c]) for c in text})
    for c in metrics:
        if c in text and c in frame and not pd.api.types.is_numeric_dtype(frame[c]):
            bad = frame[c][frame[c].notna() & pd.to_numeric(frame[c], errors="coerce").isna()].iloc[0]
            raise AnalysisError(f"{c} holds values that are not numbers (such as {str(bad)!r}): log {c} as a number "
                                f"(mlflow.log_metric), then make the report again")
    return frame


def _run_as(name: str, tags: dict) -> str:
    """--study as the latest invocation named it (a built-in by its name, else its file or import path), and
    --study-name where the experiment is not named as the study."""
    source, defined = tags.get("study_file") or "", tags.get("study") or name
    builtin = PurePath(source).parent.name == "builtin" and PurePath(source).stem == defined
    said = f"--study {shlex.quote(defined if builtin or not source else source)}"
    return said + (f" --study-name {shlex.quote(name)}" if defined != name else "")


# Params the trainer computes from others (trainers/config.py's DERIVED, which analysis/ may not import; a test
# holds the two equal): never counted as varied on their own.
DERIVED = ("effective_batch", "lr", "bn_momentum", "beta1", "beta2", "eps", "decay")


def _varied(tag: str | None, trials: pd.DataFrame, params: list[str]) -> tuple[str, ...]:
    """The study's varied fields as its latest invocation recorded them; for runs from before that tag, the
    params that take more than one value (seed and derived values aside)."""
    if tag:
        return tuple(f for f in tag.split(",") if f in trials)
    return tuple(p for p in params if p not in ("seed", *DERIVED) and trials[p].nunique() > 1)


def _objectives(tag: str | None) -> tuple[tuple[str, str], ...]:
    if not tag:
        return (("val_acc", "maximize"),)
    return tuple(tuple(part.rsplit(":", 1)) for part in tag.split(","))  # type: ignore[misc]


def _typed(column: pd.Series) -> pd.Series:
    """MLflow keeps params as strings: give each column back its type."""
    if column.isin(["True", "False"]).all():
        return column == "True"
    numbers = pd.to_numeric(column, errors="coerce")
    if numbers.notna().sum() == column.notna().sum():
        return numbers
    return column


def load_studies(names: list[str], tracking_uri: str, shown_uri: str | None = None) -> list[StudyRuns]:
    """Each named study's runs; `shown_uri` is the tracking URI as messages may show it (no password). A study
    that is not in the store, or has no trial run, is refused before any study's history is read."""
    shown_uri = shown_uri or tracking_uri
    try:
        client = MlflowClient(tracking_uri=tracking_uri)  # a damaged SQLite store already fails here
        experiments = [client.get_experiment_by_name(name) for name in names]
    except Exception as exc:
        raise AnalysisError(f"cannot read the MLflow store {shown_uri} ({type(exc).__name__}): check "
                            f"--tracking-uri, or move a damaged store aside") from None
    found = []
    for name, experiment in zip(names, experiments):
        if experiment is None:
            raise AnalysisError(f"no study {name!r} in {shown_uri}: run `{commands.command('run')} --study {name}` "
                                f"first, or pass the --tracking-uri it used")
        runs, token = [], None
        while True:
            page = client.search_runs([experiment.experiment_id], max_results=1000, page_token=token)
            runs += page
            token = page.token
            if not token:
                break
        if not any(MLFLOW_PARENT_RUN_ID in r.data.tags for r in runs):
            raise AnalysisError(f"study {name!r} has no trial runs yet in {shown_uri}")
        found.append((name, runs))
    return [_study(client, name, runs, shown_uri) for name, runs in found]


def _study(client: MlflowClient, name: str, runs, shown_uri: str) -> StudyRuns:
    children = [r for r in runs if MLFLOW_PARENT_RUN_ID in r.data.tags]
    # (the latest by start, and of two started in the same millisecond, as on two machines, always the same one)
    parents = sorted((r for r in runs if MLFLOW_PARENT_RUN_ID not in r.data.tags),
                     key=lambda r: (r.info.start_time, r.info.run_id))
    # A script may log a metric under a param's name (the "lr" its schedule reached, beside the "lr" it was
    # given): the metric's column is then MLflow's own name for it, metrics.<name>, in both frames.
    taken = {k for run in children for k in run.data.params}
    shown = {k: f"metrics.{k}" if k in taken else k for run in children for k in run.data.metrics}
    rows = []
    for run in children:
        rows.append({"run_id": run.info.run_id, "status": run.info.status,
                     **{f"param:{k}": v for k, v in run.data.params.items()},
                     **{shown[k]: v for k, v in run.data.metrics.items()},
                     **{t: run.data.tags.get(t) for t in TAGS}})
    trials = pd.DataFrame(rows)
    params = [c for c in trials.columns if c.startswith("param:")]
    for c in params:
        trials[c] = _typed(trials[c])
    trials = trials.rename(columns={c: c.removeprefix("param:") for c in params})
    if "accum_steps" in trials:
        trials["batch"] = trials["accum_steps"].map(lambda k: "accumulated" if k > 1 else "true batch")
    tags = parents[-1].data.tags if parents else {}
    names = [c.removeprefix("param:") for c in params]
    history, evals = _history(client, children, name, shown)
    return StudyRuns(name, trials, history, parents[-1].info.run_id if parents else None,
                     shown_uri, _varied(tags.get("batchsweep.varied"), trials, names),
                     _objectives(tags.get("batchsweep.objective")), evals, _run_as(name, tags))


def _history(client: MlflowClient, runs, name: str,
             shown: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The per-epoch rows, and the evaluations within epochs (step_* metrics, by optimizer step) if any, each metric
    under its column's name in `shown`. A request per run and metric: most of a report's wait on a large study,
    and more over a tracking server, hence a bar."""
    rows = []
    for run in tqdm(runs, desc=f"reading the runs of {name}", unit="run", file=sys.stderr, dynamic_ncols=True,
                    leave=False):
        for key in run.data.metrics:
            if key in ("run_id", "epoch"):  # (a logger's own epoch counter, Lightning's: the index says it already)
                continue
            for m in client.get_metric_history(run.info.run_id, key):
                if m.step >= 1:  # per-epoch values; run-level ones sit on the last epoch's step only
                    rows.append((run.info.run_id, m.step, shown[key], m.value))
    frame = pd.DataFrame(rows, columns=["run_id", "epoch", "key", "value"])
    within = frame["key"].str.startswith("step_")
    evals = frame[within].rename(columns={"epoch": "step"})
    frame = frame[~within]
    return (frame.pivot_table(index=["run_id", "epoch"], columns="key", values="value").reset_index(),
            evals.pivot_table(index=["run_id", "step"], columns="key", values="value").reset_index()
            if within.any() else None)


def ci95(values: pd.Series) -> float:
    """Half-width of the 95% t-interval of the mean; NaN for a single value."""
    values = values.dropna()
    n = len(values)
    if n < 2:
        return math.nan
    return float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / math.sqrt(n))


def aggregate(trials: pd.DataFrame, by: list[str], value: str) -> pd.DataFrame:
    """Mean, 95% interval and count of `value` over the seeds of each configuration."""
    ok = trials.dropna(subset=[value])
    grouped = ok.groupby(by, dropna=False)[value]
    out = grouped.agg(mean="mean", n="count").reset_index()
    out["ci95"] = grouped.apply(ci95).values
    return out


@dataclass
class Difference:
    """a - b over the seeds both have, paired by seed (same seed: same initial weights, same sample order)."""

    mean: float
    half: float  # half-width of the 95% t-interval of the paired differences; NaN for one seed
    n: int
    p: float = math.nan  # the paired t-test's two-sided p-value (NaN for one seed)
    sd: float = math.nan  # the differences' sd, at least what the metric's rounding leaves unknown

    def __post_init__(self):  # a difference given by its interval alone: its sd and p follow from it
        if self.n >= 2 and math.isfinite(self.half) and not math.isfinite(self.sd):
            self.sd = self.half * math.sqrt(self.n) / float(stats.t.ppf(0.975, self.n - 1))
        if self.n >= 2 and math.isfinite(self.sd) and not math.isfinite(self.p):
            self.p = 1.0 if self.sd == 0 else float(2 * stats.t.sf(abs(self.mean) / (self.sd / math.sqrt(self.n)),
                                                                      self.n - 1))

    @property
    def separated(self) -> bool:
        """Whether the interval excludes zero (resolved only when false-discovery control keeps it too)."""
        return self.n >= 2 and abs(self.mean) > self.half


def quantum(values) -> float:
    """The step a metric is recorded in, as the values show it: the largest step of which every gap between two
    distinct values is a whole multiple (val_acc over 1,000 samples moves in steps of 0.001: where few runs
    ended at 0.275, 0.292 and 0.366, the smallest gap, 0.017, would take 17 of them for one); 0 where every value
    is the same. A metric with no such step (a loss) gets a thousandth of its smallest gap."""
    v = np.asarray(pd.Series(values).dropna(), dtype=float)
    v = np.unique(np.round(v[np.isfinite(v)], 12))  # (0.951 - 0.950 is 0.000999... in floats)
    tol = 1e-6 * max(1.0, float(np.abs(v).max(initial=0.0)))  # (above a float32 metric's rounding)
    gaps = np.diff(v)
    gaps = gaps[gaps > tol]
    if not len(gaps):
        return 0.0
    smallest = float(gaps.min())
    for n in range(1, 1001):  # the smallest gap, or its largest whole fraction that every gap is a multiple of
        step = smallest / n
        if np.all(np.abs(gaps - np.round(gaps / step) * step) <= tol):
            return step
    return smallest / 1000


def paired(a: pd.DataFrame, b: pd.DataFrame, value: str, step: float | None = None) -> Difference | None:
    """The paired difference of `value` between two configurations' trials. A seed's several trials on one side
    (an accumulated run and its true-batch twin at one B) are averaged first. `step` is the metric's recording
    step (quantum(); by default that of these trials' values): per-seed differences that agree to it are known
    only to it, so the sd is never taken below that of the rounding of a difference of two rounded values
    (step / sqrt(6)), and no interval has zero width, no p is 0."""
    if "seed" not in a or "seed" not in b:
        return None
    merged = (a.groupby("seed")[value].mean().rename("a").to_frame()
              .join(b.groupby("seed")[value].mean().rename("b"), how="inner").dropna())
    if merged.empty:
        return None
    step = quantum(pd.concat([a[value], b[value]])) if step is None else step
    d = merged["a"] - merged["b"]
    n, mean = len(d), float(d.mean())
    if n < 2:
        return Difference(mean, math.nan, 1)
    sd = max(float(d.std(ddof=1)), step / math.sqrt(6))
    return Difference(mean, float(stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)), n, sd=sd)


TARGET_SHARE = 0.95  # the target accuracy is this share of a highest mean final accuracy (targets.target: of which)


def reached(trials: pd.DataFrame, history: pd.DataFrame, target: float,
            evals: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per trial (run_id): the optimizer steps and training samples at its first evaluation at or above the
    target validation accuracy, at an epoch's end or within one (`evals`, with eval_every_steps); NaN where it
    never got there. Runs logged before `samples` was counted take steps x B. `before`: the steps at the evaluation
    before that one (0 where it was the first): the target was reached somewhere after it."""
    columns = ["run_id", "steps", "samples", "val_acc"]
    points = history.reindex(columns=columns)
    if evals is not None and "step_val_acc" in evals:
        within = evals.rename(columns={"step": "steps", "step_samples": "samples", "step_val_acc": "val_acc"})
        points = pd.concat([points, within.reindex(columns=columns)], ignore_index=True)
    hits = points[points["val_acc"] >= target].sort_values("steps").groupby("run_id")[["steps", "samples"]].first()
    evaluated = points[["run_id", "steps"]].dropna().drop_duplicates().sort_values(["run_id", "steps"])
    evaluated["before"] = evaluated.groupby("run_id")["steps"].shift(1).fillna(0.0)
    hits = hits.reset_index().merge(evaluated, on=["run_id", "steps"], how="left")
    out = trials[["run_id", "effective_batch"]].merge(hits, on="run_id", how="left")
    out["samples"] = out["samples"].fillna(out["steps"] * out["effective_batch"])
    return out.drop(columns="effective_batch")


def resolution(trials: pd.DataFrame, evals: pd.DataFrame | None) -> str:
    """How finely steps to a target are known: every N steps with eval_every_steps, else once an epoch."""
    every = trials["eval_every_steps"].dropna() if "eval_every_steps" in trials else pd.Series(dtype=float)
    if evals is not None and (every > 0).any():
        n = int(every[every > 0].max())
        return f"evaluated every {n} optimizer steps (eval_every_steps), so steps are known to within {n}"
    return "evaluated once an epoch, so steps are known to within one epoch's steps"
