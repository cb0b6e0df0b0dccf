"""The Optuna storage: opened once per process, its studies created once, and the trials of dead processes
failed so that their points run again."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import sys
import threading
import time
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from batchsweep.trainers import BatchsweepError, ConfigError

from ..launch.program import redacted
from .mlflow_store import HOST, PROCESSES, TABLES_RACE, first_line, pid_alive
from .urls import check_storage, redact, sqlite_path

HEARTBEAT_GRACE_S = 120  # a trial whose process sent no heartbeat for this long is dead
PROTOCOL = "batchsweep.protocol"  # the Optuna study's user attribute that holds what its trials share
NOT_A_JOURNAL = "pass a journal file to --storage journal:PATH, or move a damaged one aside"
CREATOR_GRACE_S = 5  # how long a study without trials or settings waits for the machine that created it
# Fields that say where a trial runs and how fast, not what it measures: they may differ between invocations.
WHERE = ("seed", "device", "data_dir", "eval_batch", "num_workers", "pin_memory", "prefetch_factor")


class StorageError(BatchsweepError):
    """The Optuna storage cannot be opened, or stopped accepting writes."""


def is_storage_failure(exc: BaseException) -> bool:
    """Whether an exception came from the storage (Optuna's or SQLAlchemy's errors, a journal file's OSError)."""
    import sqlalchemy.exc

    return isinstance(exc, (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError, OSError))


def default_storage(root: str = "mlruns") -> str:
    return f"sqlite:///{Path(root).resolve()}/optuna.db"


def heartbeat_failed(args: threading.ExceptHookArgs) -> None:
    """Optuna's heartbeat thread dies with a traceback when the storage refuses a write; one line instead (the
    worker's own loop stops the study in one line if the storage stays that way)."""
    if args.thread is not None and args.thread.name.endswith("(_record_heartbeat)"):
        print(f"warning: the Optuna storage refused the running trial's heartbeat ({args.exc_type.__name__}); "
              f"the trial goes on", file=sys.stderr)
        return
    threading.__excepthook__(args)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """SQLite, PostgreSQL or MySQL through Optuna's RDB storage, or `journal:PATH` for a journal file."""
    check_storage(url)
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = url.removeprefix("journal:")
        try:
            check_journal(path)
            return optuna.storages.JournalStorage(JournalFileBackend(path))
        except ValueError:  # Optuna's replay met a line before the last that does not parse
            raise StorageError(f"cannot read the Optuna journal {path}: a line before its last is not one of "
                               f"Optuna's records: {NOT_A_JOURNAL}") from None
        except OSError as exc:
            raise StorageError(f"cannot open the Optuna journal {path} ({exc.strerror}): make its folder "
                               f"writable or pass another --storage") from None
    connect = connect_args(url)
    if sqlite_path(url) is not None:
        folder = sqlite_path(url).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the Optuna storage folder {folder} ({exc.strerror}): "
                               f"make it writable or pass --storage") from None
    for attempt in range(3):
        try:
            with warnings.catch_warnings():  # heartbeats are marked experimental; they have worked since Optuna 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                # Heartbeats let any worker fail a trial whose process died on another machine.
                rdb = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect},
                                                 heartbeat_interval=30, grace_period=HEARTBEAT_GRACE_S)
            return cached(rdb)
        except Exception as exc:
            # Two processes opening a new database at once (two machines, or a viewer of the new file) both create
            # the schema: the one whose table or version row collided finds them made next time.
            if any(race in str(exc) for race in TABLES_RACE) and attempt < 2:
                time.sleep(0.5 + random.random())
                continue
            raise StorageError(f"cannot open the Optuna storage {redact(url)} ({first_line(exc, url)}): check the "
                               f"URL and that the server runs") from None
    raise AssertionError("unreachable")


def cached(rdb: optuna.storages.RDBStorage) -> optuna.storages.BaseStorage:
    """One cache of finished trials for every study this process loads from the storage. Optuna wraps an
    RDBStorage in its _CachedStorage anew at each load_study, which then reads every trial of the study again:
    a cost per trial that grew with the study. Wrapped once here, a read fetches only the trials that were
    running or are new since the last one (finished trials never change)."""
    wrapper = getattr(optuna.storages, "_CachedStorage", None)
    return wrapper(rdb) if wrapper is not None else rdb


def check_journal(path: str) -> None:
    """Optuna reads a journal's last line that does not parse as a write in progress, skips it, and appends after
    it, which leaves the file unreadable: a file whose last line is not a record is refused before anything is
    written. The journal's lock is held while looking, so another process's write is whole."""
    from optuna.storages.journal import JournalFileSymlinkLock

    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    lock = JournalFileSymlinkLock(path)
    try:
        lock.acquire()
    except OSError:  # a folder this process cannot write (a dry run's look): it reads without the lock
        lock = None
    try:
        with open(path, "rb") as f:  # its tail, back to the newline before the last line
            size = start = f.seek(0, os.SEEK_END)
            tail = b""
            while start > 0 and tail.count(b"\n") < 2:
                start = max(0, start - 65536)
                f.seek(start)
                tail = f.read(size - start)
    finally:
        if lock is not None:
            lock.release()
    last = tail[tail.rfind(b"\n", 0, len(tail) - 1) + 1:]
    if not last.endswith(b"\n") and last.startswith(b'{"op_code":'):
        raise StorageError(f"the Optuna journal {path} ends in a line cut short (a process stopped while writing "
                           f"it): remove that last line, then run the same command again")
    try:
        record = json.loads(last)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise StorageError(f"cannot read the Optuna journal {path}: its last line is not one of Optuna's records: "
                           f"{NOT_A_JOURNAL}")


def connect_args(url: str) -> dict[str, int]:
    """SQLite waits for another process's writes; a server that is down is an error in seconds."""
    return {"timeout": 60} if url.startswith("sqlite") else {"connect_timeout": 3}


def create_studies(inv, storage: optuna.storages.BaseStorage) -> None:
    """Create (or find) every Optuna study once, before any worker starts. The invocation that creates a study
    records its settings at once: of two machines that start it at the same moment, the storage lets one
    create it, and the other is held to that one's settings (check_protocol)."""
    for name in inv.study_names():
        try:
            study = optuna.create_study(storage=storage, study_name=name, directions=list(inv.study.directions))
        except optuna.exceptions.DuplicatedStudyError:
            continue
        study.set_user_attr(PROTOCOL, protocol(inv))
        with warnings.catch_warnings():  # (experimental since Optuna 3.2, unchanged since)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(list(inv.study.metrics))  # optuna-dashboard and optuna's plots say val_acc


def protocol(inv) -> dict[str, str]:
    """What the study's trials are and share: its grid, searched ranges, search and objective; the base
    configuration's fields that no point sets; a [program]'s command and own [fixed] values. (Not the seeds:
    more seeds are more trials of the same study.)"""
    study = inv.study
    skip = {*WHERE, *study.varied, *(("physical_batch", "accum_steps") if study.auto_batch else ())}
    shared = {f.name: getattr(inv.base, f.name) for f in dataclasses.fields(inv.base) if f.name not in skip}
    shared |= {f"grid.{key}": list(values) for key, values in study.grid.items()}
    shared |= {f"tune.{name}": param for name, param in study.tune.items()}
    shared |= {f"search.{key}": getattr(study, key) for key in ("sampler", "trials", "pruner", "twins", "sampler_seed",
                                                                 "auto_batch", "kind", "metrics", "directions")}
    shared["search.constraints"] = [c.text for c in study.constraints]
    if study.program:
        shared |= {"program.command": " ".join(study.program.command), **inv.own({})}
    return {key: str(redacted(value)) for key, value in shared.items()}  # (a URL in it without its password)


def check_protocol(inv, storage: optuna.storages.BaseStorage) -> None:
    """Refuse to resume a study under other settings: its finished points count as done, and would be measured
    under the old ones beside new ones under these. The study's first invocation records its settings."""
    mine = protocol(inv)
    for name in inv.study_names():
        study = optuna.load_study(study_name=name, storage=storage)
        recorded = study.user_attrs.get(PROTOCOL)
        deadline = time.monotonic() + CREATOR_GRACE_S
        while recorded is None and not study.get_trials(deepcopy=False) and time.monotonic() < deadline:
            time.sleep(0.1)  # created this moment by another machine, which is recording its settings
            recorded = study.user_attrs.get(PROTOCOL)
        if recorded is None:  # a study of an earlier batchsweep: this invocation's settings are its own
            study.set_user_attr(PROTOCOL, mine)
        else:
            refuse_changes(inv, recorded, mine)


def refuse_changes(inv, recorded: dict[str, str], mine: dict[str, str]) -> None:
    changed = [key for key in sorted(mine.keys() | recorded.keys()) if mine.get(key) != recorded.get(key)]
    if changed:
        said = ", ".join(f"{key} = {recorded.get(key, '(unset)')} (now {mine.get(key, '(unset)')})"
                         for key in changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise ConfigError(f"study {inv.study_name} in {redact(inv.storage)} ran with {said}: run it with those "
                          f"settings to resume it, or pass --study-name NAME for a new study")


def peek(inv) -> dict[str, list[optuna.trial.FrozenTrial]] | None:
    """For --dry-run, which writes nothing: the trials of each of the study's Optuna studies that the storage
    holds already (its database file, tables and study are not created where they are missing); None where it
    holds none. Settings that differ from those the study ran with are refused, as the run refuses them."""
    url = check_storage(inv.storage)
    path = Path(url.removeprefix("journal:")) if url.startswith("journal:") else sqlite_path(url)
    if path is not None and not path.exists():
        return None
    found, mine = {}, protocol(inv)
    try:
        storage = open_storage(url) if url.startswith("journal:") else _read_only(url)
        for name in inv.study_names() if storage else []:  # (none: a database without Optuna's tables)
            try:
                study = optuna.load_study(study_name=name, storage=storage)
            except KeyError:  # not created yet
                continue
            if PROTOCOL in study.user_attrs:
                refuse_changes(inv, study.user_attrs[PROTOCOL], mine)
            found[name] = study.get_trials(deepcopy=False)
    except BatchsweepError:
        raise
    except Exception as exc:
        raise StorageError(f"cannot read the Optuna storage {redact(url)} ({first_line(exc, url)}): check the URL "
                           f"and that the server runs") from None
    return found or None


def _read_only(url: str) -> optuna.storages.RDBStorage | None:
    """A database's storage, opened without writing to it; None where it has no Optuna tables."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, connect_args=connect_args(url))
    try:
        with engine.connect() as connection:
            if not sqlalchemy.inspect(connection).has_table("studies"):
                return None
    finally:
        engine.dispose()
    # (Optuna's schema check inserts its version row where the tables are empty: they are not, here.)
    return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": connect_args(url)}, skip_table_creation=True)


def owner() -> str:
    return f"{HOST}:{os.getpid()}"


def fail_orphans(study: optuna.Study, trials: list[optuna.trial.FrozenTrial]) -> int:
    """Mark RUNNING trials whose process is gone as FAIL, so their points run again: those of a dead process on
    this host (in this container), and those that never got an owner (a process killed between Optuna creating
    the trial and its first heartbeat, which Optuna's own check never fails) once older than the heartbeat's
    grace."""
    failed = 0
    for t in trials:
        if orphaned(t):
            try:
                study.tell(t.number, state=TrialState.FAIL)
                failed += 1
            except (RuntimeError, ValueError):  # another worker got there first
                pass
    return failed


def orphaned(t: optuna.trial.FrozenTrial) -> bool:
    """Whether a RUNNING trial's process is gone (see fail_orphans)."""
    if t.state != TrialState.RUNNING:
        return False
    host, _, pid = t.user_attrs.get("owner", "").rpartition(":")
    here = host == HOST and t.user_attrs.get("owner_processes", PROCESSES) == PROCESSES
    return here and not pid_alive(int(pid)) or (
        not pid and (datetime.datetime.now() - t.datetime_start).total_seconds() > HEARTBEAT_GRACE_S)


def free_dead_trials(inv, storage) -> None:
    """Fail the RUNNING trials of processes that are gone: on this host, or silent past the heartbeat's grace."""
    for name in inv.study_names():
        study = optuna.load_study(study_name=name, storage=storage)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        fail_orphans(study, study.get_trials(deepcopy=False))


def remaining(inv, storage) -> int:
    """Trials still to run in the whole study."""
    units = inv.units()
    return sum(inv.search.left(optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False),
                               [u for u in units if u.study_name == name], set())
               for name in inv.study_names())
