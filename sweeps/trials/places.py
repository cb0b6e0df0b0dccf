"""Each [program] trial its own place: a folder of its own ({trial_dir}, BATCHSWEEP_TRIAL_DIR), and the files its
processes wrote anywhere else (the tracer's writes-<pid>.txt) compared with those of the trials that ran at the same
time. A file that two trials wrote while both ran is a clash: either may have read the other's, so neither result
counts.

    <trials>/<study>/<n>/            trial n's own folder, kept after the trial
    <trials>/<study>/.running/<n>/   its trace folder while it runs (the others read its writes there)
    <trials>/<study>/.ended/<n>.json when it ran and what it wrote, once it ended
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from batchsweep.trainers import BatchsweepError

from ..stores.urls import sqlite_path

RUNNING, ENDED = ".running", ".ended"


class Clash(BatchsweepError):
    """A trial wrote a file that a trial running at the same time wrote too."""


def trials_folder(tracking_uri: str, study_name: str) -> Path:
    """Where a study's trials have their own folders: beside a SQLite store's database (as its artifacts are),
    else under mlruns/ in the current folder."""
    db = sqlite_path(tracking_uri)
    return (db.parent if db else Path("mlruns")).resolve() / "trials" / study_name


@dataclass(frozen=True)
class Place:
    root: Path  # the study's trials folder
    name: str  # the trial's folder name (its number)

    @property
    def folder(self) -> Path:
        return self.root / self.name

    @property
    def trace(self) -> Path:
        return self.root / RUNNING / self.name

    def open(self) -> None:
        """The trial's folder, and its trace folder with when it started and who runs it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.trace, ignore_errors=True)  # a killed worker's, of the same trial
        self.trace.mkdir(parents=True)
        (self.trace / "started.json").write_text(json.dumps(
            {"start": time.time(), "host": socket.gethostname(), "pid": os.getpid()}))

    def close(self) -> list[tuple[str, str]]:
        """Compare what this trial wrote with what the trials that ran beside it wrote; leave its own record for
        those still running, and remove its trace folder. Returns (path, other trial's name) of each clash."""
        start = json.loads((self.trace / "started.json").read_text())["start"]
        mine = self.written(self.trace)
        clashes = [(path, name) for name, theirs in sorted(self._beside(start).items())
                   for path in sorted(mine & theirs)]
        ended = self.root / ENDED
        ended.mkdir(exist_ok=True)
        record = {"start": start, "end": time.time(), "paths": sorted(mine)}
        (ended / f"{self.name}.tmp").write_text(json.dumps(record))
        os.replace(ended / f"{self.name}.tmp", ended / f"{self.name}.json")  # before the trace folder goes
        shutil.rmtree(self.trace, ignore_errors=True)
        return clashes

    def _beside(self, start: float) -> dict[str, set[str]]:
        """The paths written by each other trial that ran at some time since `start`: those running now (what they
        wrote so far), and those that ended since (both, for one that is ending as this one looks)."""
        found: dict[str, set[str]] = {}
        for folder in (self.root / RUNNING).iterdir():
            try:
                who = json.loads((folder / "started.json").read_text())
            except (OSError, ValueError):  # starting this moment, or ended meanwhile (then in ENDED)
                continue
            if folder.name != self.name and (who["host"] != socket.gethostname() or psutil.pid_exists(who["pid"])):
                found[folder.name] = self.written(folder)
        for path in (self.root / ENDED).glob("*.json"):
            record = json.loads(path.read_text())
            if path.stem != self.name and record["end"] >= start:
                found[path.stem] = found.get(path.stem, set()) | set(record["paths"])
        return found

    def written(self, trace: Path) -> set[str]:
        """The files a trial's processes wrote, as the tracer saw them: not those in the trials' own folders
        (the trace folders are there too), nor Python's bytecode caches."""
        paths = set()
        try:
            for log in trace.glob("writes-*.txt"):
                paths.update(log.read_text(errors="surrogateescape").splitlines())
        except OSError:  # removed as its trial ended: its record in ENDED has them
            pass
        return {p for p in paths if p and not p.startswith(f"{self.root}{os.sep}") and "__pycache__" not in p}


def clash_sentence(clashes: list[tuple[str, str]]) -> str:
    """Which file, and which other trial wrote it too."""
    path, other = clashes[0]
    more = len({p for p, _ in clashes}) - 1
    return f"trial {other} wrote {path}{f' (and {more} more files)' if more else ''} too while both ran"


FIX = ("give each trial its own file: write it under {trial_dir} (in the command) or $BATCHSWEEP_TRIAL_DIR (in "
       "the environment), a folder per trial, or run each trial in that folder (cwd = \"{trial_dir}\"), in a new "
       "study (--study-name); or run this one again with --workers 1")
