"""Model registry: built-in networks by name, user networks by `package.module:factory`."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .batches import forward
from .errors import ConfigError
from . import hf
from .imports import load_factory
from .lm import gpt


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm1d(channels)
    if kind == "group":
        return nn.GroupNorm(4, channels)
    return nn.Identity()


def cnn1d(input_shape, num_classes, norm="batch", **_) -> nn.Module:
    """Conv1d net for MNIST-1D (about 10k parameters); `norm` picks BatchNorm, GroupNorm or none."""
    channels, length = input_shape
    bias = norm == "none"
    layers, width_in = [], channels
    for width, stride in ((16, 1), (32, 2), (32, 2)):
        layers += [nn.Conv1d(width_in, width, 3 if stride == 2 else 5, stride, 1 if stride == 2 else 2, bias=bias),
                   _norm(norm, width), nn.ReLU()]
        width_in = width
        length = (length - 1) // stride + 1
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(width_in * length, num_classes))


def mlp(input_shape, num_classes, hidden=128, **_) -> nn.Module:
    """Two hidden layers, no normalization: accumulation is exact for it."""
    inputs = 1
    for size in input_shape:
        inputs *= size
    return nn.Sequential(nn.Flatten(), nn.Linear(inputs, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))


def resnet18(input_shape, num_classes, **_) -> nn.Module:
    """torchvision's ResNet-18 for 32x32 images: 3x3 stem with stride 1 and no max-pool."""
    from torchvision.models import resnet18 as tv_resnet18

    net = tv_resnet18(num_classes=num_classes)
    net.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=3, stride=1, padding=1, bias=False)
    net.maxpool = nn.Identity()
    return net


@dataclass(frozen=True)
class Builtin:
    """A built-in model: its factory and what it takes."""

    build: Callable[..., nn.Module]
    rank: int | None  # of one sample (None: any)
    tokens: bool  # token ids, not floats
    takes: str  # in words


MODELS = {"cnn1d": Builtin(cnn1d, 2, False, "signals of shape (channels, length)"),
          "mlp": Builtin(mlp, None, False, "floats of any shape"),
          "resnet18": Builtin(resnet18, 3, False, "images of shape (channels, height, width)"),
          "gpt": Builtin(gpt, 1, True, "token ids of shape (length,)")}


def _takes(name: str, inputs) -> bool:
    model = MODELS[name]
    return torch.is_tensor(inputs) and model.rank in (None, inputs.dim() - 1) and \
        inputs.is_floating_point() != model.tokens


def check_inputs(name: str, dataset: str, inputs) -> None:
    """A built-in model and samples it cannot take: one line before training, not a traceback from inside it.
    `inputs`: a batch of the dataset's inputs."""
    if name not in MODELS or _takes(name, inputs):
        return
    if isinstance(inputs, Mapping):
        got = f"mappings of {', '.join(inputs)}"
        hint = "use a model that takes them as keyword arguments (--model hf:gpt2-tiny, or your own factory)"
    else:
        got = (f"{'floats' if inputs.is_floating_point() else 'integers'} of shape {tuple(inputs.shape[1:])}"
               if torch.is_tensor(inputs) else type(inputs).__name__)
        fitting = [n for n in MODELS if _takes(n, inputs)]
        hint = (f"use --model {' or '.join(fitting)}" if fitting else
                "use your own model (--model package.module:factory)")
    raise ConfigError(f"model {name!r} takes {MODELS[name].takes}, and dataset {dataset!r} gives {got}", hint)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, norm: str) -> nn.Module:
    if name.startswith("hf:"):
        return hf.build(name, num_classes)
    if ":" in name:
        model = load_factory(name, "model")(input_shape=input_shape, num_classes=num_classes)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model factory {name!r} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if name != "cnn1d" and norm != "batch":
        raise ConfigError(f"norm={norm!r} applies to cnn1d only, not {name!r}")
    return MODELS[name].build(input_shape=input_shape, num_classes=num_classes, norm=norm)


def batchnorm_layers(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def set_bn_momentum(model: nn.Module, momentum: float) -> int:
    """Set every BatchNorm layer's momentum; returns how many layers there are."""
    layers = batchnorm_layers(model)
    for layer in layers:
        layer.momentum = momentum
    return len(layers)


def _ghost_forward(layer: nn.modules.batchnorm._BatchNorm, ghost: int):
    plain = layer.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not layer.training or x.shape[0] <= ghost:
            return plain(x)
        # Each chunk is normalized by its own statistics and updates the running stats once,
        # exactly as k micro-batches of size `ghost` would under accumulation.
        return torch.cat([plain(chunk) for chunk in x.split(ghost)])

    return forward


def use_ghost_batch(model: nn.Module, ghost: int) -> int:
    """Make every BatchNorm layer normalize in chunks of `ghost` samples (Hoffer et al. 2017)."""
    layers = batchnorm_layers(model)
    for layer in layers:
        layer.forward = _ghost_forward(layer, ghost)
    return len(layers)


@torch.no_grad()
def bn_population_error(model: nn.Module, inputs) -> dict[str, float]:
    """How far each BatchNorm layer's running statistics are from the population statistics of the final
    weights, recomputed in one pass over `inputs` (batches of the training inputs) with a cumulative average, as
    torch.optim.swa_utils.update_bn does. `bn_mean_error`: mean over channels and layers of
    |running mean - population mean| / population std; `bn_var_error`: mean of |ln(running var / population
    var)|. What a momentum rule changes shows here, not in final accuracy. The model is left as it was. (A layer
    without running statistics normalizes by its batch's in evaluation too: nothing to compare.)"""
    layers = [layer for layer in batchnorm_layers(model) if layer.running_mean is not None]
    if not layers:
        return {}
    saved = [(layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone(),
              layer.momentum) for layer in layers]
    was_training = model.training
    for layer in layers:
        layer.reset_running_stats()
        layer.momentum = None  # a cumulative average over the pass
    model.train()
    for xs in inputs:
        forward(model, xs)
    mean_errors, var_errors = [], []
    for layer, (mean, var, count, momentum) in zip(layers, saved):
        pop_mean, pop_var = layer.running_mean.double(), layer.running_var.double().clamp_min(layer.eps)
        mean_errors.append(((mean.double() - pop_mean).abs() / pop_var.sqrt()).mean())
        var_errors.append((var.double().clamp_min(layer.eps) / pop_var).log().abs().mean())
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
        layer.num_batches_tracked.copy_(count)
        layer.momentum = momentum
    model.train(was_training)
    return {"bn_mean_error": torch.stack(mean_errors).mean().item(),
            "bn_var_error": torch.stack(var_errors).mean().item()}


def has_conv2d(model: nn.Module) -> bool:
    """channels_last applies only to nets with 2-D convolutions."""
    return any(isinstance(m, nn.Conv2d) for m in model.modules())
