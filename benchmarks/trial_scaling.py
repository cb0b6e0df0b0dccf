"""Per-trial overhead as a study grows: the median time of a trial among the last 50 against the first 50.

Runs the 216 trials of `accum_lr --seeds 8` (one epoch of 1,024 8-D points each, so that the sweep's own work
dominates) into a temporary SQLite Optuna storage and MLflow store, in one worker. The first trials train at
small B (32 steps an epoch), the last ones are twins at large B (2 steps), so their wall times differ by the
trainer's work; the overhead (a trial's wall time outside `train()`: claiming, Optuna, MLflow) is the same work
in every trial. Prints both medians and `ratio=<overhead, last 50 / first 50>` on the last line (goal <= 1.2).
A claim that reads every trial of the study, or a store that slows as it fills, shows as a ratio above 1.

    python benchmarks/trial_scaling.py [--seeds 8]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import optuna

from sweep_overhead import check_complete, timed_trainer
from sweeps.cli import build_invocation, parse_args
from sweeps.storage import create_studies, open_storage
from sweeps.worker import Hooks, Worker
from sweeps.tracking import Tracker
from trainers.cli import run_script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--window", type=int, default=50, help="trials compared at each end")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # as sweeps/run.py does
    with tempfile.TemporaryDirectory() as folder:
        inv = build_invocation(parse_args([
            "--study", "accum_lr", "--seeds", str(args.seeds), "--workers", "1", "--epochs", "1", "--model", "mlp",
            "--dataset", "synthetic:blobs", "--set", "warmup_epochs=0", "--storage", f"sqlite:///{folder}/optuna.db",
            "--tracking-uri", f"sqlite:///{folder}/mlflow.db", "--checkpoint-dir", f"{folder}/checkpoints"]))
        create_studies(inv, open_storage(inv.storage))
        parent = Tracker(inv.tracking_uri, inv.study_name).start_parent("scaling", {}, {})
        times, in_train, last = [], timed_trainer(), [time.perf_counter()]

        def trial_done(_trial) -> None:
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now


        worker = Worker(inv, parent, 0, Hooks(trial_done=trial_done))
        check_complete(inv, worker.storage, worker.run(None))
    w = args.window
    if len(times) < 2 * w:
        raise SystemExit(f"error: only {len(times)} trials ran, fewer than 2 x --window {w}: raise --seeds")
    outside = [t - s for t, s in zip(times, in_train)]
    median = lambda values: statistics.median(values) * 1000
    print(f"study=accum_lr seeds={args.seeds} trials={len(times)} store=SQLite")
    print(f"median wall time a trial: first {w} {median(times[:w]):.0f} ms, last {w} {median(times[-w:]):.0f} ms")
    print(f"median overhead a trial:  first {w} {median(outside[:w]):.0f} ms, last {w} {median(outside[-w:]):.0f} ms")
    print(f"ratio={median(outside[-w:]) / median(outside[:w]):.3f}")


if __name__ == "__main__":
    run_script(main)
