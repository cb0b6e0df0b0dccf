"""The order of an epoch: one seeded permutation, cut into windows of B samples (one optimizer step each),
each cut into micro-batches of b. It depends on seed and epoch only, never on b or k, so (b, k) and
(b*k, 1) step through the same samples."""
from __future__ import annotations

import torch

from .config import TrainConfig


def permutation(config: TrainConfig, epoch: int, n: int, device: torch.device | None = None) -> torch.Tensor:
    """Sample order of an epoch."""
    if not config.shuffle:
        return torch.arange(n, device=device)
    generator = torch.Generator().manual_seed(config.seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).to(device)


def windows(order: torch.Tensor, config: TrainConfig) -> list[torch.Tensor]:
    """Cut an epoch's order into windows of B samples."""
    parts = list(order.split(config.effective_batch))
    if config.drop_last and len(parts[-1]) < config.effective_batch:
        parts.pop()
    return parts


def steps_per_epoch(config: TrainConfig, n: int) -> int:
    """The windows (optimizer steps) of an epoch of n samples."""
    return len(windows(torch.arange(n), config))


def shard(window: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """A data-parallel rank's contiguous part of a window: the ranks' parts, in rank order, are the window.
    Sizes differ by at most one; a part is empty when the window is shorter than the world."""
    return window if world == 1 else window.tensor_split(world)[rank]


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch: whatever b, k and the loader's processes are, a
    sample is augmented the same way in the same epoch of the same seed."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_659 + index) % 2 ** 63


class MicroBatches(torch.utils.data.Sampler):
    """A DataLoader's batch sampler: the micro-batches of every window of an epoch, in order, as lists of
    (epoch, sample index) keys for `Seeded`, of this rank's shard of each window (an empty shard yields
    nothing). Call `set_epoch` before each epoch, as with DistributedSampler (with the epoch's configuration
    under batch_warmup)."""

    def __init__(self, config: TrainConfig, n: int, rank: int = 0):
        self.config, self.n, self.epoch, self.rank = config, n, 1, rank

    def set_epoch(self, epoch: int, config: TrainConfig | None = None) -> None:
        self.epoch, self.config = epoch, config or self.config

    def __iter__(self):
        for window in windows(permutation(self.config, self.epoch, self.n), self.config):
            for idx in shard(window, self.rank, self.config.world_size).split(self.config.physical_batch):
                yield [(self.epoch, i) for i in idx.tolist()]

    def __len__(self) -> int:
        return sum(-(-len(shard(w, self.rank, self.config.world_size)) // self.config.physical_batch)
                   for w in windows(torch.arange(self.n), self.config))
