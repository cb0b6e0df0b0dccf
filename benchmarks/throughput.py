"""Samples/s of batchsweep's trainer against a plain hand-written accumulation loop.

Same model, data, device and precision, in one process. The two alternate epoch by epoch: the trainer
runs `--epochs` epochs and, from its per-epoch callback, the hand-written loop runs one epoch of its own
after each of them. Each trainer epoch is compared with the mean of the hand-written epochs just before
and just after it, so that the machine's slow and fast seconds, and any drift, hit both alike. After a
warm-up, prints every epoch, the quartiles of the ratios and, last, their median as `ratio=<x>`.

    python benchmarks/throughput.py [--device cuda] [--model resnet18 --dataset cifar10 --precision bf16]

A dataset that is not tensors (`--dataset cifar_shaped`, any Dataset with augmentation) goes through the
trainer's DataLoader path; the hand-written loop then reads it through the DataLoader everyone writes
(shuffle=True, batch_size=b, the same --num-workers, persistent), without batchsweep's per-sample seeding.

    python benchmarks/throughput.py --model tests.factories:small_conv2d --dataset cifar_shaped --num-workers 1

Samples that are mappings, batched by the dataset's collate function, with a model called with keyword
arguments whose output has `.logits` (a transformers GPT-2 from a config): the hand-written loop is the
one written for transformers, model(**batch) on the same DataLoader and the mean over the shifted labels / k.

    python benchmarks/throughput.py --model hf:gpt2-tiny --dataset pytext_hf --epochs 8

Where a micro-batch costs its kernels' launches (small models on a GPU), what counts is how many operations
each side dispatches: `--count-ops` counts them instead of timing (the same on any device), and prints the
trainer's extra operations a micro-batch as `extra_ops=<x>`. `--no-diagnostics` times the trainer without
its diagnostics.

    python benchmarks/throughput.py --count-ops --precision bf16 [--model gpt --dataset pytext]
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections import Counter
from dataclasses import replace

import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from trainers import ConfigError, TrainConfig, train
from trainers.batches import aligned, apply, forward, label_shift, split
from trainers.cli import add_config_flags, config_from_args, run_script
from trainers.loop import make_optimizer, prepare
from trainers.order import permutation


class HandWritten:
    """The loop everyone writes: loss / k, backward, step every k micro-batches. One epoch per call."""

    def __init__(self, config: TrainConfig):
        self.config = config
        prepared = prepare(config)
        self.device, self.data, self.model = prepared.device, prepared.data, prepared.model
        self.optimizer = make_optimizer(config, list(self.model.parameters()))
        self.epoch = 0
        train_set = self.data.train_set
        if train_set is not None:
            workers = config.num_workers
            self.loader = DataLoader(train_set, batch_size=config.physical_batch, shuffle=True, num_workers=workers,
                                     persistent_workers=workers > 0, pin_memory=config.pin_memory,
                                     prefetch_factor=config.prefetch_factor if workers else None,
                                     collate_fn=self.data.collate)
        self.shift = label_shift(self.model)

    def batches(self):
        if self.data.train_set is not None:
            for batch in self.loader:
                x, y = split(batch, self.config.label_key)
                yield (apply(x, lambda t: t.to(self.device, non_blocking=self.config.pin_memory)),
                       y.to(self.device, non_blocking=self.config.pin_memory))
            return
        data = self.data
        for idx in permutation(self.config, self.epoch, len(data.x_train), self.device).split(self.config.physical_batch):
            yield data.x_train[idx], data.y_train[idx]

    def run_epoch(self, micro_batches: int | None = None) -> float:
        """Trains one epoch, or its first `micro_batches`; returns its samples/s (NaN for a part of one)."""
        config, data, model, optimizer = self.config, self.data, self.model, self.optimizer
        k, n = config.accum_steps, data.n_train
        bf16 = config.precision == "bf16"
        self.epoch += 1
        start = time.perf_counter()
        for i, (x, y) in enumerate(itertools.islice(self.batches(), micro_batches)):
            with torch.autocast(self.device.type, torch.bfloat16, enabled=bf16):
                logits, target = aligned(forward(model, x), y, self.shift)
                loss = F.cross_entropy(logits.flatten(0, -2), target.flatten()) / k
            loss.backward()
            if (i + 1) % k == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n / (time.perf_counter() - start) if micro_batches is None else math.nan


class OpCount(TorchDispatchMode):
    """The operations dispatched, by name: on a GPU each is a launch, or at least a dispatch on the CPU side."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(config: TrainConfig) -> None:
    """Operations a micro-batch: the trainer with and without its diagnostics, and the hand-written loop, each
    the difference between a run of `long` windows and one of `long / 3`, so that what runs once a run
    (building, evaluating) cancels out. The same on any device: what a launch-bound GPU pays for."""
    long = min(30, HandWritten(config).data.n_train // config.effective_batch)
    if long < 3:
        raise ConfigError(f"--count-ops needs 3 windows of B = {config.effective_batch} in an epoch: lower "
                          f"--physical-batch or --accum-steps")
    short = long // 3
    micro = (long - short) * config.accum_steps

    def trainer(steps: int, diagnostics: bool) -> Counter:
        with OpCount() as count:
            train(replace(config, epochs=1, max_steps=steps), diagnostics=diagnostics)
        return count.ops

    def handwritten(steps: int) -> Counter:
        hand = HandWritten(config)  # (a fresh one, as the trainer is: its first step makes the optimizer's state)
        with OpCount() as count:
            hand.run_epoch(steps * config.accum_steps)
        return count.ops

    per = {"trainer": trainer(long, True) - trainer(short, True),
           "trainer, no diagnostics": trainer(long, False) - trainer(short, False),
           "hand-written": handwritten(long) - handwritten(short)}
    for name, ops in per.items():
        print(f"{name:24s} {sum(ops.values()) / micro:7.2f} operations a micro-batch")
    for name in ("trainer", "trainer, no diagnostics"):
        more = Counter(per[name])
        more.subtract(per["hand-written"])
        print(f"{name} beyond the hand-written loop: " + ", ".join(
            f"{op} {n / micro:.3f}" for op, n in more.most_common() if n / micro >= 0.01))
    print(f"extra_ops={(sum(per['trainer'].values()) - sum(per['hand-written'].values())) / micro:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                        help="the trainer without its built-in diagnostics (peak memory, health, noise scale)")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the operations a micro-batch dispatches instead of timing (last line extra_ops=)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args, TrainConfig(physical_batch=32, accum_steps=4, epochs=40))
    if args.count_ops:
        return count_ops(config)
    print(f"model={config.model} dataset={config.dataset} b={config.physical_batch} k={config.accum_steps} "
          f"precision={config.precision} threads={torch.get_num_threads()} epochs={config.epochs} "
          f"diagnostics={'on' if args.diagnostics else 'off'}")
    hand = HandWritten(config)
    warm_up = min(config.epochs, 2)
    train(replace(config, epochs=warm_up), diagnostics=args.diagnostics)  # caches, allocator, kernels
    hand_sps = [hand.run_epoch() for _ in range(warm_up)][-1:]
    ratios = []

    def pair(row: dict[str, float]) -> None:
        hand_sps.append(hand.run_epoch())
        ratios.append(row["samples_per_s"] / statistics.mean(hand_sps[-2:]))
        print(f"epoch {int(row['epoch'])}: trainer {row['samples_per_s']:,.0f} samples/s, "
              f"hand-written {hand_sps[-1]:,.0f} samples/s, ratio {ratios[-1]:.3f}")

    train(config, on_epoch=pair, diagnostics=args.diagnostics)
    if len(ratios) > 1:
        quartiles = statistics.quantiles(ratios, n=4)
        print(f"quartiles of the ratio: {quartiles[0]:.3f} {quartiles[1]:.3f} {quartiles[2]:.3f} "
              f"({len(ratios)} epochs)")
    print(f"ratio={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    run_script(main)
