"""Cost of the diagnostics: the time the trainer spends inside them, as a share of its training time.

The built-in probes (`trainers/probes.py`: peak memory, the health statistics and the gradient noise scale)
run wrapped in a timer, through train()'s probe seam, in the same runs whose training time they are divided
by: the machine's noise hits numerator and denominator alike. What they cost beyond their own calls
(caches, allocator) shows in `throughput.py`, whose hand-written loop computes none of them. Prints each
part per call, whether the weights are bitwise those of a run without probes, and, last, the median total
share as `overhead=<x>`.

    python benchmarks/diagnostics_overhead.py [--accum-steps 16] [--device cuda]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.cli import add_config_flags, config_from_args, run_script
from batchsweep.trainers.data import load_data
from batchsweep.trainers.probes import Probe, diagnostics

SYNC = torch.cuda.is_available()
spent: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


class Timed(Probe):
    """A built-in probe whose every call during training adds its time to `spent` (synchronized on a GPU,
    where the work is queued rather than done inside the call)."""

    def __init__(self, probe: Probe):
        self.probe, self.name = probe, type(probe).__name__

    def _time(self, part: str, call, *args):
        start = time.perf_counter()
        result = call(*args)
        if SYNC:
            torch.cuda.synchronize()
        spent[f"{self.name}.{part}"] += time.perf_counter() - start
        calls[f"{self.name}.{part}"] += 1
        return result

    def start(self, run):
        self.probe.start(run)

    @contextmanager
    def forward(self, step):
        with self.probe.forward(step):
            yield  # the hooks' cost lands in the forward it wraps: counted in throughput.py

    def after_micro(self, micro):
        self._time("after_micro", self.probe.after_micro, micro)

    def before_step(self, step, window):
        self._time("before_step", self.probe.before_step, step, window)

    def after_step(self, step):
        self._time("after_step", self.probe.after_step, step)

    def epoch_end(self, epoch):
        return self.probe.epoch_end(epoch)  # after the epoch's training time

    def notes(self):
        return self.probe.notes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = config_from_args(args, TrainConfig(epochs=10, accum_steps=4))
    n_train = load_data(config.dataset, config.data_dir, config.seed).n_train
    blind = train(config, diagnostics=False)  # warm-up, and the weights without any measurement
    shares, per_call = [], defaultdict(list)
    for _ in range(args.repeats):
        spent.clear()
        calls.clear()
        result = train(config, diagnostics=False, probes=[Timed(p) for p in diagnostics()])
        train_time = config.epochs * n_train / result.metrics["samples_per_s"]
        shares.append(sum(spent.values()) / train_time)
        for key, seconds in spent.items():
            per_call[key].append((seconds / calls[key], calls[key], seconds / train_time))
    print(f"model={config.model} b={config.physical_batch} k={config.accum_steps} epochs={config.epochs} "
          f"threads={torch.get_num_threads()}")
    for key, rows in per_call.items():
        print(f"{key:24s} {statistics.median(r[0] for r in rows) * 1e6:7.1f} µs a call, "
              f"{rows[0][1]} calls a run, share {statistics.median(r[2] for r in rows):.4f}")
    same = all(torch.equal(p, q) for p, q in zip(result.model.parameters(), blind.model.parameters()))
    print(f"weights with the probes on and off bitwise equal: {same}")
    print(f"total shares: {[round(s, 4) for s in shares]}")
    print(f"overhead={statistics.median(shares):.4f}")


if __name__ == "__main__":
    run_script(main)
