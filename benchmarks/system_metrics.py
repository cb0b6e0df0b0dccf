"""What --system-metrics costs the trainer: 12-epoch runs of the default configuration, in pairs in one process,
with and without MLflow's system-metrics monitor sampling beside them (a thread; every second, as the sweeps do; a
SQLite store), the order turned each pair (with, without; then without, with) so that a drift cancels. Prints each
pair, the median of the pairs' ratios with its distribution-free 95% interval (6 pairs at least: the least and
the greatest ratio), and `ratio=<with / without>` on the last line.

Torch runs one thread, as a study's worker does. Time is the process's CPU time by default (--clock cpu), the
monitor's thread included: wall time also counts the moments other processes hold the cores, which the monitor
does not cause (a 12-epoch run took 62 s wall-clock at a load of 3 against about 4 s alone; --clock wall
measures it so).

    python benchmarks/system_metrics.py [--pairs 6] [--clock cpu|wall]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

from paired import summary

from batchsweep.sweeps.gpus.placement import system_metrics
from batchsweep.sweeps.stores.mlflow_store import Tracker
from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.cli import run_script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    logging.getLogger("mlflow").setLevel(logging.ERROR)
    config = TrainConfig(epochs=args.epochs, data_dir=args.data_dir)
    train(config)  # warm-up: data cache, allocator
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        tracker = Tracker(f"sqlite:///{folder}/mlflow.db", "system_metrics")
        for pair in range(args.pairs):
            times = {}
            for mode in (("with", "without") if pair % 2 == 0 else ("without", "with")):
                run = tracker.start_parent(mode, {}, {})
                monitor = system_metrics(run, tracker.uri) if mode == "with" else None
                start = clock()
                train(config)
                times[mode] = clock() - start
                if monitor is not None:
                    monitor.finish()
                tracker.end(run, "FINISHED")
            ratios.append(times["with"] / times["without"])
            print(f"pair {pair + 1}: {times['without']:.2f} s without system metrics, {times['with']:.2f} s with "
                  f"({ratios[-1] - 1:+.1%}, {args.clock} time)", flush=True)
    if not ratios:
        raise SystemExit("error: no pair ran: nothing measured")
    print(summary(ratios, "system metrics cost"))
    print(f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    run_script(main)
