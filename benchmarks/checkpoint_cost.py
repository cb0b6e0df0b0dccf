"""Cost of checkpoints at the default interval (every epoch), as a share of the epoch's time.

Runs with and without `--checkpoint-dir` take turns in pairs, the order turned each pair. A probe notes when
each epoch's last measurement ends and when the next epoch's first forward starts: the gap between them holds the
checkpoint's serialization (model, optimizer, probes, RNG states, history) and the loop's own bookkeeping, which
the runs without checkpoints measure alone. The file's write and fsync run in the background during the next
epoch. Each pair gives the checkpoint's share of its median epoch, from one epoch's end to the next's (the gap,
the training and evaluation, and the write beside them), with against without; two runs' epochs differ by more
than a checkpoint costs, so the figure is the median of the pairs' shares with its distribution-free 95% interval
(6 pairs at least). Torch runs one thread, as a study's worker does (at two, a busy machine's OpenMP waits spin
and count as CPU time). Time is the process's CPU time by default (--clock cpu), every thread's, the background
write's included: wall time also counts the moments other processes hold the cores, which no checkpoint causes
(single pairs of wall-clock epochs ranged from -98% to +390% at a load of 2.5 to 3; --clock wall measures it so).
Prints each pair, the median gaps and epochs, the file's size and, last, `checkpoint_share=<x>`.

    python benchmarks/checkpoint_cost.py [--epochs 10] [--pairs 6] [--clock cpu|wall] [--model resnet18 ...]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from paired import summary

from batchsweep.trainers import train
from batchsweep.trainers.checkpoint import FILE, Checkpointing
from batchsweep.trainers.cli import add_config_flags, config_from_args, format_bytes, run_script
from batchsweep.trainers.probes import Probe


class Gaps(Probe):
    """The seconds between one epoch's end of measurement and the next epoch's first forward, and from one
    epoch's end to the next's (training, evaluation and the gap), by `clock`."""

    def __init__(self, clock):
        self.clock, self.gaps, self.epochs, self.ended, self.last_end = clock, [], [], None, None

    @contextmanager
    def forward(self, step: int):
        if self.ended is not None:
            self.gaps.append(self.clock() - self.ended)
            self.ended = None
        yield

    def epoch_end(self, epoch: int) -> dict[str, float]:
        self.ended = self.clock()
        if self.last_end is not None:
            self.epochs.append(self.ended - self.last_end)
        self.last_end = self.ended
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--pairs", type=int, default=6, help="runs with and without checkpoints, in turns")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    config = config_from_args(args)
    torch.set_num_threads(1)
    gaps: dict[bool, list[float]] = {True: [], False: []}
    epochs: dict[bool, list[float]] = {True: [], False: []}
    size, shares = 0, []
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            own = {}  # this pair's (median gap, median epoch) with and without
            for saving in ((False, True) if pair % 2 == 0 else (True, False)):
                probe = Gaps(time.process_time if args.clock == "cpu" else time.perf_counter)
                folder = Path(scratch) / f"run{pair}"
                result = train(config, probes=[probe], checkpoint=Checkpointing(str(folder)) if saving else None)
                run_epochs = probe.epochs  # from the first epoch's end: each holds a gap and a checkpoint
                gaps[saving] += probe.gaps
                epochs[saving] += run_epochs
                own[saving] = (statistics.median(probe.gaps), statistics.median(run_epochs))
                if saving:
                    size = (folder / FILE).stat().st_size
            shares.append((own[True][1] - own[False][1]) / own[False][1])  # (an epoch's span holds its gap)
            print(f"pair {pair + 1}: checkpoint share {shares[-1]:+.2%}", flush=True)
    without, with_ = statistics.median(gaps[False]), statistics.median(gaps[True])
    epoch, epoch_with = statistics.median(epochs[False]), statistics.median(epochs[True])
    print(f"model={config.model} dataset={config.dataset} b={config.physical_batch} k={config.accum_steps} "
          f"device={result.device_name} checkpoint={format_bytes(size)}")
    print(f"gap between epochs: {without * 1e3:.2f} ms without checkpoints, {with_ * 1e3:.2f} ms with "
          f"({len(gaps[True])} gaps each)")
    print(f"median epoch after the first ({args.clock} time): {epoch * 1e3:.1f} ms without, {epoch_with * 1e3:.1f} "
          f"ms with (the background write overlaps it)")
    print(f"gap_share={(with_ - without) / epoch:.4f}")
    print(summary([1 + share for share in shares], "checkpoint share of an epoch"))
    print(f"checkpoint_share={statistics.median(shares):.4f}")


if __name__ == "__main__":
    run_script(main)
