"""Cost of the diagnostics: the time the trainer spends inside them, as a share of its training time.

The health statistics (`trainers/health.py`: StepStats.before_step and after_step) and the gradient noise
scale (`trainers/noise.py`: NoiseScale.after_micro and step) are timed where they run, in the same runs
whose training time they are divided by: the machine's noise hits numerator and denominator alike. What
they cost beyond their own calls (caches, allocator) shows in `throughput.py`, whose hand-written loop
computes none of them. Prints each part per call and, last, the median total share as `overhead=<x>`.

    python benchmarks/diagnostics_overhead.py [--accum-steps 16] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from trainers import TrainConfig, train
from trainers.cli import add_config_flags, config_from_args, run_script
from trainers.data import load_data
from trainers.health import StepStats
from trainers.noise import NoiseScale

PARTS = {StepStats: ("before_step", "after_step"), NoiseScale: ("after_micro", "step")}
spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(cls: type, name: str) -> None:
    """Wrap cls.name so that every call adds its time to `spent` (synchronized on a GPU, where the work is
    queued rather than done inside the call)."""
    method, key = getattr(cls, name), f"{cls.__name__}.{name}"

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        result = method(self, *args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        spent[key] += time.perf_counter() - start
        calls[key] += 1
        return result

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = config_from_args(args, TrainConfig(epochs=10, accum_steps=4))
    n_train = len(load_data(config.dataset, config.data_dir, config.seed).x_train)
    for cls, names in PARTS.items():
        for name in names:
            timed(cls, name)
    train(config)  # warm-up
    shares, per_call = [], defaultdict(list)
    for _ in range(args.repeats):
        spent.clear()
        calls.clear()
        result = train(config)
        train_time = config.epochs * n_train / result.metrics["samples_per_s"]
        shares.append(sum(spent.values()) / train_time)
        for key, seconds in spent.items():
            per_call[key].append((seconds / calls[key], calls[key], seconds / train_time))
    print(f"model={config.model} b={config.physical_batch} k={config.accum_steps} epochs={config.epochs} "
          f"threads={torch.get_num_threads()}")
    for key, rows in per_call.items():
        print(f"{key:24s} {statistics.median(r[0] for r in rows) * 1e6:7.1f} µs a call, "
              f"{rows[0][1]} calls a run, share {statistics.median(r[2] for r in rows):.4f}")
    print(f"total shares: {[round(s, 4) for s in shares]}")
    print(f"overhead={statistics.median(shares):.4f}")


if __name__ == "__main__":
    run_script(main)
