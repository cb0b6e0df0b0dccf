"""What --system-metrics costs the trainer: 12-epoch runs of the default configuration, alternately with and
without MLflow's system-metrics monitor sampling beside them (a thread; every second, as the sweeps do; a
SQLite store), and the median time of each. Prints `ratio=<with / without>` on the last line.

    python benchmarks/system_metrics.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

from batchsweep.sweeps.gpus.placement import system_metrics
from batchsweep.sweeps.stores.mlflow_store import Tracker
from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.cli import run_script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--data-dir", default="data")
    args = parser.parse_args()
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    config = TrainConfig(epochs=args.epochs, data_dir=args.data_dir)
    train(config)  # warm-up: data cache, allocator
    times: dict[str, list[float]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory() as folder:
        tracker = Tracker(f"sqlite:///{folder}/mlflow.db", "system_metrics")
        for _ in range(args.repeats):
            for mode in times:
                run = tracker.start_parent(mode, {}, {})
                monitor = system_metrics(run, tracker.uri) if mode == "with" else None
                start = time.perf_counter()
                train(config)
                times[mode].append(time.perf_counter() - start)
                if monitor is not None:
                    monitor.finish()
                tracker.end(run, "FINISHED")
    for mode, values in times.items():
        print(f"{mode} system metrics: " + ", ".join(f"{v:.2f}" for v in values) + " s")
    print(f"ratio={statistics.median(times['with']) / statistics.median(times['without']):.3f}")


if __name__ == "__main__":
    run_script(main)
