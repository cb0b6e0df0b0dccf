"""Storage and tracking URLs: checked before use, shown without their password, credentials kept out of them.

A password in `postgresql://user:pw@host/db` or `http://user:pw@host` must never reach a terminal, a log,
a store, an artifact or a command line: every URL that batchsweep shows goes through `redact`, every
message that may quote one through `scrub`, and an http(s) tracking URI's user and password move into
MLflow's own variables (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) before anything uses it.
"""
from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from trainers.config import ConfigError

STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")
TRACKING_SCHEMES = ("sqlite", "postgresql", "mysql", "http", "https")


def _password(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url).password
    except ValueError:
        return None


def redact(url: str) -> str:
    """The URL with its password as ***: scheme, user, host, port and database stay."""
    parts = urllib.parse.urlsplit(url) if "://" in url else None
    if parts is None or _password(url) is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # IPv6
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def scrub(text: str, *urls: str) -> str:
    """`text` with every password of `urls` (as written and decoded) and every URL itself redacted."""
    for url in urls:
        password = _password(url)
        text = text.replace(url, redact(url))
        if password:
            for form in {password, urllib.parse.unquote(password)}:  # as written, and as the server sees it
                text = text.replace(form, "***")
    return text


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].split("+", 1)[0] if "://" in url else ""


def _check_sqlite(url: str, flag: str) -> None:
    if not url.startswith("sqlite:///") or not url.removeprefix("sqlite:///").strip("/"):
        raise ConfigError(f"{flag} {url!r} is not a SQLite URL: write sqlite:///relative/path.db or "
                          f"sqlite:////absolute/path.db (three slashes before the path)")


def check_storage(url: str) -> str:
    """Validate an Optuna storage URL (or journal:PATH) before anything is opened."""
    if url.startswith("journal:"):
        if not url.removeprefix("journal:").strip():
            raise ConfigError("--storage 'journal:' names no file: write journal:PATH, e.g. journal:mlruns/optuna.log")
        return url
    scheme = _scheme(url)
    if scheme not in STORAGE_SCHEMES:
        raise ConfigError(f"unknown storage {redact(url)!r}: use sqlite:///PATH, postgresql://..., mysql://... "
                          f"or journal:PATH")
    if scheme == "sqlite":
        _check_sqlite(url, "--storage")
    return url


def check_tracking_uri(url: str) -> str:
    """Validate a tracking URI; an http(s) one gives up its user and password to MLflow's variables, so that
    what remains can be shown, stored and passed on. Returns the URI to use."""
    scheme = _scheme(url)
    if scheme not in TRACKING_SCHEMES:
        raise ConfigError(f"unknown tracking URI {redact(url)!r}: use sqlite:///PATH, http(s)://HOST:PORT or a "
                          f"database URL")
    if scheme == "sqlite":
        _check_sqlite(url, "--tracking-uri")
    if scheme in ("http", "https"):
        parts = urllib.parse.urlsplit(url)
        if parts.username is not None or parts.password is not None:
            os.environ["MLFLOW_TRACKING_USERNAME"] = urllib.parse.unquote(parts.username or "")
            os.environ["MLFLOW_TRACKING_PASSWORD"] = urllib.parse.unquote(parts.password or "")
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    return url


def sqlite_path(url: str) -> Path | None:
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
