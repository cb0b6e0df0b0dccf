"""Peak memory at a fixed physical batch b for k in {1, 4, 16}, and for the true batch b*k.

Accumulation must keep no micro-batch's graph alive: peak(b, 16) / peak(b, 1) <= 1.05, printed last as
`flat_ratio=<x>`, while the true batch grows with b*k. On the CPU the trainer counts the bytes autograd
holds for backward (until released) plus parameters, gradients and optimizer state; on CUDA it is
torch.cuda.max_memory_allocated, which also holds the dataset (kept on the device).

    python benchmarks/memory.py [--device cuda] [--physical-batch 32] [--model ... --dataset ...]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from trainers import TrainConfig, train
from trainers.cli import add_config_flags, config_from_args, format_bytes, run_script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, skip=("accum_steps",))
    args = parser.parse_args()
    base = config_from_args(args, TrainConfig(physical_batch=32, epochs=1))
    b = base.physical_batch
    rows = []
    for k in (1, 4, 16):
        accumulated = train(replace(base, accum_steps=k))
        true = train(replace(base, physical_batch=b * k, accum_steps=1))
        rows.append((k, accumulated.metrics["peak_memory_bytes"], true.metrics["peak_memory_bytes"]))
    print(f"model={base.model} dataset={base.dataset} b={b} device={accumulated.device_name} "
          f"memory={accumulated.memory_source}")
    print(f"{'k':>3}  {'B':>5}  {'accumulated (b, k)':>20}  {'true batch (B, 1)':>20}")
    for k, acc, true in rows:
        print(f"{k:>3}  {b * k:>5}  {format_bytes(acc):>20}  {format_bytes(true):>20}")
    print(f"true_growth={rows[-1][2] / rows[0][2]:.2f}")
    print(f"flat_ratio={rows[-1][1] / rows[0][1]:.3f}")


if __name__ == "__main__":
    run_script(main)
