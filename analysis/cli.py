"""Command line of `python analysis/report.py`."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from batchsweep.sweeps import commands  # standard library only: no sweep logic
from batchsweep.sweeps.stores import urls

# MLflow, SciPy and matplotlib (seconds) are imported once the command line is parsed: --help and bad flags
# answer at once.


def default_tracking_uri() -> str:
    """MLflow's own MLFLOW_TRACKING_URI when set (how the sweep hands it over, off the command line), else the
    local SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlruns').resolve()}/mlflow.db"


def check_out(out: Path, folder: Path) -> None:
    """The report's folder can be made inside --out, and is not a link that leads out of it."""
    from .runs import AnalysisError

    if out.exists() and not out.is_dir():
        raise AnalysisError(f"--out {out} is a file: name a folder (default: reports/)")
    if folder.is_symlink():
        raise AnalysisError(f"{folder} is a symbolic link: the report is written only into a real folder inside "
                            f"--out; remove the link or pass another --out")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AnalysisError(f"cannot create the report folder {folder} ({exc.strerror or exc}): pass an --out "
                            f"that can be written") from None
    if not os.access(folder, os.W_OK):
        raise AnalysisError(f"cannot write into the report folder {folder}: make it writable or pass another --out")


NOTE_LIMIT = 8000  # MLflow's longest tag value: a longer one is cut, with a warning on the terminal


def note(name: str, lines: list[str], report: Path) -> str:
    """The parent run's description: as many whole lines as MLflow keeps, then where the rest is."""
    end = f"Report: {report} (and report/report.html in this run's artifacts)."
    kept, size = [], len(name) + len(end) + 100
    for line in lines:
        size += len(line) + 3
        if size > NOTE_LIMIT:
            kept.append(f"- … ({len(lines) - len(kept)} more in the report)")
            break
        kept.append(f"- {line}")
    return "\n".join([f"Findings of study {name}:", "", *kept, "", end])


def main(argv: list[str] | None = None) -> int:
    p = commands.Parser("report", description="Write the comparison report of a study from its MLflow runs: "
                        "reports/<study>/report.html, report.md, figures, trials.csv.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--study", help="the study (its MLflow experiment name)")
    which.add_argument("--compare", nargs=2, metavar=("STUDY_A", "STUDY_B"), help="two studies side by side")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else SQLite in "
                   "mlruns/mlflow.db)")
    p.add_argument("--out", default="reports", help="folder for the reports (default: reports/)")
    p.add_argument("--no-log", action="store_true", help="do not log the report to the study's MLflow parent run")
    args = p.parse_args(argv)
    if args.compare and args.compare[0] == args.compare[1]:
        p.error(f"--compare names {args.compare[0]!r} twice: give two different studies, or --study "
                f"{args.compare[0]} for one")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    uri = args.tracking_uri or default_tracking_uri()
    names = args.compare or [args.study]
    from .render import folder_name, write_report
    from .runs import AnalysisError, load_studies

    folder = Path(args.out) / folder_name(names)
    made = [p for p in [folder, *folder.parents] if not p.exists()]  # what check_out creates, deepest first
    try:
        wrong = urls.problem(uri, "--tracking-uri", urls.TRACKING_SCHEMES)
        if wrong:
            raise AnalysisError(wrong)
        uri = urls.hand_over_credentials(uri)
        if uri.startswith("sqlite:///") and not urls.sqlite_path(uri).exists():
            raise AnalysisError(f"no MLflow store at {uri}: run a study first, or pass --tracking-uri")
        check_out(Path(args.out), folder)  # before the store is read: a report is never made only to be lost
        why = urls.unreachable(uri)
        if why:
            raise AnalysisError(why)
        studies = load_studies(names, uri, urls.redact(uri))
    except AnalysisError as exc:
        for path in made:  # no empty folder is left for a report that was never written
            try:
                path.rmdir()
            except OSError:
                break
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written, findings = write_report(studies, folder)
    if not args.no_log:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        for study in studies:
            if study.parent_run_id:
                for path in written:  # the report's own files, not whatever else the folder holds
                    client.log_artifact(study.parent_run_id, str(path), "report")
                # The run's description in the UI: what to use, the findings, and where the report is.
                client.set_tag(study.parent_run_id, "mlflow.note.content", note(study.name, findings[study.name],
                                                                                written[0].resolve()))
    print(f"report: {written[0].resolve()}")
    return 0
