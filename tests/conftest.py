import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)  # tests are many small runs; one thread each is fastest on 2 cores
# A suite started in the background (`cmd &` without job control, nohup) inherits SIGINT ignored, and so would
# every sweep it starts: the Ctrl-C tests need Python's own handler, here and in the processes started from here.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def close_figures():
    """The figures a test drew in this process are closed after it: an xdist worker runs many such tests, and
    which of them reaches matplotlib's 21st open figure (a warning) depends on how the tests were shared out."""
    yield
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> str:
    """One MNIST-1D cache for the whole session."""
    from batchsweep.trainers.data import mnist1d

    path = tmp_path_factory.mktemp("data")
    mnist1d(str(path))
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def mlflow_schema_once(tmp_path_factory):
    """A new SQLite MLflow store made in this process gets the schema that MLflow's own migrations made once
    this session, copied statement by statement with the rows they wrote (0.1 s), instead of running its
    migrations again (7 to 9 s on 2 cores, for every test that starts a store): the same tables, indexes and
    alembic version, so MLflow checks and uses it as its own. A store made by a command that a test starts as
    a process runs the migrations as a user's does."""
    import sqlalchemy
    from mlflow.store.db import utils

    original = getattr(utils, "_initialize_tables", None)
    if original is None:  # (another MLflow: every store runs its migrations)
        yield
        return
    template = sqlalchemy.create_engine(f"sqlite:///{tmp_path_factory.mktemp('mlflow-schema')}/mlflow.db")
    original(template)
    with template.connect() as db:
        objects = db.exec_driver_sql("SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL AND name "
                                     "NOT LIKE 'sqlite_%'").fetchall()
        ddl = [sql for kind in ("table", "index", "view", "trigger") for t, _, sql in objects if t == kind]
        rows = {name: db.exec_driver_sql(f'SELECT * FROM "{name}"').fetchall() for t, name, _ in objects
                if t == "table"}
    template.dispose()

    def initialize(engine):
        if engine.dialect.name != "sqlite":
            return original(engine)
        with engine.begin() as db:
            for sql in ddl:
                db.exec_driver_sql(sql)
            for name, values in rows.items():
                for row in values:
                    db.exec_driver_sql(f'INSERT INTO "{name}" VALUES ({", ".join("?" * len(row))})', tuple(row))

    utils._initialize_tables = initialize
    yield
    utils._initialize_tables = original


def run_script(script: str, *args: str, cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """Run an entry script as a user would, with the project on PYTHONPATH (for tests.factories)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=timeout, env=full_env)


def in_process(main, cwd, *args: str) -> subprocess.CompletedProcess:
    """A command's `main(argv)` run in this test process from `cwd`, as its script runs it: its exit status
    and what it prints, without paying the imports of torch and MLflow (seconds) again for every call. What
    the processes it starts write themselves (a report's lines, a worker's traceback) is not captured, and
    the environment it changes is restored; nor is there a timeout. A test of those runs the script as a
    process."""
    out, err, environ, here = io.StringIO(), io.StringIO(), dict(os.environ), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    except SystemExit as exc:  # argparse's usage errors and --help
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def pytest_collection_modifyitems(items):
    """A test that uses the PostgreSQL server is slow: the full suite runs it, `-m "not slow"` leaves it out."""
    for item in items:
        if "postgres" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def postgres_cluster():
    """One throw-away PostgreSQL cluster for the session (for each of pytest-xdist's processes)."""
    from tests.servers import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture
def postgres(postgres_cluster, request):
    """A new database in the session's cluster: `.url` names it."""
    import re as _re

    from tests.servers import Database

    return Database(postgres_cluster, "t_" + _re.sub(r"\W", "_", request.node.name.lower())[:40] + f"_{os.getpid()}")
