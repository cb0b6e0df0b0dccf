"""Command line of `python analysis/report.py`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .runs import AnalysisError, load_study


def default_tracking_uri() -> str:
    return f"sqlite:///{Path('mlruns').resolve()}/mlflow.db"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="analysis/report.py", description="Write the comparison report of a study "
                                "from its MLflow runs: reports/<study>/report.html, report.md, figures, trials.csv.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--study", help="the study (its MLflow experiment name)")
    which.add_argument("--compare", nargs=2, metavar=("STUDY_A", "STUDY_B"), help="two studies side by side")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: SQLite in mlruns/mlflow.db)")
    p.add_argument("--out", default="reports", help="folder for the reports (default: reports/)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to the study's MLflow parent run")
    args = p.parse_args(argv)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    uri = args.tracking_uri or default_tracking_uri()
    names = args.compare or [args.study]
    try:
        if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
            raise AnalysisError(f"no MLflow store at {uri}: run a study first, or pass --tracking-uri")
        studies = [load_study(name, uri) for name in names]
    except AnalysisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .render import write_report

    folder = Path(args.out) / "_vs_".join(names)
    page = write_report(studies, folder)
    if not args.no_log:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        for study in studies:
            if study.parent_run_id:
                client.log_artifacts(study.parent_run_id, str(folder), "report")
    print(f"report: {page.resolve()}")
    return 0
