"""A run's parts, built the same way for every (b, k): the device, the data on it and the model (`prepare`), the
optimizer; and what a study checks once before its first run (`preflight`, `load`)."""
from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .config import TrainConfig
from .data import Data, load_data
from .distributed import local_device
from .errors import BatchsweepError, ConfigError, DataError
from .evaluation import load_metrics
from .imports import load_factory
from .models import MODELS, build_model, check_inputs, has_conv2d, set_bn_momentum, use_ghost_batch


@dataclass
class Prepared:
    """A configuration's device, data (on the device) and model, built the same way for every (b, k)."""

    device: torch.device
    data: Data
    model: nn.Module
    notes: list[str]


def prepare(config: TrainConfig, data: Data | None = None) -> Prepared:
    """`data`: what `load(config)` gave for this dataset and seed, reused (none: it is loaded here)."""
    device = local_device(resolve_device(config.device))
    dtype = getattr(torch, config.dtype)
    data = (data or load_data(config.dataset, config.data_dir, config.seed, config.label_key)).with_digest()
    n = data.n_train
    if config.effective_batch > n:
        ranks = f" x world_size {config.world_size}" if config.world_size > 1 else ""
        raise ConfigError(f"effective batch {config.effective_batch} (physical_batch {config.physical_batch} x "
                          f"accum_steps {config.accum_steps}{ranks}) is larger than the training set ({n} samples)",
                          "lower --physical-batch, --accum-steps or --effective-batch")
    torch.manual_seed(config.seed)  # same seed, same initial weights, whatever b and k are
    example = data.example(1)
    check_inputs(config.model, config.dataset, example)
    model = build_model(config.model, data.input_shape, data.num_classes, config.norm)
    notes = list(data.notes)
    if config.label_key != TrainConfig.label_key and not isinstance(example, Mapping):
        notes.append(f"label_key={config.label_key!r} has no effect: the samples of {config.dataset!r} are "
                     f"(input, target) pairs, not mappings")
    bn_layers = set_bn_momentum(model, config.bn_momentum)
    if bn_layers == 0 and config.bn_momentum_rule != "default":
        notes.append(f"bn_momentum_rule={config.bn_momentum_rule!r} has no effect: model {config.model!r} "
                     f"has no BatchNorm layer")
    if config.ghost_batch and not use_ghost_batch(model, config.ghost_batch):
        notes.append(f"ghost_batch has no effect: model {config.model!r} has no BatchNorm layer")
    model = model.to(device, dtype)
    data = data.to(device, dtype)
    if config.channels_last:
        if has_conv2d(model):
            model = model.to(memory_format=torch.channels_last)
            if data.x_train is not None:
                data.x_train = data.x_train.contiguous(memory_format=torch.channels_last)
            if data.x_test is not None:
                data.x_test = data.x_test.contiguous(memory_format=torch.channels_last)
        else:
            notes.append("channels_last has no effect: the model has no 2-D convolution")
    return Prepared(device, data, model, notes)


def preflight(config: TrainConfig) -> Data | None:
    """What would make every trial of a study fail alike, checked once before it starts: its device is on this
    machine, each import path imports, and a built-in model can take the dataset's samples (the one check that
    loads the dataset; the data it loaded is returned, for a caller that needs it, and None otherwise)."""
    resolve_device(config.device)
    load_metrics(config.metrics)
    for path, what in ((config.model, "model"), (config.dataset, "dataset"), (config.loss, "loss")):
        if ":" in path and not path.startswith("hf:"):
            load_factory(path, what)
    if config.model not in MODELS:
        return None
    data = load(config)
    check_inputs(config.model, config.dataset, data.example(1))
    return data


def load(config: TrainConfig) -> Data:
    """The config's data, as a trial loads it, for several `train(..., data=)` of the same dataset and seed (a
    user's factory may tokenize for minutes); a factory that raises is one line, as a trial would record it."""
    try:
        return load_data(config.dataset, config.data_dir, config.seed, config.label_key)
    except BatchsweepError:
        raise
    except Exception as exc:  # the user's factory: one line, as a trial would record it
        raise DataError(f"dataset {config.dataset!r} raised {type(exc).__name__}: {exc}") from None


def optimizer_groups(model: nn.Module) -> list:
    """The model's own `param_groups()` when it defines one (e.g. no weight decay on biases), else every
    parameter that requires a gradient."""
    if callable(getattr(model, "param_groups", None)):
        return list(model.param_groups())
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(config: TrainConfig, params: list) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                 weight_decay=config.decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                           weight_decay=config.weight_decay)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' is not available on this machine: use --device cpu or auto")
    return torch.device(name)


def memory_source(device: torch.device) -> str:
    """What peak_memory_bytes measures on this device: the CUDA allocator's peak, or the bytes saved for backward."""
    return "cuda_allocator" if device.type == "cuda" else "saved_tensors"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return f"cpu ({platform.machine()}, {threads} thread{'s' * (threads != 1)})"
