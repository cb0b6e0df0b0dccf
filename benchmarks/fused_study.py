"""Trials an hour of a study through `sweeps/run.py`, fused (the default) against `--no-fuse`, with the same
workers: each run is the whole command (workers, MLflow, checkpoints, the models kept; no report) in a fresh
folder, and trials an hour are its complete trials over its wall-clock time; beside it, trials a CPU hour (the
run's and its workers' user and system time, all threads), which other work on the machine moves far less.
Each pair runs both, the side that goes first alternating from pair to pair (other work on the machine moved a
single run by a fifth and more); prints each run, each pair's ratios (wall clock and CPU), their range and,
last, the median pair's wall-clock ratio as `ratio=<x>`; exits 1 when a run failed or completed nothing.

    python benchmarks/fused_study.py [--study accum_lr] [--seeds 3] [--epochs N] [--workers N] [--set KEY=VALUE]
                                     [--pairs 1] [--first alone]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def complete(folder: Path, study: str) -> int:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials = optuna.load_study(study_name=study, storage=f"sqlite:///{folder}/mlruns/optuna.db").trials
    return sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials)


def cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the waited-for ones: the run and, through it, its workers
    return used.ru_utime + used.ru_stime


def one_run(args, fuse: bool) -> tuple[int, float, float] | None:
    """Complete trials, wall-clock seconds and CPU seconds of one run of the study, or None where it failed."""
    flags = ["--study", args.study, "--no-report", "--set", f"data_dir={ROOT / 'data'}",
             *[f for pair in args.set for f in ("--set", pair)]]
    for name in ("seeds", "epochs", "workers"):
        if getattr(args, name) is not None:
            flags += [f"--{name}", str(getattr(args, name))]
    with tempfile.TemporaryDirectory() as folder:
        start, cpu = time.perf_counter(), cpu_of_children()
        done = subprocess.run([sys.executable, str(ROOT / "sweeps/run.py"), *flags, *([] if fuse else ["--no-fuse"])],
                              cwd=folder, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        seconds, cpu = time.perf_counter() - start, cpu_of_children() - cpu
        if done.returncode:
            print(f"{'fused' if fuse else 'alone'}: the run failed ({done.returncode}): "
                  f"{done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        name = Path(args.study).stem if args.study.endswith(".toml") else args.study
        return complete(Path(folder), name), seconds, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="accum_lr")
    p.add_argument("--seeds", type=int, help="default: the study's own")
    p.add_argument("--epochs", type=int, help="default: the study's own")
    p.add_argument("--workers", type=int, help="default: the study's own")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a trainer field for every trial")
    p.add_argument("--pairs", type=int, default=1, help="runs of each side, in alternating order")
    p.add_argument("--first", choices=("fused", "alone"), default="fused", help="which run goes first")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    ratios, cpu_ratios = [], []
    for pair in range(args.pairs):
        rates, cpu_rates, first = {}, {}, (args.first == "fused") == (pair % 2 == 0)
        for fuse in (first, not first):
            measured = one_run(args, fuse)
            if measured is None or measured[0] == 0:
                break
            trials, seconds, cpu = measured
            rates[fuse], cpu_rates[fuse] = trials / seconds * 3600, trials / cpu * 3600
            print(f"{'fused' if fuse else 'alone'}: {trials} trials in {seconds:.0f} s = {rates[fuse]:.0f} trials an "
                  f"hour, {cpu:.0f} s of CPU = {cpu_rates[fuse]:.0f} trials a CPU hour (load "
                  f"{os.getloadavg()[0]:.1f} at the end)", flush=True)
        if len(rates) == 2:
            ratios.append(rates[True] / rates[False])
            cpu_ratios.append(cpu_rates[True] / cpu_rates[False])
            print(f"pair {pair + 1}: {ratios[-1]:.3f} (CPU {cpu_ratios[-1]:.3f})", flush=True)
    if not ratios:
        print("nothing was measured", file=sys.stderr)
        return 1
    if len(ratios) > 1:
        print(f"{len(ratios)} pairs: {min(ratios):.3f} to {max(ratios):.3f}; CPU median "
              f"{statistics.median(cpu_ratios):.3f} ({min(cpu_ratios):.3f} to {max(cpu_ratios):.3f})")
    else:
        print(f"CPU: {cpu_ratios[0]:.3f}")
    print(f"ratio={statistics.median(ratios):.3f}")
    return 0 if len(ratios) == args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
