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

Where the time of a micro-batch goes, on the host and on the device: `--profile N` runs N windows of each
loop under torch.profiler (after 4 of their own) and prints, a micro-batch, the host's time, the CPU time
of the operations, the kernels' time and their launches, then the operations where the trainer spends more
or less than the hand-written loop, and last its extra host time as `host_extra_us=<x>`. (The hand-written
loop cuts its whole epoch into micro-batches before the windows profiled, the trainer each window as it
comes: its `split` and `narrow`s, views, show on the trainer's side.)

    python benchmarks/throughput.py --device cuda --model gpt --dataset pytext --precision bf16 --profile 20
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import replace

import torch
import torch.nn.functional as F

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from batchsweep.trainers import ConfigError, TrainConfig, train
from batchsweep.trainers.batches import aligned, apply, forward, label_shift, split
from batchsweep.trainers.cli import add_config_flags, config_from_args, run_script
from batchsweep.trainers.build import make_optimizer, prepare
from batchsweep.trainers.order import permutation
from batchsweep.trainers.probes import Probe


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

    def run_epoch(self, micro_batches: int | None = None, step_done=None) -> float:
        """Trains one epoch, or its first `micro_batches`; returns its samples/s (NaN for a part of one).
        `step_done()` is called after each optimizer step."""
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
                if step_done is not None:
                    step_done()
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


class StepDone(Probe):
    """Calls `step_done()` after each of the trainer's optimizer steps."""

    def __init__(self, step_done):
        self.step_done = step_done

    def after_step(self, step: int) -> None:
        self.step_done()


def profile_loops(config: TrainConfig, diagnostics: bool, active: int) -> None:
    """`active` windows of each loop under torch.profiler (one profiler step a window, after `skip` that it does
    not record), twice each in the order trainer, hand-written, hand-written, trainer, so that neither gains
    from coming later; both loops, and the profiler, have run once before."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    skip = 4  # the setup and the first window (the optimizer's state) among them; the last is the warm-up
    windows, micro = skip + active, 2 * active * config.accum_steps  # (micro: over both runs of a loop)
    if active < 1:
        raise ConfigError(f"--profile takes the number of windows to profile, at least 1; got {active}")
    hand = HandWritten(config)
    if windows > hand.data.n_train // config.effective_batch:
        raise ConfigError(f"--profile {active} needs {windows} windows of B = {config.effective_batch} in an epoch: "
                          f"lower it, --physical-batch or --accum-steps")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if hand.device.type == "cuda" else [])]
    short = replace(config, epochs=1, max_steps=windows)
    runs = {"trainer": lambda step: train(short, diagnostics=diagnostics, probes=[StepDone(step)]),
            "hand-written": lambda step: hand.run_epoch(windows * config.accum_steps, step)}

    def profiled(run) -> list:
        found = []
        with profile(activities=activities, schedule=schedule(wait=skip - 1, warmup=1, active=active, repeat=1),
                     on_trace_ready=lambda p: found.append(p.key_averages())) as prof:
            run(prof.step)
        if not found:
            raise ConfigError("the profiler recorded no window: the run ended early (a diverged loss?)")
        return found[0]

    train(short, diagnostics=diagnostics)
    profiled(runs["hand-written"])
    # A micro-batch: the windows' span on the host (a ProfilerStep is a window), the kernels' time, and by
    # operation on the host its own CPU µs, its kernels' µs and its calls.
    span, kernels = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0.0)
    ops = {name: defaultdict(lambda: [0.0, 0.0, 0.0]) for name in runs}
    for name in ("trainer", "hand-written", "hand-written", "trainer"):
        for event in profiled(runs[name]):
            if event.device_type != DeviceType.CPU:  # a kernel (its time is its operation's too) or an annotation
                kernels[name] += 0.0 if event.is_user_annotation else event.self_device_time_total / micro
            elif event.key.startswith("ProfilerStep"):
                span[name] += event.cpu_time_total / micro
            else:
                totals = ops[name][event.key]
                for i, value in enumerate((event.self_cpu_time_total, event.self_device_time_total, event.count)):
                    totals[i] += value / micro
    print(f"profile of {active} windows ({micro // 2} micro-batches), twice for each loop: model={config.model} "
          f"b={config.physical_batch} k={config.accum_steps} precision={config.precision} device={hand.device} "
          f"diagnostics={'on' if diagnostics else 'off'}")
    report_profile(span, kernels, ops)


def report_profile(span: dict[str, float], kernels: dict[str, float], ops: dict[str, dict[str, list]]) -> None:
    """Each loop's line, a micro-batch; the operations where the trainer differs most; host_extra_us last."""
    print(f"{'a micro-batch':14s} {'host µs':>9s} {'ops CPU µs':>11s} {'kernels µs':>11s} {'launches':>9s} "
          f"{'aten ops':>9s}")
    for name, by_op in ops.items():
        print(f"{name:14s} {span[name]:9.1f} {sum(v[0] for v in by_op.values()):11.1f} {kernels[name]:11.1f} "
              f"{sum(v[2] for key, v in by_op.items() if 'LaunchKernel' in key):9.2f} "
              f"{sum(v[2] for key, v in by_op.items() if key.startswith('aten::')):9.2f}")
    more = {key: [a - b for a, b in zip(ops["trainer"][key], ops["hand-written"][key])]
            for key in {*ops["trainer"], *ops["hand-written"]}}
    print("the trainer beyond the hand-written loop, a micro-batch (CPU µs, kernels' µs, calls):")
    for key, (cpu, device, calls) in sorted(more.items(), key=lambda kv: -abs(kv[1][0]) - abs(kv[1][1]))[:15]:
        print(f"  {key[:60]:60s} {cpu:+8.2f} {device:+8.2f} {calls:+7.2f}")
    print(f"host_extra_us={span['trainer'] - span['hand-written']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own)")
    parser.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                        help="the trainer without its built-in diagnostics (peak memory, health, noise scale)")
    parser.add_argument("--count-ops", action="store_true",
                        help="count the operations a micro-batch dispatches instead of timing (last line extra_ops=)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N windows of each loop instead of timing epochs (last line host_extra_us=)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = config_from_args(args, TrainConfig(physical_batch=32, accum_steps=4, epochs=40))
    if args.count_ops:
        return count_ops(config)
    if args.profile != 0:
        return profile_loops(config, args.diagnostics, args.profile)
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
