"""Model and dataset factories that tests pass to the trainer as `tests.factories:NAME`."""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def linreg(seed=0, **_):
    """The classic accumulation check: y = -2 x1 + 3.4 x2 + 4.2 plus a little noise."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(1200, 2, generator=g)
    y = x @ torch.tensor([-2.0, 3.4]) + 4.2 + 0.1 * torch.randn(1200, generator=g)
    return TensorDataset(x[:1000], y[:1000, None]), TensorDataset(x[1000:], y[1000:, None])


def zero_linear(input_shape, num_classes, **_):
    model = nn.Linear(input_shape[0], num_classes)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def _blobs(train: int, test: int, data_seed: int):
    """Points in 4-D around one centre per class, 3 classes taking turns."""
    g = torch.Generator().manual_seed(data_seed)
    y = torch.arange(train + test) % 3
    x = torch.randn(train + test, 4, generator=g) + y[:, None].float()
    return TensorDataset(x[:train], y[:train]), TensorDataset(x[train:], y[train:])


def blobs(seed=0, **_):
    """90 train and 30 test points in 3 classes: 3 windows of 30 at b=10, k=3."""
    return _blobs(90, 30, 7)


class GradProbe(nn.Module):
    """Records, at every training forward, whether the weight's gradient is empty."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)
        self.grad_was_empty = []

    def forward(self, x):
        if self.training:
            self.grad_was_empty.append(self.linear.weight.grad is None)
        return self.linear(x)


def half_frozen(input_shape, num_classes, **_):
    model = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1] * input_shape[0], 32), nn.ReLU(),
                          nn.Linear(32, num_classes))
    model[1].requires_grad_(False)
    return model


def not_a_model(**_):
    return "not a module"


def not_a_dataset(**_):
    return [1, 2, 3]


def broken_model(**_):
    raise RuntimeError("factory exploded")


def blobs1k(seed=0, **_):
    """1,024 train and 256 test points in 3 classes: big enough for every accum_lr point (B <= 512)."""
    return _blobs(1024, 256, 11)


class OutOfMemory(nn.Module):
    """Raises what a CUDA allocator raises when the batch does not fit, on any device."""

    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)

    def forward(self, x):
        if self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.linear(x)


def cifar_tiny(seed=0, **_):
    """64 train and 32 test random images shaped like CIFAR-10."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(96, 3, 32, 32, generator=g), torch.randint(0, 10, (96,), generator=g)
    return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


class ForgetsALayer(nn.Sequential):
    """Its own optimizer groups leave the first layer out: a classic silent bug."""

    def param_groups(self):
        return [{"params": list(self[2].parameters())}]


def forgets_a_layer(input_shape, num_classes, **_):
    return ForgetsALayer(nn.Linear(input_shape[-1], 32), nn.ReLU(), nn.Linear(32, num_classes), nn.Flatten())


class UnusedLayer(nn.Module):
    def __init__(self, input_shape, num_classes, **_):
        super().__init__()
        self.used = nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], 16), nn.ReLU(), nn.Linear(16, num_classes))
        self.unused = nn.Linear(4, 4)  # built but never called in forward

    def forward(self, x):
        return self.used(x)


def unused_layer(input_shape, num_classes, **_):
    return UnusedLayer(input_shape, num_classes)
