"""Per-trial overhead as a study grows: the median overhead of a trial among the last 50 against the first 50.

Runs the trials of `accum_lr --seeds N` (27 a seed: one epoch of 1,024 8-D points each, so that the sweep's own
work dominates) into a temporary Optuna storage (SQLite, or the PostgreSQL database --storage names) and a SQLite
MLflow store, in --workers processes. The first trials train at small B (32 steps an epoch), the last ones are
twins at large B (2 steps), so their wall times differ by the trainer's work; the overhead (a trial's wall time
outside `train()`: claiming, Optuna, MLflow, checkpoints) is the same work in every trial. Prints both medians and
`ratio=<overhead, last 50 / first 50>` on the last line (goal <= 1.2). A step that reads every trial of the
study, or a store that slows as it fills, shows as a ratio above 1.

    python benchmarks/trial_scaling.py [--seeds 8] [--workers 1] [--storage postgresql://...]
"""
from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import tempfile
import time

import optuna

from sweep_overhead import check_complete, timed_trainer
from batchsweep.sweeps.cli import build_invocation, parse_args
from batchsweep.sweeps.stores.optuna_store import create_studies, open_storage
from batchsweep.sweeps.stores.urls import redact
from batchsweep.sweeps.trials.worker import Progress, Worker
from batchsweep.sweeps.stores.mlflow_store import Tracker
from batchsweep.trainers.cli import run_script


def work(inv, parent: str, index: int, out) -> None:
    """One worker: its trials' (end time, wall time, time in train()), in the order they ended."""
    import torch

    torch.set_num_threads(1)  # as a study's workers do
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    in_train, ended, last = timed_trainer(), [], [time.perf_counter()]

    def trial_done(_trial) -> None:
        now = time.perf_counter()
        ended.append((time.time(), now - last[0]))
        last[0] = now

    Worker(inv, parent, index, Progress(trial_done=trial_done)).run(None)
    out.put([(at, wall, train) for (at, wall), train in zip(ended, in_train)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--storage", help="an Optuna storage URL (default: SQLite in a temporary folder); its "
                        "database should be empty: the study is named scaling-<time>")
    parser.add_argument("--window", type=int, default=50, help="trials compared at each end")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # as sweeps/run.py does
    with tempfile.TemporaryDirectory() as folder:
        storage = args.storage or f"sqlite:///{folder}/optuna.db"
        inv = build_invocation(parse_args([
            "--study", "accum_lr", "--seeds", str(args.seeds), "--workers", str(args.workers), "--epochs", "1",
            "--model", "mlp", "--dataset", "synthetic:blobs", "--set", "warmup_epochs=0", "--storage", storage,
            "--study-name", f"scaling-{int(time.time())}", "--tracking-uri", f"sqlite:///{folder}/mlflow.db",
            "--checkpoint-dir", f"{folder}/checkpoints", "--no-fuse"]))  # (each trial's own time in train())
        create_studies(inv, open_storage(inv.storage))
        parent = Tracker(inv.tracking_uri, inv.study_name).start_parent("scaling", {}, {})
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=work, args=(inv, parent, i, out)) for i in range(args.workers)]
        for proc in procs:
            proc.start()
        ran = []
        while len(ran) < len(procs):
            try:
                ran.append(out.get(timeout=1))
            except queue.Empty:
                if any(p.exitcode for p in procs):
                    raise SystemExit("error: a worker failed (above): nothing measured") from None
        for proc in procs:
            proc.join()
        trials = sorted(t for worker in ran for t in worker)  # by the time each ended
        check_complete(inv, open_storage(inv.storage), len(trials))
    w = args.window
    if len(trials) < 2 * w:
        raise SystemExit(f"error: only {len(trials)} trials ran, fewer than 2 x --window {w}: raise --seeds")
    walls = [wall for _, wall, _ in trials]
    outside = [wall - train for _, wall, train in trials]
    median = lambda values: statistics.median(values) * 1000
    print(f"study=accum_lr seeds={args.seeds} trials={len(trials)} workers={args.workers} "
          f"store={redact(storage).split(':')[0] if args.storage else 'SQLite'}")
    print(f"median wall time a trial: first {w} {median(walls[:w]):.0f} ms, last {w} {median(walls[-w:]):.0f} ms")
    print(f"median overhead a trial:  first {w} {median(outside[:w]):.0f} ms, last {w} {median(outside[-w:]):.0f} ms")
    # What a larger study would pay, by extrapolation: the growth between the two ends, per 1,000 trials.
    growth = (median(outside[-w:]) - median(outside[:w])) / (len(outside) - w) * 1000
    print(f"growth: {growth:+.1f} ms a trial per 1,000 trials in the study (last {w} against first {w}; the two ends "
          f"are different points of the grid, so a few ms either way is the points' own difference)")
    print(f"ratio={median(outside[-w:]) / median(outside[:w]):.3f}")


if __name__ == "__main__":
    run_script(main)
