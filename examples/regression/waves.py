"""A regression of your own for the trainer: float targets, a small MLP with BatchNorm.

y = sin(3 x1) x2 + x3^2 / 2 + noise over 8 standard normal inputs; 4,000 samples to train on, 1,000 to validate.
The loss is squared error (the trainer's own for float targets), so the trials log val_loss and no accuracy.
"""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def waves(seed=0, **_):
    g = torch.Generator().manual_seed(7)  # the same data for every trial: the seed varies the model, not this
    x = torch.randn(5000, 8, generator=g)
    y = torch.sin(3 * x[:, 0]) * x[:, 1] + 0.5 * x[:, 2] ** 2 + 0.1 * torch.randn(5000, generator=g)
    return TensorDataset(x[:4000], y[:4000, None]), TensorDataset(x[4000:], y[4000:, None])


def mlp(input_shape, num_classes, **_):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[-1], 64), nn.BatchNorm1d(64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, num_classes))
