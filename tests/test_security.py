"""Secrets never shown or stored, names never paths, text from the data escaped in the report."""
import os
import re
import threading
from pathlib import Path

import pytest
from mlflow import MlflowClient

from analysis.render import folder_name
from sweeps.urls import check_tracking_uri, redact, scrub
from tests.conftest import run_script
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


def test_http_credentials_move_to_mlflows_variables(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert check_tracking_uri(f"http://alice:{PASSWORD}@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD


class CommandLines:
    """Reads every process's command line on this machine, about every 10 ms, while a test runs."""

    def __init__(self):
        self.seen: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.stop.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        self.seen.add((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                    except OSError:
                        pass
            self.stop.wait(0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.stop.set()
        self.thread.join()


def files_text(folder: Path) -> str:
    return "".join(p.read_bytes().decode(errors="replace") for p in folder.rglob("*") if p.is_file())


def test_a_planted_password_appears_nowhere(tmp_path):
    from tests.servers import mlflow_server, pg_dump, postgres_server

    (tmp_path / "server").mkdir()
    with postgres_server() as server, mlflow_server(tmp_path / "server") as tracking:
        storage = server.url.replace("postgres@", f"postgres:{PASSWORD}@")  # trust auth: any password works
        tracking = tracking.replace("http://", f"http://alice:{PASSWORD}@")
        (tmp_path / "work").mkdir()
        with CommandLines() as commands:
            proc = sweep(tmp_path / "work", *TINY[:-1], "--n-trials", "4", "--workers", "2", "--storage", storage,
                         "--tracking-uri", tracking)  # with the report at the end, a child process
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
            assert PASSWORD not in text, f"the password is in the {name}"
        client = MlflowClient(tracking.replace(f"alice:{PASSWORD}@", ""))
        runs = client.search_runs([client.get_experiment_by_name("accum_lr").experiment_id])
        parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags][0]
        assert parent.data.tags["storage"] == server.url.replace("postgres@", "postgres:***@")


@pytest.mark.parametrize("flag,url,shown", [
    ("--storage", f"postgresql://bob:{PASSWORD}@127.0.0.1:9/none", "postgresql://bob:***@127.0.0.1:9/none"),
    ("--tracking-uri", f"http://alice:{PASSWORD}@127.0.0.1:9", "http://127.0.0.1:9"),
])
def test_error_lines_hide_the_password(tmp_path, flag, url, shown):
    proc = sweep(tmp_path, *TINY, flag, url, timeout=60)
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


def test_a_name_from_the_data_never_becomes_a_path(named_study):
    folder, name = named_study
    out = folder / "out"
    planted = out / folder_name([name])
    assert planted.parent == out and ".." not in planted.name.split("/")
    planted.mkdir(parents=True)
    (planted / "mine.png").write_bytes(b"not the report's")  # files the report did not write: kept, not uploaded
    (planted / "notes.txt").write_text("private")
    proc = run_script("analysis/report.py", "--study", name, "--out", str(out), cwd=folder)
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
    assert run_script("analysis/report.py", "--study", name, "--out", str(out), cwd=folder).returncode == 0
    assert (planted / "mine.png").read_bytes() == b"not the report's"


def test_markup_from_the_data_is_escaped_in_html_and_markdown(named_study, tmp_path):
    folder, name = named_study
    assert run_script("analysis/report.py", "--study", name, "--out", str(tmp_path), "--no-log",
                      cwd=folder).returncode == 0
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
