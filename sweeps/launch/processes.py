"""The processes a trial's script starts: asking the kernel to stop the script with its worker, the worker as the
reaper of what the script double-forks, and each found and stopped when its trial ends; and the worker's token in
their environment, which finds them where the worker, or the whole invocation, was killed."""
from __future__ import annotations

import ctypes
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable

import psutil

GRACE_S = 10.0  # between SIGTERM and SIGKILL when a script is stopped
STRAY_WAIT_S = 5.0  # for what a script left running to end after SIGKILL (a process in the kernel may not)


def die_with_parent():
    """What the child runs before the program starts: ask for SIGTERM when the worker that launched it dies,
    even by SIGKILL, so that no orphan trains on beside the trial that runs its point again. None where there
    is no prctl (not Linux: an orphan is possible after a kill)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def become_reaper() -> bool:
    """Make this process the reaper of its descendants (Linux's PR_SET_CHILD_SUBREAPER): a process that a script
    double-forks into a session of its own is re-parented here when its parent ends, instead of to PID 1, so that
    it is found and stopped at the trial's end. False where there is no such prctl."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux") and prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def descendants(before: set[int] = frozenset()) -> list[psutil.Process]:
    """The trees of this process's children but those whose pids `before` holds: a script's, and those of what it
    left (re-parented here, the reaper); not what a child that was there before starts meanwhile."""
    found = []
    for child in psutil.Process().children():
        if child.pid not in before:
            try:
                found += [child, *child.children(recursive=True)]
            except psutil.Error:  # ended meanwhile
                pass
    return found


def stop_descendants(before: set[int], pgid: int) -> tuple[list[str], list[str]]:
    """SIGKILL to descendants(before) (what a script left running, in its group or out of it), each reaped.
    Returns those outside the group `pgid` (a double-forked daemon), and those still there after STRAY_WAIT_S, as
    'pid (name)'."""
    found = descendants(before)
    strays, named = [], {}
    for p in found:
        try:
            named[p.pid] = f"{p.pid} ({p.name()})"
            if os.getpgid(p.pid) != pgid:
                strays.append(named[p.pid])
            p.kill()
        except (psutil.Error, ProcessLookupError):  # ended meanwhile
            pass
    _, alive = psutil.wait_procs(found, timeout=STRAY_WAIT_S)  # (waits on the children here: reaps them)
    return strays, [named.get(p.pid, str(p.pid)) for p in alive]


# Every process a worker starts, and what those start in turn, carries the worker's token in its environment: where
# the worker is killed, what its script double-forked is re-parented away from it, and the token still finds it. The
# token names the main process (its pid and start time) and the study: where the main process is gone too, the
# study's next invocation finds them.
TOKEN_VARIABLE = "BATCHSWEEP_WORKER"


def worker_token(index: int, study: str) -> str:
    """The token of this main process's worker `index` of `study` (its storage and name)."""
    me = psutil.Process()
    return f"{me.pid}-{round(me.create_time() * 1000)}-{_key(study)}-{index}-{secrets.token_hex(8)}"


def killed_of(study: str) -> Callable[[str], bool]:
    """A match for the tokens of `study` whose main process has ended (a pid in use again is another process): what
    an invocation of it that was killed left. (Not another study's: its own next invocation looks.)"""
    key = _key(study)

    def match(token: str) -> bool:
        try:
            pid, started, of = token.split("-")[:3]
            return of == key and abs(psutil.Process(int(pid)).create_time() * 1000 - int(started)) > 1000
        except psutil.NoSuchProcess:
            return True
        except (ValueError, psutil.Error):  # no token of ours, or not ours to tell
            return False

    return match


def _key(study: str) -> str:
    return hashlib.sha1(study.encode()).hexdigest()[:12]


def stop_tagged(match: Callable[[str], bool]) -> tuple[list[str], list[str]]:
    """SIGKILL to every process of this user whose environment carries a token that `match`es: what a worker left
    running. Returns those stopped and those still there after STRAY_WAIT_S, as 'pid (name)'."""
    found, named = [], {}
    for p in psutil.process_iter(["name"]):
        try:
            token = p.environ().get(TOKEN_VARIABLE) if p.pid != os.getpid() else None
            if token and match(token):
                named[p.pid] = f"{p.pid} ({p.info['name']})"
                p.kill()
                found.append(p)
        except psutil.Error:  # another user's, or ended meanwhile
            pass
    deadline = time.monotonic() + STRAY_WAIT_S
    while (alive := [p for p in found if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)  # (not our children: their new parent reaps them)
    return [named[p.pid] for p in found if p not in alive], [named[p.pid] for p in alive]


def left_behind(match: Callable[[str], bool], who: str) -> str | None:
    """stop_tagged(match), said in one line where it found anything: "warning: {who} N processes ..."."""
    stopped, left = stop_tagged(match)
    if not stopped and not left:
        return None
    them = [*stopped, *left]
    return (f"warning: {who} {len(them)} process{'es' * (len(them) > 1)} that its trials started running "
            f"({', '.join(them[:3])}): " + ("stopped" if not left else f"{len(left)} could not be stopped "
                                                                     f"({', '.join(left[:3])}): stop them yourself"))


def _running(p: psutil.Process) -> bool:
    """Whether a process runs still: a zombie (killed, its parent yet to reap it) does not."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_group(pgid: int, proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM to the process group, SIGKILL to what is left of it after `grace` seconds."""
    signal_group(pgid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    signal_group(pgid, signal.SIGKILL)
    proc.wait()


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
