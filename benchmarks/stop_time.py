"""How fast a study stops: SIGTERM to the main process of `sweeps/run.py` once each of its workers is inside a
long trial (its first epoch checkpointed), and the seconds until every process of the study is gone, against the
10 s that a scheduler's cancel (`docker stop`) leaves before its SIGKILL. Prints each stop and, last, the
slowest as `stop_s=<seconds>`; exits 1 when a stop was not clean (exit status 130) or none was measured.

    python benchmarks/stop_time.py [--repeats 5] [--workers 2]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10  # docker stop's wait between its SIGTERM and its SIGKILL
STUDY = """name = "stops"
[fixed]
model = "mlp"
dataset = "synthetic:blobs"
epochs = 100000
[grid]
accum_steps = [1, 2, 4, 8]
"""


def one_stop(workers: int) -> tuple[float, int, str]:
    """Seconds from the SIGTERM until the study's last process is gone, the main process's exit status and its
    last line."""
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "study.toml").write_text(STUDY)
        with open(work / "stderr.txt", "w") as err:  # (a pipe left unread would fill with the bars and block)
            proc = subprocess.Popen([sys.executable, str(ROOT / "sweeps/run.py"), "--study", "study.toml", "--seeds",
                                     "1", "--workers", str(workers), "--no-fuse", "--log-models", "none",
                                     "--no-report"], cwd=work, stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"})
        checkpoints = work / "mlruns" / "checkpoints" / "stops"
        while len(list(checkpoints.glob("*/checkpoint.pt"))) < workers:  # each worker past its first epoch
            if proc.poll() is not None:
                return float("nan"), proc.returncode, last_line(work)
            time.sleep(0.1)
        main = psutil.Process(proc.pid)
        procs = [main, *main.children(recursive=True)]
        start = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        while any(running(p) for p in procs[1:]):
            time.sleep(0.01)
        return time.perf_counter() - start, code, last_line(work)


def last_line(work: Path) -> str:
    return ([""] + (work / "stderr.txt").read_text(errors="replace").strip().splitlines())[-1][:200]


def running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE  # (a zombie has ended)
    except psutil.NoSuchProcess:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    stops = []
    for i in range(args.repeats):
        seconds, code, last = one_stop(args.workers)
        print(f"stop {i + 1}: exit status {code}, every process gone {seconds:.2f} s after the SIGTERM "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        if code != 130 or seconds != seconds:
            print(f"the stop was not clean (exit status 130 expected); the study's last line: {last}",
                  file=sys.stderr)
            return 1
        stops.append(seconds)
    if not stops:
        print("nothing was measured", file=sys.stderr)
        return 1
    print(f"slowest of {len(stops)}: {max(stops):.2f} s, against the {GRACE_S} s before a scheduler's SIGKILL")
    print(f"stop_s={max(stops):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
