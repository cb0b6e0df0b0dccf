"""A study's MLflow runs as tidy pandas frames: one row per trial, and the per-epoch history."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
from mlflow import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from scipy import stats

# Run-level tags worth a column; the rest stay in MLflow.
TAGS = ("state", "reason", "device_name", "memory_source", "torch_version", "optuna.trial_number", "health",
        "health_epoch", "warnings")


class AnalysisError(Exception):
    """Something the user can fix: printed as one line."""


@dataclass
class StudyRuns:
    name: str
    trials: pd.DataFrame  # one row per trial run, typed params, metrics, tags
    history: pd.DataFrame  # one row per (run_id, epoch)
    parent_run_id: str | None  # the latest invocation's run: the report's artifacts go there
    tracking_uri: str


def _typed(column: pd.Series) -> pd.Series:
    """MLflow keeps params as strings: give each column back its type."""
    if column.isin(["True", "False"]).all():
        return column == "True"
    numbers = pd.to_numeric(column, errors="coerce")
    if numbers.notna().sum() == column.notna().sum():
        return numbers
    return column


def load_study(name: str, tracking_uri: str) -> StudyRuns:
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        experiment = client.get_experiment_by_name(name)
    except Exception as exc:
        raise AnalysisError(f"cannot read the MLflow store {tracking_uri} ({type(exc).__name__}): "
                            f"check --tracking-uri") from None
    if experiment is None:
        raise AnalysisError(f"no study {name!r} in {tracking_uri}: run `python sweeps/run.py --study {name}` first, "
                            f"or pass the --tracking-uri it used")
    runs, token = [], None
    while True:
        page = client.search_runs([experiment.experiment_id], max_results=1000, page_token=token)
        runs += page
        token = page.token
        if not token:
            break
    children = [r for r in runs if MLFLOW_PARENT_RUN_ID in r.data.tags]
    parents = sorted((r for r in runs if MLFLOW_PARENT_RUN_ID not in r.data.tags), key=lambda r: r.info.start_time)
    if not children:
        raise AnalysisError(f"study {name!r} has no trial runs yet in {tracking_uri}")
    rows = []
    for run in children:
        rows.append({"run_id": run.info.run_id, "status": run.info.status,
                     **{f"param:{k}": v for k, v in run.data.params.items()},
                     **run.data.metrics, **{t: run.data.tags.get(t) for t in TAGS}})
    trials = pd.DataFrame(rows)
    params = [c for c in trials.columns if c.startswith("param:")]
    for c in params:
        trials[c] = _typed(trials[c])
    trials = trials.rename(columns={c: c.removeprefix("param:") for c in params})
    if "accum_steps" in trials:
        trials["batch"] = trials["accum_steps"].map(lambda k: "accumulated" if k > 1 else "true batch")
    return StudyRuns(name, trials, _history(client, children), parents[-1].info.run_id if parents else None,
                     tracking_uri)


def _history(client: MlflowClient, runs) -> pd.DataFrame:
    rows = []
    for run in runs:
        for key in run.data.metrics:
            for m in client.get_metric_history(run.info.run_id, key):
                if m.step >= 1:  # per-epoch values; run-level ones sit on the last epoch's step only
                    rows.append((run.info.run_id, m.step, key, m.value))
    frame = pd.DataFrame(rows, columns=["run_id", "epoch", "key", "value"])
    return frame.pivot_table(index=["run_id", "epoch"], columns="key", values="value").reset_index()


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
