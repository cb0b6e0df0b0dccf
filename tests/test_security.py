"""Secrets never shown or stored, names never paths, text from the data escaped in the report."""
import os
import re
import threading
from pathlib import Path

import pytest
from mlflow import MlflowClient

from batchsweep.analysis import cli as report_cli
from batchsweep.analysis.render import folder_name
from batchsweep.sweeps.stores.urls import redact, scrub
from tests.conftest import in_process, run_script
from tests.test_analysis import PROBE, probe_in_chromium
from tests.test_sweeps import TINY, sweep

PASSWORD = "Zq7-planted-Secret"


def test_redact_and_scrub():
    assert redact(f"postgresql://bob:{PASSWORD}@db.example:5432/optuna") == "postgresql://bob:***@db.example:5432/optuna"
    assert redact("sqlite:////tmp/optuna.db") == "sqlite:////tmp/optuna.db"
    assert redact("journal:mlruns/optuna.log") == "journal:mlruns/optuna.log"
    encoded = "p%40ss%2Fw"  # p@ss/w
    url = f"postgresql://bob:{encoded}@h/db"
    assert scrub(f"failed for {url}; password p@ss/w", url) == "failed for postgresql://bob:***@h/db; password ***"


class CommandLines:
    """Reads the command line of every process this test started (its descendants), about every 10 ms, while
    the test runs. Only its own: another test running at the same time may type a password on purpose."""

    def __init__(self):
        self.seen: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            parent, line = {}, {}
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:  # stat is "pid (name) state ppid ...", and the name may hold ")"
                        parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                        line[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                            errors="replace")
                    except (OSError, IndexError, ValueError):
                        pass
            for pid, text in line.items():
                ancestor = parent.get(pid)
                while ancestor not in (None, 0, 1, me):
                    ancestor = parent.get(ancestor)
                if ancestor == me:
                    self.seen.add(text)
            self.stop.wait(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.stop.set()
        self.thread.join()


def files_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode(errors="replace") for p in folder.rglob("*") if p.is_file())


# With every character URL syntax treats specially: '/', '#' and '?' as they are, '@' and '%' encoded.
SPECIAL = "Zq7/pl#nt?d@S%cret"
SPECIAL_IN_URL = "Zq7/pl#nt?d%40S%25cret"


@pytest.mark.slow
def test_a_planted_password_appears_nowhere(tmp_path, postgres):
    from tests.servers import mlflow_server, pg_dump

    (tmp_path / "server").mkdir()
    server = postgres
    with mlflow_server(tmp_path / "server") as tracking:
        storage = server.url.replace("postgres@", f"postgres:{SPECIAL_IN_URL}@")  # trust auth: any password works
        tracking = tracking.replace("http://", f"http://alice:{SPECIAL_IN_URL}@")
        (tmp_path / "work").mkdir()
        with CommandLines() as commands:
            proc = sweep(tmp_path / "work", *TINY[:-1], "--n-trials", "4", "--workers", "2", "--storage", storage,
                         "--tracking-uri", tracking, process=True)  # with the report at the end, a child process
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "postgres:***@127.0.0.1" not in proc.stdout  # nothing prints the storage on success ...
        assert "report: " in proc.stdout
        terminal = proc.stdout + proc.stderr
        optuna_store = pg_dump(server)
        assert "accum_lr" in optuna_store  # the dump holds the study: the grep below looks at the real data
        mlflow_store = files_text(tmp_path / "server")
        reports = files_text(tmp_path / "work/reports")
        assert "report.html" in {p.name for p in (tmp_path / "work/reports").rglob("*")}
        # The command the user typed holds the password (their choice); its children must not.
        children = [c for c in commands.seen if "sweeps/run.py" not in c]
        where = {"terminal": terminal, "Optuna store": optuna_store, "MLflow store and artifacts": mlflow_store,
                 "reports": reports, "child command lines": "\n".join(children)}
        assert any("analysis/report.py" in c for c in children)  # the watcher saw the report's child process
        for name, text in where.items():
            for form in (SPECIAL, SPECIAL_IN_URL, "pl#nt?d"):
                assert form not in text, f"the password is in the {name}"
        client = MlflowClient(tracking.replace(f"alice:{SPECIAL_IN_URL}@", ""))
        runs = client.search_runs([client.get_experiment_by_name("accum_lr").experiment_id])
        parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags][0]
        assert parent.data.tags["storage"] == server.url.replace("postgres@", "postgres:***@")


@pytest.mark.parametrize("flag,url,shown", [
    ("--storage", f"postgresql://bob:{PASSWORD}@127.0.0.1:9/none", "postgresql://bob:***@127.0.0.1:9/none"),
    ("--tracking-uri", f"http://alice:{PASSWORD}@127.0.0.1:9", "http://127.0.0.1:9"),
])
def test_error_lines_hide_the_password(tmp_path, flag, url, shown):
    proc = sweep(tmp_path, *TINY, flag, url, timeout=60, process=True)  # all that the script prints
    assert proc.returncode == 2 and shown in proc.stderr, proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def named_study(tmp_path_factory):
    """A tiny study whose MLflow experiment is then renamed to something that holds markup and a path."""
    folder = tmp_path_factory.mktemp("named")
    assert sweep(folder, *TINY, "--n-trials", "2", "--study-name", "plain").returncode == 0
    client = MlflowClient(f"sqlite:///{folder}/mlruns/mlflow.db")
    experiment = client.get_experiment_by_name("plain")
    name = "../<img src=x onerror=document.title='pwned'>"
    client.rename_experiment(experiment.experiment_id, name)
    run = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags][0]
    client.set_tag(run.info.run_id, "reason", "<b id='injected'>bold</b>")
    return folder, name


@pytest.mark.slow
def test_a_name_from_the_data_never_becomes_a_path(named_study):
    folder, name = named_study
    out = folder / "out"
    planted = out / folder_name([name])
    assert planted.parent == out and ".." not in planted.name.split("/")
    planted.mkdir(parents=True)
    (planted / "mine.png").write_bytes(b"not the report's")  # files the report did not write: kept, not uploaded
    (planted / "notes.txt").write_text("private")
    proc = in_process(report_cli.main, folder, "--study", name, "--out", str(out))  # (its imports paid once)
    assert proc.returncode == 0, proc.stderr
    page = Path(proc.stdout.strip().removeprefix("report: "))
    assert page.parent == planted.resolve()  # inside --out, under a derived name
    assert (planted / "mine.png").exists() and (planted / "notes.txt").exists()
    client = MlflowClient(f"sqlite:///{folder}/mlruns/mlflow.db")
    parent = [r for r in client.search_runs([client.get_experiment_by_name(name).experiment_id])
              if "mlflow.parentRunId" not in r.data.tags][0]
    uploaded = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert "report/report.html" in uploaded and not {"report/mine.png", "report/notes.txt"} & uploaded
    # A second report deletes only what the first one wrote.
    assert in_process(report_cli.main, folder, "--study", name, "--out", str(out)).returncode == 0
    assert (planted / "mine.png").read_bytes() == b"not the report's"


def test_markup_from_the_data_is_escaped_in_html_and_markdown(named_study, tmp_path):
    folder, name = named_study
    assert in_process(report_cli.main, folder, "--study", name, "--out", str(tmp_path), "--no-log").returncode == 0
    report = next(tmp_path.iterdir())
    md = (report / "report.md").read_text()
    assert not re.search(r"(?<!\\)[<>]", md)  # every angle bracket from the data is escaped
    assert "\\<img src=x onerror=document.title='pwned'\\>" in md
    page = (report / "report.html").read_text()
    assert "&lt;b id=&#39;injected&#39;&gt;bold&lt;/b&gt;" in page  # the tag, in the trials table, as text
    probe = PROBE.replace("images});", "images, title: document.title, "
                          "injected: document.querySelectorAll('#injected, [onerror]').length});")
    result = probe_in_chromium(page, tmp_path, probe)
    assert result["errors"] == [] and result["injected"] == 0 and result["title"] != "pwned"
    assert all(i["ok"] for i in result["images"])
    assert "python analysis/report.py --study &#39;../&lt;img src=x" in page  # the reproduce line: quoted, escaped


def test_plan_shows_its_store_without_the_password(tmp_path, postgres):
    """A batch_memory study in a PostgreSQL-backed MLflow store: the plan names the store it learned from."""
    server = postgres
    uri = server.url.replace("postgres@", f"postgres:{SPECIAL_IN_URL}@")  # (a database of its own)
    client = MlflowClient(uri)
    experiment = client.create_experiment("batch_memory")
    for b, peak in ((8, 1000.0), (32, 3000.0)):
        run = client.create_run(experiment, tags={"memory_source": "saved_tensors"}).info.run_id
        for key, value in (("model", "mlp"), ("dataset", "mnist1d"), ("physical_batch", b)):
            client.log_param(run, key, value)
        client.log_metric(run, "peak_memory_bytes", peak)
        client.set_terminated(run, "FINISHED")
    proc = sweep(tmp_path, "--plan", "--model", "mlp", "--target-batch", "64", "--memory-budget", "1MiB",
                 "--tracking-uri", uri, timeout=120, process=True)
    assert proc.returncode == 0, proc.stderr
    assert "from the batch_memory study in postgresql://postgres:***@127.0.0.1" in proc.stdout, proc.stdout
    for form in (SPECIAL, SPECIAL_IN_URL, "pl#nt?d"):
        assert form not in proc.stdout + proc.stderr


def test_the_report_never_follows_a_link_out_of_its_folder(named_study, tmp_path):
    folder, name = named_study
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (outside / ".batchsweep-report").write_text("precious.txt\n")  # a manifest that names it
    out = tmp_path / "out"
    out.mkdir()
    (out / folder_name([name])).symlink_to(outside)
    proc = run_script("analysis/report.py", "--study", name, "--out", str(out), "--no-log", cwd=folder)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "symbolic link" in proc.stderr
    assert proc.stderr.count("\n") == 1 and (outside / "precious.txt").read_text() == "keep"


@pytest.mark.parametrize("out,expected", [("a-file", "is a file: name a folder"),
                                          ("a-file/below", "cannot create the report folder")])
def test_a_report_folder_that_cannot_exist_is_one_line(named_study, tmp_path, out, expected):
    folder, name = named_study
    (tmp_path / "a-file").write_text("")
    proc = run_script("analysis/report.py", "--study", name, "--out", str(tmp_path / out), "--no-log", cwd=folder)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr


def test_markdown_escapes_line_breaks_and_bare_links():
    from batchsweep.analysis.render import md

    text = md("see https://evil.example/x and www.evil.example\r\n# heading\rnext")
    assert "\r" not in text and "\n" not in text
    assert not re.search(r"https?://", text) and not re.search(r"(?<![\\])www\.", text)
    assert "https\\://evil.example/x" in text and "www\\.evil.example" in text


def test_the_help_names_every_flag_that_runs_code():
    text = run_script("sweeps/run.py", "--help").stdout
    assert "runs code" in text and "--study" in text and "docs/security.md" in text
