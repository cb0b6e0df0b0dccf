"""Samples/s of batchsweep's trainer against a plain hand-written accumulation loop.

Same model, data, device and precision, in one process; repeats interleaved after a warm-up so that
machine noise hits both alike. Prints the median ratio (trainer / hand-written) as `ratio=<x>` last.

    python benchmarks/throughput.py [--device cuda] [--model resnet18 --dataset cifar10 --precision bf16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trainers import TrainConfig, train
from trainers.cli import add_config_flags, config_from_args
from trainers.loop import _prepare, make_optimizer, permutation


def hand_written(config: TrainConfig) -> float:
    """The loop everyone writes: loss / k, backward, step every k micro-batches. Returns samples/s."""
    device, data, model, _ = _prepare(config)
    optimizer = make_optimizer(config, list(model.parameters()))
    b, k, n = config.physical_batch, config.accum_steps, len(data.x_train)
    bf16 = config.precision == "bf16"
    start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        for i, idx in enumerate(permutation(config, epoch, n, device).split(b)):
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]) / k
            loss.backward()
            if (i + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return config.epochs * n / (time.perf_counter() - start)


def ours(config: TrainConfig) -> float:
    """Training samples/s as the trainer reports it (evaluation excluded, as in the hand-written loop)."""
    return train(config).metrics["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = TrainConfig(physical_batch=32, accum_steps=4, epochs=4)
    config = config_from_args(args, base)
    print(f"model={config.model} dataset={config.dataset} b={config.physical_batch} k={config.accum_steps} "
          f"precision={config.precision} threads={torch.get_num_threads()}")
    ours(config), hand_written(config)  # warm-up: caches, allocator, kernels
    ratios = []
    for r in range(args.repeats):
        ours_sps, hand_sps = ours(config), hand_written(config)
        ratios.append(ours_sps / hand_sps)
        print(f"repeat {r + 1}: trainer {ours_sps:,.0f} samples/s, hand-written {hand_sps:,.0f} samples/s, "
              f"ratio {ratios[-1]:.3f}")
    print(f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
