"""The windows of an epoch as micro-batches on the device, in the order of trainers/order.py. Tensors are
batched by indexing; any other Dataset is read through a DataLoader whose batch sampler yields the same
micro-batches, with each sample's augmentation seeded from (seed, epoch, sample). The test set comes in eval
batches, by indexing or through a loader alike."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from . import batches
from .config import TrainConfig
from .data import Data
from .distributed import ONE_PROCESS, OneProcess
from .losses import Loss, add_counts, counts_samples
from .order import MicroBatches, permutation, sample_seed, shard, windows


@dataclass
class Window:
    """One optimizer step: its number of samples and the loss's item counts, both over every process, and
    this process's part of it: `rows` samples, which `cut(b)` yields as micro-batches of b (again, at a smaller
    b, when a micro-batch ran out of memory)."""

    size: int
    counts: Any  # a number, a tensor, or a dict of them by loss term
    rows: int
    cut: Callable[[int], Iterable[tuple[Any, torch.Tensor]]]

    def parts(self, b: int) -> int:
        """Micro-batches at b; an empty part still runs one, empty, so that every rank synchronizes once."""
        return max(1, -(-self.rows // b))


class Seeded(Dataset):
    """Reads sample i of epoch e with torch's RNG seeded from (seed, e, i): (b, k) and (b*k, 1), any number
    of loader processes, and a rerun all see the same augmented samples.

    Python's and numpy's global RNGs are seeded the same way once the dataset is seen to draw from them
    (seeding all three costs about 12 µs a sample, a tenth of a CIFAR augmentation). Until then each process
    keeps them in a known state and, after every micro-batch, draws once from each beside a twin in the same
    state: a dataset that drew moved them on, the draws differ, and that micro-batch is read again with all
    three seeded per sample, as is every later one. In the main process (num_workers = 0) torch's RNG is
    given back to the training, which draws from it (dropout)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.owner, self.twins, self.all_rngs = None, None, False  # per process, set on its first sample

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list:
        """A micro-batch's samples (the DataLoader calls this once per batch: the per-sample work stays small)."""
        if self.owner != os.getpid():  # a new loader process (or the first batch): known states, and twins
            self.owner, self.all_rngs = os.getpid(), False
            random.seed(self.seed)
            np.random.seed(self.seed % 2 ** 32)
            self.twins = random.Random(self.seed), np.random.RandomState(self.seed % 2 ** 32)
        saved = torch.default_generator.get_state() if get_worker_info() is None else None
        try:
            if not self.all_rngs:
                samples = self._read(keys, all_rngs=False)
                if random.random() == self.twins[0].random() and np.random.random() == self.twins[1].random():
                    return samples
                self.all_rngs = True  # it draws from them: this micro-batch again, and every later one, seeded
            return self._read(keys, all_rngs=True)
        finally:
            if saved is not None:
                torch.default_generator.set_state(saved)

    def _read(self, keys: list[tuple[int, int]], all_rngs: bool) -> list:
        generator, dataset, samples = torch.default_generator, self.dataset, []
        for epoch, index in keys:
            seed = sample_seed(self.seed, epoch, index)
            generator.manual_seed(seed)  # CPU only: torch.manual_seed would seed every GPU (slow)
            if all_rngs:
                random.seed(seed)
                np.random.seed(seed % 2 ** 32)
            samples.append(dataset[index])
        return samples


class Feed:
    def __init__(self, data: Data, config: TrainConfig, device: torch.device, loss: Loss,
                 parallel: OneProcess = ONE_PROCESS):
        self.data, self.config, self.device, self.loss, self.parallel = data, config, device, loss, parallel
        self.rank = parallel.rank
        self.dtype = getattr(torch, config.dtype)
        self.n = data.n_train
        self.loader, self.test_loader, self.per_sample, self.empty = None, None, None, None
        if data.train_set is not None:
            self.sampler = MicroBatches(config, self.n, self.rank)
            workers = config.num_workers
            # A generator of its own: a loader draws its processes' base seed when an epoch's iteration
            # starts, and drawing it from torch's global RNG would move the training's (dropout) by one draw
            # per epoch with 0 processes and once per run with persistent ones, and differently on resume.
            self.loader = DataLoader(Seeded(data.train_set, config.seed), batch_sampler=self.sampler,
                                     collate_fn=data.collate, num_workers=workers, pin_memory=config.pin_memory and device.type == "cuda",
                                     persistent_workers=workers > 0, prefetch_factor=config.prefetch_factor
                                     if workers else None, generator=torch.Generator().manual_seed(config.seed))

    def epoch(self, epoch: int, config: TrainConfig) -> Iterator[Window]:
        """The epoch's windows, of `config`'s B (the run's, or under batch_warmup the epoch's)."""
        if self.loader is None:
            return self._tensor_windows(epoch, config)
        return self._loader_windows(epoch, config)

    def _tensor_windows(self, epoch: int, config: TrainConfig) -> Iterator[Window]:
        x, y, world = self.data.x_train, self.data.y_train, config.world_size

        def cut(mine: torch.Tensor, b: int) -> Iterator[tuple[Any, torch.Tensor]]:
            for idx in mine.split(b) if len(mine) else (mine,):
                yield x[idx], y[idx]

        rows = self.loss.counts_rows(y)
        for window in windows(permutation(config, epoch, self.n, self.device), config):
            # Every process holds the data: the counts of the whole window need no communication.
            mine = shard(window, self.rank, world)
            counts = len(window) if rows else self.loss.counts(y[window])
            yield Window(len(window), counts, len(mine), lambda b, mine=mine: cut(mine, b))

    def _loader_windows(self, epoch: int, config: TrainConfig) -> Iterator[Window]:
        self.sampler.set_epoch(epoch, config)
        loaded, b, world = iter(self.loader), config.physical_batch, config.world_size
        for window in windows(torch.arange(self.n), config):
            rows = len(shard(window, self.rank, world))
            parts = -(-rows // b)
            if self.per_sample and not config.shrink_on_oom:
                # The counts are the window's size: train on each micro-batch as it comes.
                stream = (self.to_device(next(loaded)) for _ in range(parts))
                yield Window(len(window), len(window), rows, lambda _, s=stream: s if rows else [self.empty])
                continue
            # The whole window's micro-batches first: their targets give the counts before any backward (and a
            # window that ran out of memory is cut again from them).
            micro = [self.to_device(next(loaded)) for _ in range(parts)]
            if self.empty is None and micro:
                self.empty = (batches.apply(micro[0][0], lambda t: t[:0]), micro[0][1][:0])
            counts = [self.loss.counts(target) for _, target in micro or [self.empty]]
            if self.per_sample is None:  # decided on the first window: a dataset and loss count alike in all
                self.per_sample = all(counts_samples(c, len(t)) for c, (_, t) in zip(counts, micro))
            total = None
            for c in counts:
                total = add_counts(total, c)
            if self.per_sample:
                total = len(window)
            else:  # under torchrun each rank read only its shard: the window's counts are the ranks' sum
                total = self.parallel.sum_counts(total, self.device)
            yield Window(len(window), total, rows, lambda b_now, micro=micro: self._recut(micro, b, b_now))

    def _recut(self, micro: list, b: int, b_now: int) -> list:
        if not micro:
            return [self.empty]
        if b_now == b:
            return micro
        if isinstance(micro[0][0], torch.Tensor):
            x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
            return list(zip(x.split(b_now), y.split(b_now)))
        # Mappings are padded per micro-batch, to lengths of their own: each is cut on its own.
        return [part for x, y in micro for part in batches.cut(x, y, b_now)]

    def to_device(self, batch) -> tuple[Any, torch.Tensor]:
        x, y = batches.split(batch, self.data.label_key)
        blocking = not self.config.pin_memory

        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(self.device, self.dtype if t.is_floating_point() else None, non_blocking=not blocking)
            return t.contiguous(memory_format=torch.channels_last) if self.config.channels_last and t.dim() == 4 else t

        return batches.apply(x, move), move(torch.as_tensor(y))

    def test(self) -> Iterator[tuple[Any, torch.Tensor]]:
        """The test set in eval batches, in order: by indexing, or through a loader (each sample seeded as in
        an epoch 0 of its own, so that a test set that draws reads the same at every evaluation)."""
        size = self.config.eval_batch
        if self.data.x_test is not None:
            yield from zip(self.data.x_test.split(size), self.data.y_test.split(size))
            return
        if self.test_loader is None:  # built once: its processes, if any, stay for the next evaluation
            workers = self.config.num_workers
            self.test_loader = DataLoader(
                Seeded(self.data.test_set, self.config.seed), batch_size=size, sampler=[(0, i) for i in range(
                    self.data.n_test)], collate_fn=self.data.collate, num_workers=workers,
                persistent_workers=workers > 0, generator=torch.Generator().manual_seed(self.config.seed))
        for batch in self.test_loader:
            yield self.to_device(batch)

    def inputs(self, batch: int) -> Iterator[torch.Tensor]:
        """The training inputs in order, in batches (augmented as in epoch 0): for BatchNorm's population
        statistics."""
        if self.loader is None:
            yield from self.data.x_train.split(batch)
            return
        keys = [(0, i) for i in range(self.n)]
        loader = DataLoader(Seeded(self.data.train_set, self.config.seed), batch_size=batch, sampler=keys,
                            collate_fn=self.data.collate, num_workers=self.config.num_workers,
                            generator=torch.Generator())
        for inputs in loader:
            yield self.to_device(inputs)[0]
