"""A trial that runs the user's own training script (a study file's [program]): its command line from the
trial's values, the metrics it prints as JSON lines (read in rows.py), the memory of its process tree, and how it
ended.

The script runs in a process group of its own, so that stopping it (pruned, past its time, Ctrl-C) stops
whatever it started too: SIGTERM to the group, SIGKILL after a grace period (processes.py).
"""
from __future__ import annotations

import difflib
import os
import platform
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import psutil

from ..stores.urls import USERINFO, redact
from .processes import become_reaper, descendants, die_with_parent, signal_group, stop_descendants, stop_group
from .rows import Output

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What a command's text may hold between its plain characters: a placeholder, or {{ and }} for a literal brace (as
# Python's str.format). Any other brace is a mistake ("{accum_steps", "{ lr }") that would reach the script as is.
TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
# What a [program] trial records as params besides the fields its study names and its command uses: the
# questions' own values. Trainer fields that a script does not read (model, dataset, ...) would only mislead.
PARAMS = ("physical_batch", "accum_steps", "effective_batch", "lr_rule", "base_lr", "base_batch", "lr", "seed",
          "epochs", "max_steps")
SAMPLE_S = 0.2  # how often the process tree's memory is read (and the output, at the latest)
GPU_SAMPLE_S = 1.0  # nvidia-smi costs tens of milliseconds a call
PIPE_GRACE_S = 2.0  # how long output is still read after the script exited


@dataclass(frozen=True)
class Program:
    """[program]: the command (a list of arguments, no shell) and where and how long it runs."""

    command: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # extra variables; values may hold placeholders
    cwd: str | None = None  # None: the current directory; may hold placeholders ({trial_dir}), braces doubled
    timeout_minutes: float | None = None

    def placeholders(self) -> list[str]:
        texts = [*self.command, *self.env.values(), self.cwd or ""]
        return list(dict.fromkeys(m.group(1) for text in texts for m in TOKEN.finditer(text) if m.group(1)))

    def argv(self, values: dict[str, Any]) -> list[str]:
        return [fill(arg, values) for arg in self.command]

    def environment(self, values: dict[str, Any]) -> dict[str, str]:
        return {name: fill(text, values) for name, text in self.env.items()}

    def folder(self, values: dict[str, Any]) -> str | None:
        """Where a trial's script runs: cwd with its placeholders filled."""
        return None if self.cwd is None else fill(self.cwd, values)

    def params(self, values: dict[str, Any], named: tuple[str, ...]) -> dict[str, Any]:
        """The run's params: the questions' values, the study's own fields (`named`) and what the command uses."""
        keep = [*PARAMS, *named, *self.placeholders()]
        return {k: redacted(values[k]) for k in dict.fromkeys(keep) if k in values and k != "python"}


def redacted(value: Any) -> Any:
    """A value with the password of any URL in it as ***."""
    if isinstance(value, str) and (m := USERINFO.search(value)):
        return value[:m.start()] + redact(value[m.start():])
    return value


def handoff(tracking_uri: str, run_id: str, experiment_id: str) -> dict[str, str]:
    """The variables that hand a script its MLflow run: mlflow.start_run() inside it resumes that run."""
    return {"MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_ID": experiment_id}


def machine() -> str:
    """Where a script trains, as far as batchsweep can tell without running it: the GPUs nvidia-smi lists, else
    the CPU."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        names = [line.strip() for line in out.splitlines() if line.strip()]
        if names:
            return " + ".join(f"{names.count(n)}x {n}" if names.count(n) > 1 else n for n in dict.fromkeys(names))
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def fill(text: str, values: dict[str, Any]) -> str:
    """`text` with each {name} replaced by its value ({python}: the interpreter batchsweep runs on), {{ and }}
    by one brace."""
    values = {"python": sys.executable, **values}
    return TOKEN.sub(lambda m: str(values[m.group(1)]) if m.group(1) else m.group(0)[0], text)


def stray_brace(text: str) -> str | None:
    """The first brace in `text` that is neither part of a {name} nor doubled, with what is around it; None."""
    rest = TOKEN.sub(lambda m: "\0" * len(m.group(0)), text)  # (same length: a position in rest is one in text)
    at = min((i for i in (rest.find("{"), rest.find("}")) if i >= 0), default=-1)
    if at < 0:
        return None
    end = text.find("}", at) if text[at] == "{" else at
    return text[at:end + 1] if 0 <= end - at < 40 else text[at:at + 20]


def misread(brace: str, known: set[str]) -> str:
    """Why a stray brace (stray_brace's) is no placeholder, and the placeholder it likely means: one of `known`, its
    name without spaces, format spec or conversion, or the closest."""
    inner = brace.strip("{}").strip()
    name, spec = re.match(r"([^:!]*)(.*)", inner).groups()
    name = name.strip()
    guesses = (name, re.sub(r"\s+", "_", name), *difflib.get_close_matches(name, sorted(known), n=1))
    meant = next((f"{{{g}}}" for g in guesses if g in known), None)
    if spec:
        return (f"{brace!r} is no placeholder: a placeholder takes no format spec or conversion ({spec!r}): "
                + (f"write {meant}, which passes the value as it is, or " if meant else "")
                + "give the value formatted so as a field of your own ([fixed] or [grid]); a literal brace is {{ or }}")
    return (f"{brace!r} is no placeholder: write a placeholder as {{name}}, without spaces"
            + (f" ({meant})" if meant else "") + ", and a literal brace as {{ or }}")


@dataclass
class Ended:
    """How a script run ended, and what batchsweep measured of it."""

    code: int  # exit status; negative: killed by that signal
    stopped: str | None  # why batchsweep stopped it: "timeout", or None
    wall_time_s: float
    peak_memory_bytes: int
    memory_source: str  # "rss" (the process tree's resident memory) or "cuda" (device memory its processes held)
    strays: list[str] = field(default_factory=list)  # processes it left outside its group, stopped: "pid (name)"
    left: list[str] = field(default_factory=list)  # processes it left that could not be stopped

    def notes(self) -> list[str]:
        notes = []
        if self.strays:
            notes.append(f"the script left {len(self.strays)} process{'es' * (len(self.strays) > 1)} running outside "
                         f"its process group ({', '.join(self.strays[:3])}): stopped at the trial's end")
        if self.left:
            them = "them" if len(self.left) > 1 else "it"
            notes.append(f"{len(self.left)} process{'es' * (len(self.left) > 1)} the script started could not be "
                         f"stopped ({', '.join(self.left[:3])}): stop {them} yourself")
        return notes


class Memory:
    """The peak memory of a process tree: resident memory summed over its processes, sampled; on a machine
    with nvidia-smi, also the device memory those processes hold. The tree is the script's, and those of what it
    double-forked away (re-parented here, the reaper): descendants(before)."""

    def __init__(self, before: set[int] = frozenset()):
        self.before = before
        self.rss = self.cuda = 0
        self.smi = shutil.which("nvidia-smi")
        self._next_gpu = 0.0

    def pids(self) -> list[psutil.Process]:
        return descendants(self.before)

    def sample(self) -> None:
        procs, total = self.pids(), 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:  # ended between the listing and the reading
                pass
        self.rss = max(self.rss, total)
        if self.smi and time.monotonic() >= self._next_gpu:
            self._next_gpu = time.monotonic() + GPU_SAMPLE_S
            self.cuda = max(self.cuda, self._gpu({p.pid for p in procs}))

    def _gpu(self, pids: set[int]) -> int:
        try:
            out = subprocess.run([self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5).stdout
        except (OSError, subprocess.TimeoutExpired):
            return 0
        used = 0
        for line in out.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and int(pid) in pids and mib.strip().isdigit():
                used += int(mib) * 2 ** 20
        return used

    def peak(self) -> tuple[int, str]:
        return (self.cuda, "cuda") if self.cuda else (self.rss, "rss")


def run(argv: list[str], env: dict[str, str], cwd: str | None, timeout_s: float | None, output: Output,
        on_row: Callable[[dict[str, float]], None], every: Callable[[], None] = lambda: None) -> Ended:
    """Run a script to its end, keeping what it prints in `output`. Each JSON row with `step` or `epoch` goes
    to `on_row` as it is printed; `every` is called between reads (at least every SAMPLE_S). An exception from
    either (a pruned trial, Ctrl-C) stops the script's process group and is raised again."""
    become_reaper()
    before = {p.pid for p in psutil.Process().children()}  # (a worker's own children, where it has any)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=die_with_parent())
    memory, stopped, exited = Memory(before), None, None
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            pending = {"out": b"", "err": b""}
            while sel.get_map():
                memory.sample()
                every()
                now = time.monotonic()
                if timeout_s is not None and now - start > timeout_s:
                    stopped = "timeout"
                    break
                exited = exited or (now if proc.poll() is not None else None)
                if exited and now - exited > PIPE_GRACE_S:  # a process it left behind holds its output open
                    break
                for key, _ in sel.select(SAMPLE_S):
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        chunk = b"\n" if pending[key.data] else b""
                    *lines, pending[key.data] = (pending[key.data] + chunk).split(b"\n")
                    for raw in lines:
                        line = raw.decode(errors="replace")
                        output.lines.append(line)
                        if key.data == "err":
                            output.tail.append(line)
                        elif (row := output.row(line)) is not None and ("step" in row or "epoch" in row):
                            on_row(row)
        if stopped:
            stop_group(proc.pid, proc)
        code = proc.wait()
    except BaseException:
        stop_group(proc.pid, proc)
        raise
    finally:
        proc.stdout.close()
        proc.stderr.close()
        # No process outlives its trial: what the script left in its group, and out of it.
        signal_group(proc.pid, signal.SIGKILL)
        strays, left = stop_descendants(before, proc.pid)
    peak, source = memory.peak()
    return Ended(code, stopped, time.monotonic() - start, peak, source, strays, left)


# How a script's out-of-memory reads on stderr: PyTorch's error on a GPU and on the CPU, and Python's own.
OUT_OF_MEMORY = ("OutOfMemoryError", "CUDA out of memory", "DefaultCPUAllocator: not enough memory",
                 "DefaultCPUAllocator: can't allocate memory", "MemoryError")


def out_of_memory(ended: Ended, output: Output) -> str | None:
    """Why an ended script ran out of memory, or None: PyTorch's (or Python's) error, or a SIGKILL that batchsweep
    did not send (the kernel's out-of-memory killer sends SIGKILL)."""
    for line in reversed(output.tail):
        if any(marker in line for marker in OUT_OF_MEMORY):
            return line.strip()
    if ended.code == -signal.SIGKILL and ended.stopped is None:
        return "killed by SIGKILL, as the kernel's out-of-memory killer does"
    return None


def failure(ended: Ended, output: Output) -> str:
    """A failed script's exit in one line, with the last lines of its stderr."""
    how = f"killed by {signal.Signals(-ended.code).name}" if ended.code < 0 else f"exit status {ended.code}"
    lines = [line.strip() for line in output.tail if line.strip()][-3:]
    return f"the script ended with {how}" + (f": {' / '.join(lines)}" if lines else " (nothing on stderr)")
