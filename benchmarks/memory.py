"""Peak memory at a fixed physical batch b for k in {1, 4, 16}, and for the true batch b*k.

Accumulation must keep no micro-batch's graph alive: peak(b, 16) / peak(b, 1) <= 1.05, printed last as
`flat_ratio=<x>`, while the true batch grows with b*k. On the CPU the trainer counts the bytes autograd
holds for backward (until released) plus parameters, gradients and optimizer state; on CUDA it is
torch.cuda.max_memory_allocated, which also holds the dataset (kept on the device). Beside each peak, the
trainer's samples/s of the last epoch: what accumulation costs in speed against the true batch (give --epochs 2
or more to leave the first epoch's warm-up out of it).

    python benchmarks/memory.py [--device cuda] [--physical-batch 32] [--model ... --dataset ...]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.cli import add_config_flags, config_from_args, format_bytes, run_script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, skip=("accum_steps",))
    args = parser.parse_args()
    base = config_from_args(args, TrainConfig(physical_batch=32, epochs=1))
    b = base.physical_batch
    rows = []
    for k in (1, 4, 16):
        accumulated = _measured(replace(base, accum_steps=k))
        true = _measured(replace(base, physical_batch=b * k, accum_steps=1))
        rows.append((k, accumulated[:2], true[:2]))
    print(f"model={base.model} dataset={base.dataset} b={b} precision={base.precision} epochs={base.epochs} "
          f"{accumulated[2]}")
    print(f"{'k':>3}  {'B':>5}  {'accumulated (b, k)':>20}  {'samples/s':>9}  {'true batch (B, 1)':>20}  "
          f"{'samples/s':>9}")
    for k, *runs in rows:
        print(f"{k:>3}  {b * k:>5}" + "".join(f"  {format_bytes(peak):>20}  {sps:>9,.0f}" for peak, sps in runs))
    print(f"true_growth={rows[-1][2][0] / rows[0][2][0]:.2f}")
    print(f"flat_ratio={rows[-1][1][0] / rows[0][1][0]:.3f}")


def _measured(config) -> tuple[int, float, str]:
    """A run's peak memory, the samples/s of its last epoch, and where they were measured. Only these are kept:
    the result holds the run's model, which on a GPU would count in every later run's allocator peak."""
    run = train(config)
    return (run.metrics["peak_memory_bytes"], run.history[-1]["samples_per_s"],
            f"device={run.device_name} memory={run.memory_source}")


if __name__ == "__main__":
    run_script(main)
