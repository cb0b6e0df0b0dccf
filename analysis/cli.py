"""Command line of `python analysis/report.py`."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import urllib.parse
from pathlib import Path

from .runs import AnalysisError, load_study


def default_tracking_uri() -> str:
    """MLflow's own MLFLOW_TRACKING_URI when set (how the sweep hands it over, off the command line), else the
    local SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlruns').resolve()}/mlflow.db"


def shown(uri: str) -> str:
    """The URI as it may be printed or written into a report: its password as ***."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(uri).render_as_string(hide_password=True) if "://" in uri else uri
    except Exception:  # not a URL SQLAlchemy parses: show no netloc at all
        parts = urllib.parse.urlsplit(uri)
        return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname or "")) if parts.password else uri


def without_credentials(uri: str) -> str:
    """An http(s) URI's user and password go to MLflow's own variables; what remains holds no secret."""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or (parts.username is None and parts.password is None):
        return uri
    os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(parts.username or "")
    os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(parts.password or "")
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="analysis/report.py", description="Write the comparison report of a study "
                                "from its MLflow runs: reports/<study>/report.html, report.md, figures, trials.csv.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--study", help="the study (its MLflow experiment name)")
    which.add_argument("--compare", nargs=2, metavar=("STUDY_A", "STUDY_B"), help="two studies side by side")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else SQLite in "
                   "mlruns/mlflow.db)")
    p.add_argument("--out", default="reports", help="folder for the reports (default: reports/)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to the study's MLflow parent run")
    args = p.parse_args(argv)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    uri = without_credentials(args.tracking_uri or default_tracking_uri())
    names = args.compare or [args.study]
    try:
        if uri.startswith("sqlite:") and not uri.startswith("sqlite:///"):
            raise AnalysisError(f"{uri!r} is not a SQLite URL: write sqlite:///relative/path.db or "
                                f"sqlite:////absolute/path.db")
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
            raise AnalysisError(f"no MLflow store at {shown(uri)}: run a study first, or pass --tracking-uri")
        studies = [load_study(name, uri, shown(uri)) for name in names]
    except AnalysisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .render import folder_name, write_report

    folder = Path(args.out) / folder_name(names)
    written, findings = write_report(studies, folder)
    if not args.no_log:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        for study in studies:
            if study.parent_run_id:
                for path in written:  # the report's own files, not whatever else the folder holds
                    client.log_artifact(study.parent_run_id, str(path), "report")
                # The run's description in the UI: the findings, and where the report is.
                client.set_tag(study.parent_run_id, "mlflow.note.content", "\n".join(
                    [f"Findings of study {study.name}:", "", *(f"- {line}" for line in findings[study.name]), "",
                     f"Report: {written[0].resolve()} (and report/report.html in this run's artifacts)."]))
    print(f"report: {written[0].resolve()}")
    return 0
