"""What synchronizing once per window saves: data-parallel training with DDP's gradient all-reduce skipped on
every micro-batch but the window's last (`no_sync`, batchsweep's way), against an all-reduce after every
micro-batch. Both compute the same weights.

Runs of the two take turns in one torchrun launch (gloo on the CPU, NCCL on GPUs). Prints, per optimizer step,
the all-reduce calls and bytes (counted by the communication hook that does them) and the median time of an
epoch's training, and last the ratios as `allreduce_ratio=<x>` and `epoch_time_ratio=<x>` (every micro-batch
over once per window).

    torchrun --nproc-per-node 2 benchmarks/ddp_sync.py [--accum-steps 8] [--epochs 3] [--pairs 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from batchsweep.trainers import train
from batchsweep.trainers.cli import add_config_flags, config_from_args, format_bytes, run_script

DEFAULTS = ["--model", "cnn1d", "--physical-batch", "32", "--accum-steps", "8", "--epochs", "3", "--device", "cpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--effective-batch", help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=3, help="runs of each kind, in turns")
    args = parser.parse_args(DEFAULTS + sys.argv[1:])
    config = config_from_args(args)
    if config.world_size < 2:
        raise SystemExit("run it under torchrun: torchrun --nproc-per-node 2 benchmarks/ddp_sync.py")
    on_gpu = config.device != "cpu" and torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")  # one group for every run
    seen: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for _ in range(args.pairs):
        for once in (True, False):
            result = train(config, no_sync=once, diagnostics=False)
            for row in result.history[1:]:  # the first epoch holds DDP's start-up (bucket building)
                steps = row["steps"] / row["epoch"]
                train_s = result.dataset["train_size"] / row["samples_per_s"]  # (the evaluation left out)
                for key, value in (("calls", row["allreduce_calls"] / steps), ("bytes", row["allreduce_bytes"] / steps),
                                   ("epoch_s", train_s)):
                    seen[once].setdefault(key, []).append(value)
    if dist.get_rank() == 0:
        median = {once: {k: statistics.median(v) for k, v in seen[once].items()} for once in seen}
        print(f"{config.model} on {config.dataset}, b = {config.physical_batch}, k = {config.accum_steps}, "
              f"{config.world_size} ranks ({dist.get_backend()}), {args.pairs} runs each, medians over epochs 2+")
        print(f"{'gradient all-reduce':<26}  {'calls/step':>10}  {'bytes/step':>10}  {'training s/epoch':>16}")
        for name, once in (("once per window (no_sync)", True), ("after every micro-batch", False)):
            m = median[once]
            print(f"{name:<26}  {m['calls']:>10.2f}  {format_bytes(m['bytes']):>10}  {m['epoch_s']:>16.3f}")
        print(f"allreduce_ratio={median[False]['bytes'] / median[True]['bytes']:.2f}")
        print(f"epoch_time_ratio={median[False]['epoch_s'] / median[True]['epoch_s']:.3f}")
    dist.barrier()  # a rank that tears gloo down while its peer still prints can abort the job at exit
    dist.destroy_process_group()
    # Even so, gloo's threads can abort a rank while the interpreter shuts down ("terminate called without an
    # active exception", exit -6, seen once in six suite runs): the figure is printed, so leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_script(main)
