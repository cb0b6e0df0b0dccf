"""Write a report: figures as PNG, the trials as CSV, report.md, and a stand-alone report.html.

Every string from the data (names, params, tags, messages) is escaped: the HTML by a Jinja2 environment with
autoescape, the Markdown by a backslash before each character Markdown would act on; a command a sentence marks
with backticks is a code span in both (<code>), whose content neither acts on. The report folder's name is
derived from the study names and never leaves the output folder; the report deletes and uploads only the files
it wrote itself (listed in the folder's manifest).
"""
from __future__ import annotations

import base64
import math
import re
import shlex
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import jinja2
from markupsafe import Markup, escape
import matplotlib.pyplot as plt
import pandas as pd
from tqdm import tqdm

from batchsweep.sweeps import commands

from . import branching
from .figures import candidates, equivalence
from .findings import one_bn_rule, summarize
from .measures import has_accuracy
from .plotting import Draw, Figure, protocol
from .recommend import per_model, recommend, starred
from .runs import StudyRuns
from .space import pareto_trials, space_candidates
from .wording import lowered

MANIFEST = ".batchsweep-report"  # the files the last report wrote in this folder, one name a line
# Columns of the trials table in the report, when the study has them.
TABLE = ["effective_batch", "physical_batch", "accum_steps", "world_size", "physical_batch_used", "oom_retries",
         "lr_rule", "lr", "bn_momentum_rule", "model", "seed", "status", "reason", "health", "val_acc",
         "param_rel_diff", "acc_gap", "samples_per_s", "peak_memory_bytes"]
UNLESS = {"world_size": 1, "bn_momentum_rule": "default"}  # columns left out when every trial has this value

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } .meta { color: #666; margin-top: 0; }
.summary { background: #f4f7fb; border-left: 4px solid #3b6ea8; padding: 0.6em 1.2em; }
.row { display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 1.5em; }
figure { margin: 1em 0; } figure img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; display: block; max-width: 100%; overflow-x: auto; }
td, th { padding: 2px 8px; border-bottom: 1px solid #ddd; }
th { text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
"""


def _columns(study: StudyRuns) -> list[str]:
    """The trials table's columns: those of TABLE that the runs have, and the study's objectives."""
    trials = study.trials
    columns = [c for c in TABLE if c in trials and not (c in UNLESS and (trials[c] == UNLESS[c]).all())
               and not (c == "val_acc" and not has_accuracy(trials))]
    extra = [m for m, _ in study.objectives if m in trials and m not in columns]
    at = columns.index("samples_per_s") if "samples_per_s" in columns else len(columns)
    return columns[:at] + extra + columns[at:]


def _table(study: StudyRuns) -> pd.DataFrame:
    """The trials table, a first column marking with ★ the trials of the best configuration and of every one
    that cannot be told from it (the set the recommendation names; none where it names none), or
    with several objectives the Pareto front of them (`front`, as the run's final table marks it)."""
    trials, columns = study.trials, _columns(study)
    table = trials[columns].sort_values(columns[0]) if columns else trials
    metric, _ = study.objectives[0]
    if len(study.objectives) > 1:
        marked, name = set(pareto_trials(study)), "front"
    elif metric in trials:
        named = starred(study)  # (the recommendation's best and ties, per model: none where it names none)
        if named is None:
            return table
        marked, name = set(named), "best or not told apart"
    else:
        return table
    return table.assign(**{name: ["★" if i in marked else "" for i in table.index]})[[name, *table.columns]]


def _raw(study: StudyRuns) -> pd.DataFrame:
    """trials.csv: the table's columns, then every other param, metric and tag of the runs, unformatted."""
    columns = _columns(study)
    rest = sorted(c for c in study.trials.columns if c not in columns)
    return study.trials[columns + rest].sort_values(columns[0]) if columns else study.trials


# Headers with units, and how a column's numbers are shown; one format per column.
MIB = 2 ** 20
UNITS = {"samples_per_s": ("samples/s", lambda v: f"{v:,.0f}"),
         "peak_memory_bytes": ("peak memory, MiB", lambda v: f"{v / MIB:,.1f}"),
         "acc_gap": ("acc_gap, points", lambda v: f"{100 * v:+.2f}"),
         "param_rel_diff": ("param_rel_diff", lambda v: f"{v:.2e}")}


def _number_format(column: pd.Series):
    """The header and one format for a column of numbers: integers as such, accuracies in %, else fixed
    decimals that give the smallest value three significant digits, or scientific notation over many decades."""
    values, name = column.dropna(), str(column.name)
    if values.empty or (values % 1 == 0).all():
        return name, lambda v: f"{v:.0f}"
    if "acc" in name and values.between(0, 1).all():
        return f"{name}, %", lambda v: f"{100 * v:.2f}"
    small, large = values.abs()[values != 0].min(), values.abs().max()
    if pd.isna(small) or small < 1e-3 or large >= 1e6:
        return name, lambda v: f"{v:.2e}"
    decimals = min(6, max(0, 2 - math.floor(math.log10(small))))
    return name, lambda v: f"{v:.{decimals}f}"


def _display(frame: pd.DataFrame) -> tuple[list[str], list[list[tuple[str, bool]]]]:
    """The table's headers, and its cells as (text, numeric), each numeric column in one format."""
    headers, formats = [], []
    for name in frame.columns:
        column = frame[name]
        numeric = pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column)
        header, fmt = UNITS.get(name) or (_number_format(column) if numeric else (name, str))
        headers.append(header)
        formats.append((fmt, numeric))
    rows = [[("" if pd.isna(v) else fmt(v) if numeric else str(v), numeric) for v, (fmt, numeric) in zip(row, formats)]
            for row in frame.itertuples(index=False)]
    return headers, rows


def _models(trials: pd.DataFrame, objective: tuple[str, str]) -> pd.DataFrame | None:
    """The trials whose trained model is in MLflow, with how to load it; None when there are none."""
    if "batchsweep.model" not in trials or trials["batchsweep.model"].isna().all():
        return None
    kept = trials[trials["batchsweep.model"].notna()]
    load = ["mlflow.pytorch.load_model('runs:/" + run + "/model')" if kind == "pytorch" else
            "runs:/" + run + "/model: state_dict.pt, built as model.json says"
            for run, kind in zip(kept["run_id"], kept["batchsweep.model"])]
    columns = [c for c in ("optuna.trial_number", "physical_batch", "accum_steps", "lr_rule", "seed", objective[0],
                           "batchsweep.model_kept") if c in kept]
    return kept[columns].rename(columns={"batchsweep.model_kept": "kept as"}).assign(load=load)


def _unhealthy(trials: pd.DataFrame) -> pd.DataFrame | None:
    """The trials whose verdict is not ok, with where it started; None when the runs carry no verdict."""
    if "health" not in trials or trials["health"].isna().all():
        return None
    bad = trials[trials["health"].notna() & (trials["health"] != "ok")]
    columns = [c for c in ("effective_batch", "physical_batch", "accum_steps", "lr_rule", "lr", "seed", "health",
                           "health_epoch", "val_acc", "warnings") if c in bad]
    return bad[columns]


# The characters that make Markdown markup here: emphasis, code, links (no '[', so no '(' after one),
# HTML and entities, table cells, strikethrough. Lines never start with data, so '#' and list marks stay;
# '_' makes emphasis only at a word's edge (CommonMark), so lr_rule stays as it is.
# GitHub's Markdown also links bare URLs (scheme://... and www....): the ':' and the '.' get a backslash too.
MD_SPECIAL = re.compile(r"([\\`*\[\]<>|~&])|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])|(?<=[A-Za-z])(:)(?=//)"
                        r"|(?<=(?<![A-Za-z0-9])www)(\.)", re.IGNORECASE)


def _spans(text: str) -> list[str]:
    """The text split at its backticks where they pair up, the odd parts a command the sentence marks; else the text
    whole: a stray backtick or an empty span marks nothing, nor one holding '|' (it would split a table cell) or
    '<', '>', '&' (a renderer that reads HTML in a code span would act on them; escaped, they show as text)."""
    parts = text.split("`")
    if len(parts) % 2 == 0 or any(not p.strip() or set(p) & set("|<>&") for p in parts[1::2]):
        return [text]
    return parts


def md(text) -> str:
    """Text that Markdown shows as it is: no markup, no link, no HTML, one line; a command marked with backticks a
    code span, whose content Markdown shows as it is (escaped, it showed the backslashes and the backticks)."""
    parts = _spans(re.sub(r"[\r\n]+", " ", str(text)))
    return "".join(f"`{p}`" if i % 2 else MD_SPECIAL.sub(lambda m: "\\" + m.group(0), p) for i, p in enumerate(parts))


def code(text) -> Markup:
    """A sentence as HTML: escaped, a command marked with backticks in <code>."""
    return Markup("".join(f"<code>{escape(p)}</code>" if i % 2 else str(escape(p))
                          for i, p in enumerate(_spans(str(text)))))


def _md_table(frame: pd.DataFrame) -> str:
    headers, rows = _display(frame)
    lines = ["| " + " | ".join(md(c) for c in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(md(text) for text, _ in row) + " |" for row in rows]
    return "\n".join(lines)


def _save(figure: Figure, folder: Path, prefix: str) -> Path:
    group = f"{folder_name([figure.group])}-" if figure.group else ""
    path = folder / f"{prefix}{group}{figure.name}.png"
    figure.figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure.figure)
    return path


TEMPLATE = jinja2.Environment(autoescape=True).from_string("""<!DOCTYPE html>
<html lang='en'><head><meta charset='utf-8'><title>batchsweep: {{ title }}</title><style>{{ css }}</style></head>
<body>
<h1>batchsweep report: {{ title }}</h1>
<p class='meta'>Made {{ stamp }} from {{ source }}. Reproduce with <code>{{ reproduce }}</code>.</p>
{% for name, lines in advice %}
<div class='summary'><h2>What to use: {{ name }}</h2><ul>
{% for s in lines %}<li>{{ code(s) }}</li>{% endfor %}
</ul></div>
{% endfor %}
{% for name, sentences, how in summaries %}
<div class='summary'><h2>Findings: {{ name }}</h2><p class='meta'>Protocol: {{ how }}.</p><ul>
{% for s in sentences %}<li>{{ code(s) }}</li>{% endfor %}
</ul></div>
{% endfor %}
{% for section, items in sections %}
<h2>{{ section }}</h2><div class='row'>
{% for label, fig, data, caption in items %}
<figure><img alt='{{ label }}{{ fig.title }}' src='data:image/png;base64,{{ data }}'>
<figcaption>{{ caption }}</figcaption></figure>
{% endfor %}
</div>
{% endfor %}
{% for name, table in health %}
<h2>Training health: {{ name }}</h2>
{% if table is none %}<p>Every trial was healthy.</p>{% else %}{{ html_table(table) }}{% endif %}
{% endfor %}
{% for name, table in models %}<h2>Trained models: {{ name }}</h2>{{ html_table(table) }}{% endfor %}
{% for name, table in trials %}<h2>Trials: {{ name }}</h2>{{ html_table(table) }}{% endfor %}
</body></html>
""")

TABLE_TEMPLATE = jinja2.Environment(autoescape=True).from_string(
    "<table><tr>{% for c in columns %}<th>{{ c }}</th>{% endfor %}</tr>"
    "{% for row in rows %}<tr>{% for text, numeric in row %}"
    "<td{% if numeric %} class='n'{% endif %}>{{ text }}</td>{% endfor %}</tr>{% endfor %}</table>")


def _html_table(frame: pd.DataFrame):
    headers, rows = _display(frame)
    return Markup(TABLE_TEMPLATE.render(columns=headers, rows=rows))


def folder_name(names: list[str]) -> str:
    """A folder name for the report of these studies: letters, digits, '.', '_' and '-' only, never '..'."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", "_vs_".join(names)).lstrip(".")[:150]
    return safe or "study"


def _clear(folder: Path) -> None:
    """Delete what the last report wrote here, and nothing else."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        return
    for name in manifest.read_text().splitlines():
        path = folder / name
        if name and "/" not in name and name not in (".", "..") and path.is_file():
            path.unlink()
    manifest.unlink()


def _markdown(studies, title: str, stamp: str, source: str, reproduce: str, summaries: list, sections: list,
              health: list, models: list, advice: list) -> str:
    """report.md: the same sections as the page, every string from the data escaped by md()."""
    md_lines = [f"# batchsweep report: {md(title)}", "", f"Made {stamp} from {md(source)}. Reproduce with: "
                f"{md(f'`{reproduce}`')}", ""]
    for name, lines in advice:
        md_lines += [f"## What to use: {md(name)}", "", *(f"- {md(s)}" for s in lines), ""]
    for name, sentences, how in summaries:
        md_lines += [f"## Findings: {md(name)}", "", f"Protocol: {md(how)}.", "", *(f"- {md(s)}" for s in sentences),
                     ""]
    for section_title, items in sections:
        md_lines += [f"## {md(section_title)}", ""]
        for label, fig, path, caption in items:
            md_lines += [f"![{md(label + fig.title)}]({path.name})", "", f"*{md(caption)}*", ""]
    for name, table in health:
        md_lines += [f"## Training health: {md(name)}", "", "Every trial was healthy." if table is None
                     else _md_table(table), ""]
    for name, table in models:
        md_lines += [f"## Trained models: {md(name)}", "", _md_table(table), ""]
    for study in studies:
        prefix = f"{folder_name([study.name])}-" if len(studies) > 1 else ""
        md_lines += [f"## Trials: {md(study.name)}", "", f"All trials are in [{prefix}trials.csv]({prefix}trials.csv).",
                     ""]
    return "\n".join(md_lines)


def _candidates(study: StudyRuns) -> list[Draw]:
    """Every kind of figure the report knows (its bar's total): which ones the data supports is known as each is
    tried. Where the findings group the runs (per_model(): by model, dataset and norm where the study varies them),
    each group's figures are drawn from its own runs and named by it, as a line pooled over two models holds for
    neither; the figures over the search space take the whole study, where a model is one field of a configuration,
    and so does equivalence's, which sets the models side by side itself (BN against no BN)."""
    groups = [(name, one, one_bn_rule(one.trials, one.varied)[0]) for name, one in per_model(study)]
    whole = [partial(equivalence, study.trials)] if len(groups) > 1 else []
    return [*(partial(_grouped, draw, name) for name, one, compared in groups
              for draw in candidates(one.trials, one.history, one.evals, one.objectives[0], compared)
              if not (whole and draw.func is equivalence)),
            *whole, *space_candidates(study),
            *(partial(_grouped, partial(branching.figure, one.trials, one.history), name) for name, one, _ in groups)]


def _grouped(draw: Draw, group: str) -> Figure | None:
    figure = draw()
    return figure if figure is None else replace(figure, group=group)


def _shared_title(titles: list[str]) -> str:
    """The words that several titles open with ('Learning curves'), or the title when they are one."""
    shared = []
    for words in zip(*(t.split() for t in titles)):
        if len(set(words)) > 1:
            break
        shared.append(words[0])
    while shared and shared[-1] in ("by", "from", "of", "at", "against"):
        shared.pop()
    return " ".join(shared).rstrip(",;:") or titles[0]


def _sections(kinds: dict[str, list[tuple[str, Figure, Path]]]) -> list:
    """A section per kind of figure: the studies' side by side even where their titles differ (learning curves by
    lr_rule beside those by bn_momentum_rule), under what their titles share, each whole title in its caption.
    (heading, items): two kinds may share a heading ('Pareto front' of val_acc and of val_loss)."""
    sections = []
    for items in kinds.values():
        heading = _shared_title([fig.title for _, fig, _ in items])
        sections.append((heading, [(label, fig, path, label + (f"{fig.title}. " if fig.title != heading else "")
                                    + fig.context) for label, fig, path in items]))
    return sections


def write_report(studies: list[StudyRuns], folder: Path) -> tuple[list[Path], dict[str, list[str]]]:
    """Write the report of one study, or of several side by side, into `folder`. Returns the files written,
    report.html first, and each study's recommendation ("Use: ...") and findings."""
    source = studies[0].tracking_uri  # as it may be shown: no password
    folder.mkdir(parents=True, exist_ok=True)
    _clear(folder)  # a figure the data no longer supports must not linger from an earlier report
    written: list[Path] = []
    title = " vs ".join(s.name for s in studies)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    kinds: dict[str, list[tuple[str, Figure, Path]]] = {}
    summaries = []
    for study in studies:
        prefix = f"{folder_name([study.name])}-" if len(studies) > 1 else ""
        figures = []
        with tqdm(_candidates(study), desc=f"drawing the figures of {study.name}", unit=" kinds", file=sys.stderr,
                  dynamic_ncols=True, leave=False) as bar:
            for draw in bar:
                fig = draw()
                if fig is None:
                    continue
                path = _save(fig, folder, prefix)
                written.append(path)
                label = (f"{study.name}: " if len(studies) > 1 else "") + (f"{fig.group}: " if fig.group else "")
                kinds.setdefault(fig.name, []).append((label, fig, path))
                figures.append(fig)
                bar.set_postfix(drawn=len(figures), refresh=False)
        findings = (summarize(study.trials, study.history, study.evals, study.objectives[0], study.varied)
                    + [f"{f.group}: {lowered(f.finding)}" if f.group else f.finding for f in figures if f.finding])
        summaries.append((study.name, findings or ["No finished trials yet."], protocol(study.trials)))
        csv = folder / f"{prefix}trials.csv"
        _raw(study).to_csv(csv, index=False)
        written.append(csv)
    sections = _sections(kinds)
    names = [s.name for s in studies]
    reproduce = f"{commands.command('report')} " + (f"--compare {' '.join(map(shlex.quote, names))}" if len(names) > 1
                                                 else f"--study {shlex.quote(names[0])}")
    health = []
    for study in studies:
        unhealthy = _unhealthy(study.trials)
        if unhealthy is not None:
            health.append((study.name, None if unhealthy.empty else unhealthy))
    models = [(s.name, table) for s in studies if (table := _models(s.trials, s.objectives[0])) is not None]
    advice = [(s.name, lines) for s in studies if (lines := recommend(s))]
    (folder / "report.md").write_text(_markdown(studies, title, stamp, source, reproduce, summaries, sections,
                                                health, models, advice))

    page = TEMPLATE.render(
        title=title, css=Markup(CSS), stamp=stamp, source=source, reproduce=reproduce,
        advice=advice, summaries=summaries, health=health, html_table=_html_table, models=models, code=code,
        sections=[(t, [(label, fig, base64.b64encode(path.read_bytes()).decode(), caption)
                       for label, fig, path, caption in items]) for t, items in sections],
        trials=[(s.name, _table(s)) for s in studies])
    (folder / "report.html").write_text(page)
    written = [folder / "report.html", folder / "report.md", *written]
    (folder / MANIFEST).write_text("\n".join(p.name for p in written) + "\n")
    said = dict(advice)  # the MLflow note: what to use, then the findings
    return written, {name: [*(f"Use: {line}" for line in said.get(name, [])), *sentences]
                     for name, sentences, _ in summaries}
