"""How much faster a group of configurations trains fused (trainers/fused.py) than one configuration at a time.

The group is that of the default study (accum_lr) at b = 32 and one seed: k in 1, 2, 4, 8, 16 under the LR rules
none, linear and sqrt, with its warmup, cosine schedule and weight decay, on cnn1d with BatchNorm and MNIST-1D:
15 members. In one process, each repeat trains the group fused and each member alone (`train`, with the
diagnostics and noise scale on both sides; fused whatever the members' size, where a study on the CPU would
train them alone), in alternating order after one untimed epoch of each side, and prints both times; last, the
median of the repeats' ratios (alone / fused) as `speedup=<x>`. Exits 1 when nothing was measured.

    python benchmarks/fused.py [--epochs 2] [--repeats 3] [--physical-batch 32] [--accum 1 2 4 8 16] [--device cuda]
                               [--dtype float64]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

import torch

from batchsweep.trainers import TrainConfig, train
from batchsweep.trainers.fused import train_fused
from batchsweep.trainers.build import load


def group(args) -> list[TrainConfig]:
    fixed = dict(model=args.model, dataset=args.dataset, physical_batch=args.physical_batch, epochs=args.epochs,
                 warmup_epochs=min(2, args.epochs), schedule="cosine", weight_decay=5e-4, base_lr=0.05, base_batch=32,
                 device=args.device, dtype=args.dtype, data_dir=args.data_dir)
    return [TrainConfig(**fixed, accum_steps=k, lr_rule=rule) for k in args.accum for rule in ("none", "linear", "sqrt")]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn1d")
    p.add_argument("--dataset", default="mnist1d")
    p.add_argument("--accum", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="the members' k")
    p.add_argument("--physical-batch", type=int, default=32, help="the members' b (the study's twins: --accum 1)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--data-dir", default="data")
    args = p.parse_args(argv)
    configs = group(args)
    data = load(configs[0])
    # Untimed: one epoch of each side, the first call's cost that a process pays once (a study's worker once a
    # study); in the timed repeats it fell on whichever side ran first, the slowest fused time in 7 of 10 runs.
    once = [dataclasses.replace(c, epochs=1, warmup_epochs=0) for c in configs[:2]]
    train_fused(once, data=data, saved_most=math.inf)
    train(once[0], data=data)
    ratios = []
    for repeat in range(args.repeats):
        fused = lambda: train_fused(configs, data=data, saved_most=math.inf)  # (whatever a study would decide)
        apart = lambda: [train(c, data=data) for c in configs]
        first, second = (fused, apart) if repeat % 2 == 0 else (apart, fused)
        times = {first: timed(first), second: timed(second)}
        ratios.append(times[apart] / times[fused])
        print(f"repeat {repeat + 1}: {len(configs)} members alone {times[apart]:.1f} s, fused {times[fused]:.1f} s, "
              f"speedup {ratios[-1]:.2f}", flush=True)
    if not ratios:
        print("nothing was measured", file=sys.stderr)
        return 1
    print(f"speedup={statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
