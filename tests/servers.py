"""Real servers for tests, bound to 127.0.0.1: PostgreSQL (Debian's package) and an MLflow tracking server."""
import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name: str) -> str | None:
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.path.exists(f"{folder}/{name}"):
            return f"{folder}/{name}"
    return shutil.which(name)


class Postgres:
    """A throw-away PostgreSQL cluster on 127.0.0.1 (trust authentication: any password is accepted)."""

    def __init__(self, folder: Path, as_postgres: list[str], pg_ctl: str):
        self.folder, self.as_postgres, self.pg_ctl = folder, as_postgres, pg_ctl
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        subprocess.run([*self.as_postgres, self.pg_ctl, "-D", str(self.folder / "data"), "-l",
                        str(self.folder / "log"), "-w", "-t", "60", "-o",
                        f"-p {self.port} -h 127.0.0.1 -k {self.folder} -c fsync=off", "start"],
                       check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run([*self.as_postgres, self.pg_ctl, "-D", str(self.folder / "data"), "-m", "immediate", "stop"],
                       capture_output=True)


@contextlib.contextmanager
def postgres_server():
    """A throw-away PostgreSQL cluster; yields it (`.url`, `.stop()`, `.start()`). Skips only off CI when
    PostgreSQL is not installed."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL server binaries are missing: .ci/run installs Debian's postgresql")
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    folder = Path(tempfile.mkdtemp(prefix="batchsweep-pg-"))
    as_postgres = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        shutil.chown(folder, "postgres", "postgres")
        as_postgres = ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_postgres, initdb, "-D", str(folder / "data"), "-A", "trust", "-U", "postgres", "--no-sync"],
                   check=True, capture_output=True)
    server = Postgres(folder, as_postgres, pg_ctl)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


class Database:
    """A database of its own in a cluster that a test session shares (`.url`, `.port`, `.name`): a test starts
    no cluster of its own unless it stops the server."""

    def __init__(self, cluster: Postgres, name: str):
        self.cluster, self.name, self.port, self.as_postgres = cluster, name, cluster.port, cluster.as_postgres
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/{name}"
        subprocess.run([*self.as_postgres, _pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                        "-c", f"CREATE DATABASE {name}"], check=True, capture_output=True)


def pg_dump(server: Postgres | Database) -> str:
    """Everything the database holds, as SQL text."""
    return subprocess.run([*server.as_postgres, _pg_bin("pg_dump"), "-h", "127.0.0.1", "-p", str(server.port),
                           "-U", "postgres", getattr(server, "name", "postgres")], check=True, capture_output=True,
                          text=True).stdout


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` on 127.0.0.1 with a SQLite backend; yields its URL."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    log = open(folder / "server.log", "w")
    # Its own process group, stopped whole: `mlflow server` serves through a uvicorn child, which a SIGKILL of the
    # parent alone (when it does not stop in time) would leave running.
    proc = subprocess.Popen([str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{folder}/server.db",
                             "--artifacts-destination", str(folder / "artifacts")],
                            env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):  # (a server that never started has no group left)
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@contextlib.contextmanager
def hung_server():
    """A port on 127.0.0.1 that accepts connections and never answers; yields the port."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
