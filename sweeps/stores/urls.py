"""Storage and tracking URLs: checked before use, shown without their password, credentials kept out of them.

A password in `postgresql://user:pw@host/db` or `http://user:pw@host` must never reach a terminal, a log,
a store, an artifact or a command line: every URL that batchsweep shows goes through `redact`, every
message that may quote one through `scrub`, and an http(s) tracking URI's user and password move into
MLflow's own variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) before anything uses it.

The user information is found as SQLAlchemy's `make_url` finds it (the consumer of database URLs): the
password runs from the first ':' after the user to the first '@', so it may hold '/', '#' and '?', which
`urllib.parse.urlsplit` would take for the start of a path, fragment or query. http(s) URIs are read the
same way, since their credentials are taken out here before MLflow sees them.

This module uses the standard library only (analysis/ uses it without importing the trainer).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "http", "https")
DATABASES = ("postgresql", "mysql")
REACH_TIMEOUT_S = 4.0  # a store that has not answered by then is refused, rather than waited for minutes
# What to do about a store that `unreachable` refuses: a server, or a file.
SERVER_ADVICE = "start its server, or pass another --tracking-uri"
FILE_ADVICE = "move the file aside if it is damaged, or pass another --tracking-uri"

# scheme://user:password@ — SQLAlchemy's own pattern for the user information (sqlalchemy/engine/url.py).
USERINFO = re.compile(r"(?P<scheme>[\w+.-]+)://(?P<user>[^:/@]*)(?::(?P<password>[^@]*))?@")


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].split("+", 1)[0] if "://" in url else ""


def redact(url: str) -> str:
    """The URL with its password as ***: scheme, user, host, port and database stay."""
    match = USERINFO.match(url)
    if not match or match.group("password") is None:
        return url
    return url[:match.start("password")] + "***" + url[match.end("password"):]


def scrub(text: str, *urls: str) -> str:
    """`text` with every password of `urls` (as written and decoded) and every URL itself redacted."""
    for url in urls:
        match = USERINFO.match(url)
        password = match.group("password") if match else None
        text = text.replace(url, redact(url))
        if password:
            for form in {password, urllib.parse.unquote(password)}:  # as written, and as the server sees it
                text = text.replace(form, "***")
    return text


def without_credentials(url: str) -> tuple[str, str | None, str | None]:
    """An http(s) URI without its user information, and the user and password it held (decoded)."""
    match = USERINFO.match(url)
    if _scheme(url) not in ("http", "https") or not match:
        return url, None, None
    password = match.group("password")
    return (f"{match.group('scheme')}://{url[match.end():]}", urllib.parse.unquote(match.group("user")),
            None if password is None else urllib.parse.unquote(password))


def problem(url: str, flag: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with a URL's form, in words that say what to write instead; None when nothing is."""
    scheme = _scheme(url)
    if scheme not in schemes:
        kind = "storage" if flag == "--storage" else "tracking URI"
        return (f"unknown {kind} {redact(url)!r}: use sqlite:///PATH, " + (
            "postgresql://..., mysql://... or journal:PATH" if flag == "--storage" else
            "http(s)://HOST:PORT or a database URL"))
    if scheme == "sqlite":
        if not url.startswith("sqlite:///") or not url.removeprefix("sqlite:///").strip("/"):
            return (f"{flag} {url!r} is not a SQLite URL: write sqlite:///relative/path.db or "
                    f"sqlite:////absolute/path.db (three slashes before the path)")
        if sqlite_path(url).is_dir():
            file = "optuna.db" if flag == "--storage" else "mlflow.db"
            return f"{flag} {url!r} names a folder: name the database file in it, e.g. {url.rstrip('/')}/{file}"
        return None
    bare = without_credentials(url)[0] if scheme in ("http", "https") else USERINFO.sub(r"\g<scheme>://", url, 1)
    try:
        parts = urllib.parse.urlsplit(bare)
        port = parts.port  # raises on a port that is not a number from 0 to 65535
    except ValueError:
        return f"{flag} {redact(url)!r} has a port that is not a number from 1 to 65535: write HOST:PORT, e.g. :5432"
    if not parts.hostname:
        return f"{flag} {redact(url)!r} names no host: write {scheme}://HOST:PORT..."
    if port == 0:
        return f"{flag} {redact(url)!r} has port 0: give the port the server listens on"
    return None


def _config_error(message: str) -> Exception:
    from batchsweep.trainers import ConfigError  # here, not above: analysis/ imports this module without torch

    return ConfigError(message)


def check_storage(url: str) -> str:
    """Validate an Optuna storage URL (or journal:PATH) before anything is opened."""
    if url.startswith("journal:"):
        if not url.removeprefix("journal:").strip():
            raise _config_error("--storage 'journal:' names no file: write journal:PATH, e.g. "
                                "journal:mlruns/optuna.log")
        return url
    wrong = problem(url, "--storage", STORAGE_SCHEMES)
    if wrong:
        raise _config_error(wrong)
    return url


def check_tracking_uri(url: str) -> str:
    """Validate a tracking URI; an http(s) one gives up its user and password to MLflow's variables, so that
    what remains can be shown, stored and passed on. Returns the URI to use."""
    wrong = problem(url, "--tracking-uri", TRACKING_SCHEMES)
    if wrong:
        raise _config_error(wrong)
    return hand_over_credentials(url)


def hand_over_credentials(url: str) -> str:
    """An http(s) URI's user and password into MLflow's own variables; returns the URI without them."""
    bare, user, password = without_credentials(url)
    if user is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    return bare


def unreachable(url: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """One quick look at a store before any work, so that a server that is down or hung is one line in seconds,
    not minutes of a client's retries: why it cannot be used and what to do, or None. An http(s) URI here holds no
    credentials (they went to MLflow's variables), so none go into a host-name lookup."""
    scheme = _scheme(url)
    if scheme in ("http", "https"):
        try:
            urllib.request.urlopen(f"{url.rstrip('/')}/api/2.0/mlflow/experiments/search?max_results=1",
                                   timeout=timeout)
        except urllib.error.HTTPError:
            return None  # it answered
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            why = scrub(str(reason), url)
            return f"cannot reach the MLflow tracking server {redact(url)} ({why}): {SERVER_ADVICE}"
        return None
    if scheme == "sqlite":
        path = sqlite_path(url)
        if not path.exists():
            return None  # created on first use
        # Read-write (never created here): a process killed mid-write leaves a journal that the next reader must
        # roll back, which a read-only connection cannot ("attempt to write a readonly database").
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=timeout)) as db:
                db.execute("PRAGMA schema_version").fetchone()
        except sqlite3.Error as exc:
            if "locked" in str(exc):  # another writer holds it: it is there, and the stores' clients wait
                return None
            return f"cannot read the SQLite database {path} ({exc}): {FILE_ADVICE}"
        return None
    if scheme in DATABASES:
        return _database_unreachable(url, timeout)
    return None


def _database_unreachable(url: str, timeout: float) -> str | None:
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url, connect_args={"connect_timeout": max(1, round(timeout))},
                                          poolclass=sqlalchemy.pool.NullPool)
        with engine.connect():
            pass
    except Exception as exc:  # the driver's own errors: refused, timed out, no such database, wrong password
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return f"cannot reach the database {redact(url)} ({scrub(text, url)}): {SERVER_ADVICE}"
    return None


def sqlite_path(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def runs_address(url: str, experiment_id: str) -> str:
    """Where the MLflow UI shows a study's runs table (3.x opens an experiment on its overview, the runs one click
    away): the tracking server's own page, or for a local store the command that serves it and the address."""
    page = f"#/experiments/{experiment_id}/runs"
    if url.startswith(("http://", "https://")):
        return f"{redact(url).rstrip('/')}/{page}"
    return f"mlflow ui --backend-store-uri {shlex.quote(redact(url))}, then http://127.0.0.1:5000/{page}"
