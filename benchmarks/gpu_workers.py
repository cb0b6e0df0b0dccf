"""Trials per hour of a study with 1, 2 and 4 workers on one GPU, placed by memory (sweeps/gpus/placement.py), and
the memory each trial held.

Runs the first --trials trials of the study into a fresh temporary SQLite store for each number of workers,
all on GPU 0 (the others are not used), and prints for each: trials per hour, how many trials shared the GPU,
the most memory any trial held (its prediction plus a margin) and the largest peak a trial measured. The last
line is `speedup=<trials per hour with the most workers / with one>`.

    python benchmarks/gpu_workers.py [--study accum_lr] [--trials 27] [--workers 1,2,4]

Without a GPU, --simulate-gpu SIZE (e.g. 8GiB) places the workers on a simulated GPU of that size while they
train on the CPU: a check of the placement's own cost, not a GPU figure.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time

import optuna
from mlflow import MlflowClient

from sweep_overhead import check_complete
from batchsweep.sweeps.cli import build_invocation, parse_args
from batchsweep.sweeps.trials.driver import run_invocation
from batchsweep.sweeps.gpus.placement import Gpu, visible_gpus
from batchsweep.sweeps.gpus.planner import parse_bytes
from batchsweep.sweeps.stores.optuna_store import open_storage
from batchsweep.trainers import BatchsweepError, format_bytes
from batchsweep.trainers.cli import run_script


def measure(args, workers: int, gpu: Gpu, folder: str) -> dict:
    """One run of the study's first trials with `workers` workers on `gpu`."""
    inv = build_invocation(parse_args([
        "--study", args.study, "--n-trials", str(args.trials), "--no-report", "--log-models", "none",
        "--storage", f"sqlite:///{folder}/optuna.db", "--tracking-uri", f"sqlite:///{folder}/mlflow.db",
        "--checkpoint-dir", "none", *args.extra]))
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the table of trials
        run_invocation(inv, workers, [gpu])
    seconds = time.perf_counter() - start
    check_complete(inv, open_storage(inv.storage), args.trials)
    client = MlflowClient(inv.tracking_uri)
    runs = [r for r in client.search_runs([client.get_experiment_by_name(inv.study_name).experiment_id])
            if "mlflow.parentRunId" in r.data.tags]
    if len(runs) != args.trials or any("gpu_memory_held_bytes" not in r.data.tags for r in runs):
        raise SystemExit(f"error: {len(runs)} trial runs with placement tags, expected {args.trials}: nothing "
                         f"measured")
    return {"workers": workers, "per_hour": len(runs) * 3600 / seconds,
            "shared": sum(r.data.tags["shared_gpu"] == "True" for r in runs),
            "held": max(int(r.data.tags["gpu_memory_held_bytes"]) for r in runs),
            "peak": max(r.data.metrics["peak_memory_bytes"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", default="accum_lr")
    parser.add_argument("--trials", type=int, default=27)
    parser.add_argument("--workers", default="1,2,4", help="the numbers of workers to compare, comma-separated")
    parser.add_argument("--simulate-gpu", metavar="SIZE", help="without a GPU: place on a simulated one this size")
    args, args.extra = parser.parse_known_args()  # the rest goes to sweeps/run.py (e.g. --epochs 1)
    counts = [int(n) for n in args.workers.split(",")]
    gpus = [Gpu("0", f"simulated {args.simulate_gpu}", parse_bytes(args.simulate_gpu))] if args.simulate_gpu \
        else visible_gpus()
    if not gpus:
        raise BatchsweepError("no GPU is visible: run it on a GPU machine, or give --simulate-gpu 8GiB")
    gpu = gpus[0]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    rows = []
    for workers in counts:
        with tempfile.TemporaryDirectory() as folder:
            rows.append(measure(args, workers, gpu, folder))
    print(f"study={args.study} trials={args.trials} gpu={gpu.name}")
    print(f"{'workers':>7}  {'trials/hour':>11}  {'shared':>6}  {'most held':>10}  {'largest peak':>12}")
    for row in rows:
        print(f"{row['workers']:>7}  {row['per_hour']:>11,.0f}  {row['shared']:>6}  {format_bytes(row['held']):>10}  "
              f"{format_bytes(row['peak']):>12}")
    print(f"speedup={rows[-1]['per_hour'] / rows[0]['per_hour']:.3f}")


if __name__ == "__main__":
    run_script(main)
