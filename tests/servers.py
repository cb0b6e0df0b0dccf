"""Real servers for tests, bound to 127.0.0.1: PostgreSQL (Debian's package) and an MLflow tracking server."""
import contextlib
import glob
import os
import shutil
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


@contextlib.contextmanager
def postgres_server():
    """A throw-away PostgreSQL cluster; yields its URL. Skips only off CI when PostgreSQL is not installed."""
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
    data, port = folder / "data", free_port()
    subprocess.run([*as_postgres, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"],
                   check=True, capture_output=True)
    subprocess.run([*as_postgres, pg_ctl, "-D", str(data), "-l", str(folder / "log"), "-w", "-t", "60",
                    "-o", f"-p {port} -h 127.0.0.1 -k {folder} -c fsync=off", "start"], check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_postgres, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """`mlflow server` on 127.0.0.1 with a SQLite backend; yields its URL."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow_cli), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{folder}/server.db",
                             "--artifacts-destination", str(folder / "artifacts")],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(folder / "server.log", "w"))
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
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


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
