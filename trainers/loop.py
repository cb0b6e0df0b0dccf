"""Train one configuration with exact gradient accumulation, and measure it."""
from __future__ import annotations

import math
import platform
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, TrainConfig
from .data import Data, load_data
from .health import StepStats, coverage_warnings, never_updated, verdict
from .noise import NoiseScale
from .models import bn_population_error, build_model, has_conv2d, set_bn_momentum, use_ghost_batch

EpochCallback = Callable[[dict[str, float]], None]


@dataclass
class TrainResult:
    config: TrainConfig
    status: str  # "ok" or "diverged" (a non-finite training loss)
    metrics: dict[str, float]  # final values
    history: list[dict[str, float]]  # one dict per epoch
    model: nn.Module
    device_name: str
    memory_source: str  # "cuda_allocator" or "saved_tensors"; see peak memory in the README
    warnings: list[str] = field(default_factory=list)
    health: str = "ok"  # ok, diverged, exploding, dead or stalled: see trainers/health.py
    health_epoch: int | None = None  # the first epoch where it showed
    dataset: dict[str, Any] = field(default_factory=dict)  # name, digest, train_size, test_size

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "health": self.health, "health_epoch": self.health_epoch,
                "config": self.config.to_dict(), "metrics": self.metrics, "history": self.history,
                "device_name": self.device_name, "memory_source": self.memory_source, "warnings": self.warnings}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' is not available on this machine: use --device cpu or auto")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def lr_at(config: TrainConfig, step: int, total_steps: int, steps_per_epoch: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to config.lr, then constant or cosine."""
    warmup = round(config.warmup_epochs * steps_per_epoch)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(total_steps - warmup, 1)))
    return config.lr


def permutation(config: TrainConfig, epoch: int, n: int, device: torch.device) -> torch.Tensor:
    """Sample order of an epoch; it depends on seed and epoch only, never on b or k."""
    if not config.shuffle:
        return torch.arange(n, device=device)
    generator = torch.Generator().manual_seed(config.seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).to(device)


def windows(order: torch.Tensor, config: TrainConfig) -> list[torch.Tensor]:
    """Cut an epoch's order into windows of B samples, one optimizer step each."""
    parts = list(order.split(config.effective_batch))
    if config.drop_last and len(parts[-1]) < config.effective_batch:
        parts.pop()
    return parts


def sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed per-sample loss: cross-entropy for class labels, squared error for float targets."""
    if target.is_floating_point():
        return (out - target.view_as(out)).pow(2).sum()
    return F.cross_entropy(out, target, reduction="sum")


class SavedTensorBytes:
    """Peak bytes of the storages autograd holds for backward, counted while they are alive, parameters
    excluded (counted apart). A loop that kept earlier micro-batches' graphs alive would show here."""

    def __init__(self, model: nn.Module):
        self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors using it]
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.skip:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)  # runs when autograd lets go of this saved tensor
        return t

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients and the optimizer state, in bytes."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if torch.is_tensor(v))
    return params + grads + state


@torch.inference_mode()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int,
             precision: str = "fp32") -> tuple[float, float]:
    """Mean loss and accuracy (NaN for float targets) in eval mode; restores the previous mode."""
    was_training = model.training
    model.eval()
    loss = torch.zeros((), device=x.device, dtype=torch.float64)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for xs, ys in zip(x.split(batch), y.split(batch)):
        with torch.autocast(x.device.type, torch.bfloat16, enabled=precision == "bf16"):
            out = model(xs)
            loss += sum_loss(out, ys)
        if not ys.is_floating_point():
            correct += (out.argmax(1) == ys).sum()
    model.train(was_training)
    n = len(y)
    return loss.item() / n, (correct.item() / n if not y.is_floating_point() else math.nan)


def optimizer_groups(model: nn.Module) -> list:
    """The model's own `param_groups()` when it defines one (e.g. no weight decay on biases), else every
    parameter that requires a gradient."""
    if callable(getattr(model, "param_groups", None)):
        return list(model.param_groups())
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(config: TrainConfig, params: list) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov,
                           weight_decay=config.weight_decay)


def _prepare(config: TrainConfig) -> tuple[torch.device, Data, nn.Module, list[str]]:
    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype)
    data = load_data(config.dataset, config.data_dir, config.seed).with_digest()
    n = len(data.x_train)
    if config.effective_batch > n:
        raise ConfigError(f"effective batch {config.effective_batch} (physical_batch {config.physical_batch} x "
                          f"accum_steps {config.accum_steps}) is larger than the training set ({n} samples): "
                          f"lower --physical-batch or --accum-steps")
    torch.manual_seed(config.seed)  # same seed, same initial weights, whatever b and k are
    model = build_model(config.model, data.input_shape, data.num_classes, config.norm)
    notes = list(data.notes)
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
            data.x_train = data.x_train.contiguous(memory_format=torch.channels_last)
            data.x_test = data.x_test.contiguous(memory_format=torch.channels_last)
        else:
            notes.append("channels_last has no effect: the model has no 2-D convolution")
    return device, data, model, notes


def train(config: TrainConfig, on_epoch: EpochCallback | None = None) -> TrainResult:
    """Train `config`. `on_epoch(row)` is called after every epoch; an exception it raises stops the run."""
    device, data, model, notes = _prepare(config)
    model.train()
    optimizer = make_optimizer(config, optimizer_groups(model))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    notes += coverage_warnings(model, optimizer)
    stats = StepStats(params)
    # A sampled step's health statistics cost about a twelfth of a cnn1d micro-batch of 32 on a CPU: take them
    # every step from k = 16, every ceil(16/k)-th step below (the means stay unbiased), about 0.5% of the time.
    stats_every = math.ceil(16 / config.accum_steps)
    bf16 = config.precision == "bf16"
    b = config.physical_batch
    n_train = len(data.x_train)
    # The noise scale needs micro-batches and a window that differ: k >= 2.
    noise = NoiseScale(params, b, config.effective_batch, n_train) if config.accum_steps > 1 else None
    steps_per_epoch = len(windows(torch.arange(n_train), config))
    total_steps = steps_per_epoch * config.epochs
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    saved = SavedTensorBytes(model)
    static_bytes = 0
    history: list[dict[str, float]] = []
    status, step, train_time, wall_time, samples = "ok", 0, 0.0, 0.0, 0
    lr = config.lr

    for epoch in range(1, config.epochs + 1):
        start = time.perf_counter()
        loss_total = torch.zeros((), device=device, dtype=torch.float64)
        epoch_samples = 0
        for window in windows(permutation(config, epoch, n_train, device), config):
            lr = lr_at(config, step, total_steps, steps_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            n_window = len(window)
            # Every full window holds the same tensors: count them in the run's first window only (the
            # counting hooks cost a sixth of a micro-batch).
            measuring = step == 0 and not on_cuda
            sampled = step % stats_every == 0
            # The noise scale on every other diagnostics step, full windows only: it costs a flat copy of the
            # gradient and a norm per micro-batch.
            tracking_noise = noise is not None and step % (2 * stats_every) == 0 and n_window == config.effective_batch
            for idx in window.split(b):
                with saved.hooks() if measuring else nullcontext():
                    with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                        loss = sum_loss(model(data.x_train[idx]), data.y_train[idx])
                # Divide by the window's sample count, not by k: exact for short windows and micro-batches.
                (loss / n_window).backward()
                if tracking_noise:
                    noise.after_micro()
                loss_total += loss.detach()
            if sampled:
                stats.before_step()
            if tracking_noise:
                noise.step()
            if config.grad_clip:
                nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            if sampled:
                stats.after_step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            epoch_samples += n_window
            if step == config.max_steps:
                break
        train_loss = loss_total.item() / epoch_samples  # the epoch's one synchronization
        elapsed = time.perf_counter() - start
        train_time += elapsed
        samples += epoch_samples
        if not static_bytes:
            static_bytes = state_bytes(model, optimizer)
        if math.isfinite(train_loss):
            val_loss, val_acc = evaluate(model, data.x_test, data.y_test, config.eval_batch, config.precision)
        else:
            status, val_loss, val_acc = "diverged", math.nan, math.nan
        epoch_time = time.perf_counter() - start
        wall_time += epoch_time
        peak = torch.cuda.max_memory_allocated(device) if on_cuda else saved.peak + static_bytes
        row = {"epoch": epoch, "train_loss": train_loss, "val_loss": val_loss, "val_acc": val_acc,
               "current_lr": lr, "steps": step, "epoch_time_s": epoch_time, "samples_per_s": epoch_samples / elapsed,
               "peak_memory_bytes": float(peak), **stats.epoch()}
        scale = noise.value() if noise is not None else None
        if scale is not None:  # not a number while |G|^2 is not measurable, nor for k = 1
            row["noise_scale"], row["noise_scale_reliable"] = scale[0], float(scale[1])
        history.append(row)
        if on_epoch is not None:
            on_epoch(row)
        if status == "diverged" or step == config.max_steps:
            break

    metrics = {**history[-1], "samples_per_s": samples / train_time, "wall_time_s": wall_time,
               "peak_memory_bytes": max(r["peak_memory_bytes"] for r in history)}
    if status == "ok":
        metrics.update(bn_population_error(model, data.x_train, config.eval_batch))
    idle = never_updated(model, stats)
    if idle:
        notes.append(idle)
    health, health_epoch = verdict(status, history, data.chance, data.num_classes if data.classification else None)
    dataset = {"name": config.dataset, "digest": data.digest, "train_size": n_train, "test_size": len(data.x_test)}
    return TrainResult(config=config, status=status, metrics=metrics, history=history, model=model,
                       device_name=device_name(device), dataset=dataset,
                       memory_source="cuda_allocator" if on_cuda else "saved_tensors", warnings=notes,
                       health=health, health_epoch=health_epoch)
