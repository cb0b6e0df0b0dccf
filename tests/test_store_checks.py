"""Stores and URLs checked once, quickly, before any work: a password with any character URL syntax treats
specially stays hidden, a malformed or unreachable store is one line within seconds, and a study too large to
enumerate is refused from its axes' lengths."""
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from batchsweep.sweeps.stores.urls import check_storage, check_tracking_uri, redact, runs_address, scrub
from tests.conftest import ROOT
from tests.test_sweeps import TINY

# Every character URL syntax treats specially: '/', '#' and '?' as they are (SQLAlchemy takes them), '@' and
# '%' percent-encoded (as a URL must hold them).
DECODED = "Zq7/pl#nt?d@S%cr"
WRITTEN = "Zq7/pl#nt?d%40S%25cr"


@pytest.mark.parametrize("url,shown", [
    (f"postgresql://bob:{WRITTEN}@db.example:5432/optuna", "postgresql://bob:***@db.example:5432/optuna"),
    (f"postgresql+psycopg://bob:{WRITTEN}@127.0.0.1/optuna?sslmode=require",
     "postgresql+psycopg://bob:***@127.0.0.1/optuna?sslmode=require"),
    (f"mysql://bob:{WRITTEN}@[::1]:3306/optuna", "mysql://bob:***@[::1]:3306/optuna"),
    (f"http://alice:{WRITTEN}@127.0.0.1:5000", "http://alice:***@127.0.0.1:5000"),
    ("postgresql://bob@db/optuna", "postgresql://bob@db/optuna"),
    ("sqlite:////tmp/optuna.db", "sqlite:////tmp/optuna.db"),
])
def test_a_password_with_special_characters_is_redacted(url, shown):
    from sqlalchemy.engine import make_url

    assert redact(url) == shown
    if not url.startswith("http"):  # where the password is, as the consumer reads it
        assert make_url(url).password in (None, DECODED)
    if WRITTEN in url:
        line = scrub(f"failed for {url}: password {DECODED} or {WRITTEN} refused", url)
        assert DECODED not in line and WRITTEN not in line and "pl#nt" not in line


def test_http_credentials_with_special_characters_move_to_mlflows_variables(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert check_tracking_uri(f"http://alice:{WRITTEN}@127.0.0.1:5000/x") == "http://127.0.0.1:5000/x"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "alice"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == DECODED


@pytest.mark.parametrize("check,url,expected", [
    (check_storage, f"postgresql://u:{WRITTEN}@h:abc/db", "has a port that is not a number from 1 to 65535"),
    (check_tracking_uri, f"http://a:{WRITTEN}@:5000", "names no host"),
    (check_tracking_uri, "http://127.0.0.1:99999", "has a port that is not a number from 1 to 65535"),
    (check_tracking_uri, "sqlite:////tmp", "names a folder: name the database file in it, e.g. "
                                           "sqlite:////tmp/mlflow.db"),
    (check_storage, "sqlite:////tmp", "e.g. sqlite:////tmp/optuna.db"),
])
def test_malformed_urls_are_one_line_that_hides_the_password(check, url, expected):
    from batchsweep.trainers import ConfigError

    with pytest.raises(ConfigError) as info:
        check(url)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert DECODED not in str(info.value) and WRITTEN not in str(info.value)


def batchsweep(cwd, *args, timeout=60):
    """The installed command, timed."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "import sys; from batchsweep.sweeps.commands import main; sys.exit(main())",
                           *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return proc, time.monotonic() - start


@pytest.mark.parametrize("args,expected", [
    (["plan", "--target-batch", "64", "--memory-budget", "1GiB", "--tracking-uri",
      f"postgresql://u:{WRITTEN}@127.0.0.1:1/db"], "cannot reach the database postgresql://u:***@127.0.0.1:1/db"),
    (["report", "--study", "x", "--tracking-uri", f"http://u:{WRITTEN}@127.0.0.1:1"],
     "cannot reach the MLflow tracking server http://127.0.0.1:1"),
    (["run", *TINY, "--tracking-uri", f"postgresql://u:{WRITTEN}@127.0.0.1:1/db"],
     "cannot reach the database postgresql://u:***@127.0.0.1:1/db"),
])
def test_an_unreachable_store_is_one_line_in_seconds(tmp_path, args, expected):
    proc, seconds = batchsweep(tmp_path, *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and expected in proc.stderr, proc.stderr
    assert proc.stderr.endswith("): start its server, or pass another --tracking-uri\n"), proc.stderr  # no file
    assert DECODED not in proc.stdout + proc.stderr and WRITTEN not in proc.stdout + proc.stderr
    assert seconds < 30, seconds  # (about 5 s here; the clients' own retries took minutes)


def test_a_damaged_store_for_plan_is_one_line(tmp_path):
    (tmp_path / "mlruns").mkdir()
    (tmp_path / "mlruns/mlflow.db").write_bytes(os.urandom(4096))
    proc, _ = batchsweep(tmp_path, "plan", "--target-batch", "64", "--memory-budget", "1GiB")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot read the SQLite database" in proc.stderr and "mlflow.db" in proc.stderr
    assert proc.stderr.endswith("): move the file aside if it is damaged, or pass another --tracking-uri\n")


def test_a_grid_too_large_to_enumerate_is_refused_from_its_axes(tmp_path):
    axis = ", ".join(str(i) for i in range(1, 501))
    study = tmp_path / "big.toml"
    study.write_text(f'name = "big"\n[grid]\nphysical_batch = [{axis}]\neval_batch = [{axis}]\n')
    proc, seconds = batchsweep(tmp_path, "run", "--study", str(study), "--dry-run")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr == (f"error: {study}: 500 x 500 grid values x 1 trials x 1 seeds (seeds in the file) = up "
                           f"to 250,000 trials, more than the limit of 100,000: shorten the [grid] axes or lower "
                           f"the seeds\n")
    assert seconds < 30, seconds  # (about 4 s here; enumerating it did not end in minutes)


def test_more_seeds_on_the_command_line_are_counted_before_enumerating(tmp_path, monkeypatch, capsys):
    from batchsweep.sweeps.cli import main

    axis = ", ".join(str(i) for i in range(1, 201))
    study = tmp_path / "wide.toml"
    study.write_text(f'name = "wide"\n[grid]\nphysical_batch = [{axis}]\n[search]\ntwins = false\n')
    monkeypatch.chdir(tmp_path)
    assert main(["--study", str(study), "--seeds", "1000", "--dry-run"]) == 2
    assert "200 grid values x 1 trials x 1000 seeds (--seeds) = up to 200,000 trials" in capsys.readouterr().err


def test_a_store_left_by_a_killed_writer_is_reachable(tmp_path):
    """A process killed in the middle of a write leaves a hot journal: the next client rolls it back, so the
    quick look at the store must not take it for a damaged one (a read-only look cannot roll it back)."""
    import sqlite3

    from batchsweep.sweeps.stores.urls import unreachable

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as setup:
        setup.execute("CREATE TABLE t (x BLOB)")
    writer = subprocess.Popen([sys.executable, "-c", f"""
import sqlite3, sys, time
db = sqlite3.connect({str(db)!r}, isolation_level=None)
db.execute("PRAGMA cache_size = 1")  # the changes spill into the database file before any commit
db.execute("BEGIN")
for _ in range(200):
    db.execute("INSERT INTO t VALUES (randomblob(4096))")
print("writing", flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    assert (tmp_path / "mlflow.db-journal").exists()  # hot: the killed transaction is still to be rolled back
    assert unreachable(f"sqlite:///{db}") is None
    with sqlite3.connect(db) as after:
        assert after.execute("SELECT count(*) FROM t").fetchone() == (0,)  # rolled back, whole


def open_tracker_together(uri: str, together, results) -> None:
    from batchsweep.sweeps.stores.mlflow_store import Tracker

    together.wait()  # both have imported MLflow
    try:
        Tracker(uri, "race")
        results.put("ok")
    except Exception as exc:
        results.put(str(exc)[:300])


def test_two_machines_that_open_a_new_tracking_database_at_once_both_start(tmp_path, postgres):
    """Each creates MLflow's tables, and on PostgreSQL the one whose CREATE collides fails with a unique
    violation in the catalog: it tries again and finds them made. Both open the database at the same instant
    (without the retry, one of them failed in each of 7 tries here; a start apart passes either way)."""
    import multiprocessing

    server = postgres
    context = multiprocessing.get_context("spawn")
    results, together = context.Queue(), context.Barrier(2)
    machines = [context.Process(target=open_tracker_together, args=(server.url, together, results))
                for _ in range(2)]
    for machine in machines:
        machine.start()
    said = [results.get(timeout=180) for _ in machines]
    for machine in machines:
        machine.join(timeout=60)
    assert said == ["ok", "ok"], said


def test_a_new_storage_whose_schema_another_process_stamped_meanwhile_opens(tmp_path):
    """Two processes that open a new SQLite storage at once (two machines, or a viewer such as a test's poll) both
    stamp Optuna's schema version: the later insert hits the unique key, and the run stopped in one line ("check
    the URL and that the server runs"). Here the other process's stamp lands, deterministically, just before this
    one's: a trigger inserts the same row once, so SQLite's own constraint fails the insert. Tried again, the
    storage finds the schema stamped and opens."""
    import optuna
    import sqlalchemy

    from batchsweep.sweeps.stores.optuna_store import open_storage

    url = f"sqlite:///{tmp_path}/optuna.db"
    optuna.storages.RDBStorage(url).engine.dispose()  # the other process's tables, before its version row
    stamped = []  # calls of the trigger's condition: SQLite rolls back the row with the failed insert, not this

    def first_time() -> bool:
        stamped.append(1)
        return len(stamped) == 1

    def other_process(connection, _):
        connection.create_function("other_process_stamps", 0, first_time)

    with sqlite3.connect(tmp_path / "optuna.db") as db:
        db.execute("DELETE FROM alembic_version")
        db.execute("CREATE TRIGGER other BEFORE INSERT ON alembic_version WHEN other_process_stamps() "
                   "BEGIN INSERT INTO alembic_version VALUES (NEW.version_num); END")
    sqlalchemy.event.listen(sqlalchemy.engine.Engine, "connect", other_process)
    try:
        storage = open_storage(url)
    finally:
        sqlalchemy.event.remove(sqlalchemy.engine.Engine, "connect", other_process)
    assert len(stamped) == 2  # the collision, then the stamp that went through
    assert optuna.create_study(storage=storage, study_name="after").study_name == "after"


def test_the_runs_address_opens_the_runs_table_of_a_server_or_says_how_to_serve_a_local_store():
    assert runs_address("http://u:secret@host:5000/", "7") == "http://u:***@host:5000/#/experiments/7/runs"
    assert runs_address("sqlite:////tmp/my runs/mlflow.db", "1") == (
        "mlflow ui --backend-store-uri 'sqlite:////tmp/my runs/mlflow.db', then "
        "http://127.0.0.1:5000/#/experiments/1/runs")
