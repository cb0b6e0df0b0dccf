"""Random tensors shaped like CIFAR-10, for speed and memory figures where no data can be downloaded.

Use from a benchmark script as `--dataset synthetic:cifar_shaped` (benchmarks/ is on the script's path).
Accuracy on it means nothing; throughput and memory depend only on the shapes.
"""
import torch
from torch.utils.data import TensorDataset


def cifar_shaped(seed=0, train=50_000, test=2_000, **_):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(train + test, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (train + test,), generator=g)
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def blobs(seed=0, train=1024, test=256, **_):
    """Four classes of 8-D points around their own centres: trials that take milliseconds to train."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(train + test) % 4
    x = torch.randn(train + test, 8, generator=g) + y[:, None].float()
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])
