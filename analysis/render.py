"""Write a report: figures as PNG, the trials as CSV, report.md, and a stand-alone report.html."""
from __future__ import annotations

import base64
import html
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .figures import Figure, all_figures
from .findings import summarize
from .runs import StudyRuns

# Columns of the trials table in the report, when the study has them.
TABLE = ["effective_batch", "physical_batch", "accum_steps", "lr_rule", "lr", "bn_momentum_rule", "model", "seed",
         "status", "reason", "health", "val_acc", "param_rel_diff", "acc_gap", "samples_per_s", "peak_memory_bytes"]

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
.summary { background: #f4f7fb; border-left: 4px solid #3b6ea8; padding: 0.6em 1.2em; }
.row { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 1.5em; }
figure { margin: 1em 0; } figure img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { padding: 2px 8px; border-bottom: 1px solid #ddd; }
th { text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
"""


def _table(trials: pd.DataFrame) -> pd.DataFrame:
    columns = [c for c in TABLE if c in trials]
    return trials[columns].sort_values(columns[0]) if columns else trials


def _unhealthy(trials: pd.DataFrame) -> pd.DataFrame | None:
    """The trials whose verdict is not ok, with where it started; None when the runs carry no verdict."""
    if "health" not in trials or trials["health"].isna().all():
        return None
    bad = trials[trials["health"].notna() & (trials["health"] != "ok")]
    columns = [c for c in ("effective_batch", "physical_batch", "accum_steps", "lr_rule", "lr", "seed", "health",
                           "health_epoch", "val_acc", "warnings") if c in bad]
    return bad[columns]


def _cell(value) -> str:
    return "" if pd.isna(value) else f"{value:.4g}" if isinstance(value, float) else str(value)


def _md_table(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(_cell(v).replace("|", "/") for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _html_table(frame: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for value in row:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            text = _cell(value)
            cells.append(f"<td class='n'>{html.escape(text)}</td>" if numeric else f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _save(figure: Figure, folder: Path, prefix: str) -> Path:
    path = folder / f"{prefix}{figure.name}.png"
    figure.figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure.figure)
    return path


def write_report(studies: list[StudyRuns], folder: Path) -> Path:
    """Write the report of one study, or of several side by side; returns report.html's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("*.png"), *folder.glob("*trials.csv"), *folder.glob("report.*")]:
        old.unlink()  # a figure the data no longer supports must not linger from an earlier report
    title = " vs ".join(s.name for s in studies)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    sections: dict[str, list[tuple[str, Figure, Path]]] = {}
    summaries = []
    for study in studies:
        prefix = f"{study.name}-" if len(studies) > 1 else ""
        for fig in all_figures(study.trials, study.history):
            sections.setdefault(fig.title, []).append((study.name, fig, _save(fig, folder, prefix)))
        summaries.append((study.name, summarize(study.trials)))
        _table(study.trials).to_csv(folder / f"{prefix}trials.csv", index=False)

    md = [f"# batchsweep report: {title}", "", f"Made {stamp} from {studies[0].tracking_uri}.", ""]
    body = [f"<h1>batchsweep report: {html.escape(title)}</h1>",
            f"<p class='meta'>Made {stamp} from {html.escape(studies[0].tracking_uri)}. "
            f"Reproduce with <code>python analysis/report.py "
            f"{'--compare ' + ' '.join(s.name for s in studies) if len(studies) > 1 else '--study ' + title}</code>."
            f"</p>"]
    for name, sentences in summaries:
        md += [f"## Findings: {name}", "", *(f"- {s}" for s in sentences or ["No finished trials yet."]), ""]
        body.append(f"<div class='summary'><h2>Findings: {html.escape(name)}</h2><ul>"
                    + "".join(f"<li>{html.escape(s)}</li>" for s in sentences or ["No finished trials yet."])
                    + "</ul></div>")
    for section_title, items in sections.items():
        md += [f"## {section_title}", ""]
        body.append(f"<h2>{html.escape(section_title)}</h2><div class='row'>")
        for name, fig, path in items:
            data = base64.b64encode(path.read_bytes()).decode()
            label = f"{name}: " if len(studies) > 1 else ""
            md += [f"![{label}{fig.title}]({path.name})", "", f"*{label}{fig.context}*", ""]
            body.append(f"<figure><img alt='{html.escape(label + fig.title)}' src='data:image/png;base64,{data}'>"
                        f"<figcaption>{html.escape(label + fig.context)}</figcaption></figure>")
        body.append("</div>")
    for study in studies:
        unhealthy = _unhealthy(study.trials)
        if unhealthy is not None:
            md += [f"## Training health: {study.name}", "", _md_table(unhealthy) if not unhealthy.empty
                   else "Every trial was healthy.", ""]
            body.append(f"<h2>Training health: {html.escape(study.name)}</h2>"
                        + (_html_table(unhealthy) if not unhealthy.empty else "<p>Every trial was healthy.</p>"))
    for study in studies:
        prefix = f"{study.name}-" if len(studies) > 1 else ""
        md += [f"## Trials: {study.name}", "", f"All trials are in [{prefix}trials.csv]({prefix}trials.csv).", ""]
        body.append(f"<h2>Trials: {html.escape(study.name)}</h2>{_html_table(_table(study.trials))}")
    (folder / "report.md").write_text("\n".join(md))
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>batchsweep: {html.escape(title)}"
            f"</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>")
    (folder / "report.html").write_text(page)
    return folder / "report.html"
