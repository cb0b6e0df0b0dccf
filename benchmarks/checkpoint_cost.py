"""Cost of checkpoints at the default interval (every epoch), as a share of the epoch's time.

Runs with and without `--checkpoint-dir` take turns in pairs, the order turned each pair. A probe notes when each epoch's last measurement ends and
when the next epoch's first forward starts: the gap between them holds the checkpoint's serialization (model,
optimizer, probes, RNG states, history) and the loop's own bookkeeping, which the runs without checkpoints
measure alone. The file's write and fsync run in the background during the next epoch, whose time they may
lengthen. Each pair gives the checkpoint's share of its median epoch (training and evaluation): the longer gap
and the longer epoch together, against the run without; two runs' epochs differ by more than a checkpoint costs,
so the figure is the median of the pairs' shares with its distribution-free 95% interval (6 pairs at least).
Prints each pair, the median gaps and epochs, the file's size and, last, `checkpoint_share=<x>`.

    python benchmarks/checkpoint_cost.py [--epochs 10] [--pairs 6] [--model resnet18 --dataset cifar_shaped]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from paired import summary

from batchsweep.trainers import train
from batchsweep.trainers.checkpoint import FILE, Checkpointing
from batchsweep.trainers.cli import add_config_flags, config_from_args, format_bytes, run_script
from batchsweep.trainers.probes import Probe


class Gaps(Probe):
    """The seconds between one epoch's end of measurement and the next epoch's first forward."""

    def __init__(self):
        self.gaps, self.ended = [], None

    @contextmanager
    def forward(self, step: int):
        if self.ended is not None:
            self.gaps.append(time.perf_counter() - self.ended)
            self.ended = None
        yield

    def epoch_end(self, epoch: int) -> dict[str, float]:
        self.ended = time.perf_counter()
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--pairs", type=int, default=6, help="runs with and without checkpoints, in turns")
    args = parser.parse_args()
    config = config_from_args(args)
    gaps: dict[bool, list[float]] = {True: [], False: []}
    epochs: dict[bool, list[float]] = {True: [], False: []}
    size, shares = 0, []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            own = {}  # this pair's (median gap, median epoch) with and without
            for saving in ((False, True) if pair % 2 == 0 else (True, False)):
                probe = Gaps()
                folder = Path(scratch) / f"run{pair}"
                result = train(config, probes=[probe], checkpoint=Checkpointing(str(folder)) if saving else None)
                run_epochs = [row["epoch_time_s"] for row in result.history[1:]]
                gaps[saving] += probe.gaps
                epochs[saving] += run_epochs
                own[saving] = (statistics.median(probe.gaps), statistics.median(run_epochs))
                if saving:
                    size = (folder / FILE).stat().st_size
            shares.append((own[True][0] - own[False][0] + own[True][1] - own[False][1]) / own[False][1])
            print(f"pair {pair + 1}: checkpoint share {shares[-1]:+.2%}", flush=True)
    without, with_ = statistics.median(gaps[False]), statistics.median(gaps[True])
    epoch, epoch_with = statistics.median(epochs[False]), statistics.median(epochs[True])
    print(f"model={config.model} dataset={config.dataset} b={config.physical_batch} k={config.accum_steps} "
          f"device={result.device_name} checkpoint={format_bytes(size)}")
    print(f"gap between epochs: {without * 1e3:.2f} ms without checkpoints, {with_ * 1e3:.2f} ms with "
          f"({len(gaps[True])} gaps each)")
    print(f"median epoch after the first: {epoch * 1e3:.1f} ms without, {epoch_with * 1e3:.1f} ms with (the "
          f"background write overlaps it)")
    print(f"gap_share={(with_ - without) / epoch:.4f}")
    print(summary([1 + share for share in shares], "checkpoint share of an epoch"))
    print(f"checkpoint_share={statistics.median(shares):.4f}")


if __name__ == "__main__":
    run_script(main)
