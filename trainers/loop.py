"""Train one configuration with exact gradient accumulation, and measure it.

Read from the top: the window step (one optimizer step over k micro-batches, nanoGPT's accumulation loop), then
`train`, the setup of one run as one straight path (checkpoint, device, data and model, ranks, optimizer, loss,
probes, feed, resume), the epochs that call the step, the end of an epoch and of the run; last, the helpers
that the benchmarks and the sweeps also call (prepare, preflight, the schedule, the optimizer)."""
from __future__ import annotations

import math
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .batches import forward
from .checkpoint import Checkpointer, Checkpointing, Progress, restore, rng_states
from .config import ADAM_RULES, TrainConfig
from .data import Data, load_data
from .distributed import NO_CONTEXT, OneProcess, launched_rank, local_device, setup
from .errors import BatchsweepError, ConfigError, DataError
from .evaluation import evaluate, load_metrics
from .feed import Feed, Window
from .health import coverage_warnings, verdict
from .imports import load_factory
from .interrupt import check as check_interrupt
from .losses import Loss, load_loss
from .models import (MODELS, bn_population_error, build_model, check_inputs, has_conv2d, set_bn_momentum,
                     use_ghost_batch)
from .probes import LossTerms, Micro, Probe, Probes, Run
from .probes import diagnostics as builtin_diagnostics
from .shrink import Retry, at


@dataclass
class Trainee:
    """What the window step works on: a model and what steps it (fused trials will give it a stack of members)."""

    net: nn.Module  # what the forward calls: the model, or its DistributedDataParallel wrapper
    loss: Loss
    optimizer: torch.optim.Optimizer
    params: list  # every parameter the optimizer steps
    clip: float  # the gradient norm to clip to (0: none)
    amp: Callable[[], Any]  # the autocast context of the precision, or none
    parallel: OneProcess  # this rank's no_sync and all-reduces (nothing to do for one process)
    probes: Probes
    retry: Retry  # with shrink_on_oom, a micro-batch out of memory runs the window again at a smaller b
    b: int  # the micro-batch size in use


def window_step(t: Trainee, window: Window, step: int, lr: float) -> None:
    """One optimizer step over one window, as nanoGPT accumulates: the micro-batches' gradients add up, each
    loss term divided by its count over the whole window (never by k), so that the step takes the gradient of
    the window's mean whatever b, k, padding or ranks. A loss without counts() backwards its sums, divided here
    by the count they gave. Under DDP the gradients are all-reduced once, at the last micro-batch."""
    for group in t.optimizer.param_groups:  # the schedule
        group["lr"] = lr
    while True:  # the one retry path
        t.retry.mark()
        try:
            last, counted = window.parts(t.b) - 1, 0
            for i, (x, y) in enumerate(window.cut(t.b)):
                with t.parallel.micro(i == last):  # the rank's no_sync, but at the last micro-batch
                    with t.probes.forward(step), t.amp():
                        terms = t.loss.terms(forward(t.net, x), y)
                    t.parallel.backward(t.loss.share(terms, window.counts))
                if t.loss.divide_after:  # (its terms count alike: the first term's count is the window's)
                    counted = counted + next(iter(terms.values()))[1]
                t.probes.after_micro(Micro(step, window.size, x, y, terms))
            break
        except torch.OutOfMemoryError:  # without shrink_on_oom, raised as it is
            failed, b = t.b, t.retry.smaller(t.b)
        t.b = t.retry.again(failed, b, step)  # out of the handler: the failed micro-batch's memory is let go
    end_window(t, step, window.size, counted)


def end_window(t: Trainee, step: int, size: int, counted: Any) -> None:
    """A window's gradient in place: divide by its count (a loss without counts()), clip where asked, step once,
    zero once."""
    if t.loss.divide_after:
        divide(t.params, counted, t.parallel)
    t.probes.before_step(step, size)
    if t.clip:
        nn.utils.clip_grad_norm_(t.params, t.clip)
    t.optimizer.step()
    t.probes.after_step(step)
    t.optimizer.zero_grad(set_to_none=True)  # zero once: let go until the next window's first backward


def divide(params: list, count: Any, parallel: OneProcess) -> None:
    """The window's summed gradients divided by the items its micro-batches counted (over every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    count = parallel.sum_counts(count, grads[0].device)
    torch._foreach_div_(grads, torch.as_tensor(count, dtype=grads[0].dtype, device=grads[0].device))


EpochCallback = Callable[[dict[str, float]], None]
# Every metric a run of `train` can log (each epoch's row and the final metrics), so that a study that names
# another is refused before anything runs; a loss with named terms adds `loss/<name>` for each, and the
# config's own metric functions `val_<name>` for each of their terms.
METRICS = ("epoch", "steps", "samples", "train_loss", "val_loss", "val_acc", "val_top5", "val_perplexity", "current_lr",
           "epoch_time_s", "grad_norm", "update_ratio", "dead_fraction", "noise_scale", "noise_scale_reliable", "peak_memory_bytes",
           "bn_mean_error", "bn_var_error", "samples_per_s", "wall_time_s", "physical_batch_used", "oom_retries",
           "oom_physical_batch", "allreduce_calls", "allreduce_bytes")


@dataclass
class TrainResult:
    config: TrainConfig
    status: str  # "ok" or "diverged" (a non-finite training loss)
    metrics: dict[str, float]  # final values
    history: list[dict[str, float]]  # one dict per epoch
    model: nn.Module
    device_name: str
    memory_source: str  # "cuda_allocator" or "saved_tensors" (docs/trainer.md: peak memory)
    warnings: list[str] = field(default_factory=list)
    health: str = "ok"  # ok, diverged, exploding, dead or stalled: see trainers/health.py
    health_epoch: int | None = None  # the first epoch where it showed
    dataset: dict[str, Any] = field(default_factory=dict)  # name, digest, train_size, test_size
    resumed_after: int = 0  # the epoch of the checkpoint it resumed from (0: it did not)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "health": self.health, "health_epoch": self.health_epoch,
                "config": self.config.to_dict(), "metrics": self.metrics, "history": self.history,
                "device_name": self.device_name, "memory_source": self.memory_source, "warnings": self.warnings,
                "dataset": self.dataset, "resumed_after": self.resumed_after}


def train(config: TrainConfig, on_epoch: EpochCallback | None = None, probes: list[Probe] = (),
          diagnostics: bool = True, checkpoint: Checkpointing | None = None, no_sync: bool = True,
          data: Data | None = None) -> TrainResult:
    """Train `config`. `on_epoch(row)` is called after every epoch; an exception it raises stops the run.
    `probes` are measured beside the built-in diagnostics (trainers/probes.py); `diagnostics=False` leaves
    those out (the loss terms are always accounted). With `checkpoint`, the run is saved at the end of its
    epochs and goes on from the last checkpoint in that folder; `on_epoch` then first sees the restored
    epochs' rows again, so that whoever records them has the whole history.

    Under torchrun (world_size > 1) every process trains its shard of each window, and the gradients are
    all-reduced once per window (trainers/distributed.py); `no_sync=False` all-reduces them after every
    micro-batch instead, a control that shows what that saves. Every rank returns the same result.

    `data` is what `load(config)` returned for the same dataset, data_dir, seed and label_key: runs that differ
    in anything else (b, k, the LR, the epochs) can share one load instead of calling the factory each."""
    checkpointer = Checkpointer(checkpoint, config, writes=launched_rank() == 0) if checkpoint else None
    # Read before preparing the data (a checkpoint of another configuration is refused at once); under torchrun,
    # once every rank has arrived (rank 0's last write, of a run before in this process, has landed).
    saved = checkpointer.load() if checkpointer and config.world_size == 1 else None
    prepared = prepare(config, data)  # the device, the data on it, the model
    parallel = setup(config, prepared.device)
    if checkpointer and parallel.world > 1:
        saved = checkpointer.load()
    finished = False
    try:
        result = _run(config, prepared, parallel, on_epoch, list(probes), diagnostics, checkpointer, saved, no_sync)
        finished = True
        return result
    finally:
        if checkpointer:  # stopped by on_epoch (pruned, say): the last write lands before anyone reads or removes it
            checkpointer.join()
        parallel.close(finished)


def _run(config: TrainConfig, prepared: Prepared, parallel: OneProcess, on_epoch: EpochCallback | None,
         probes: list[Probe], diagnostics: bool, checkpointer: Checkpointer | None, saved: dict | None,
         no_sync: bool) -> TrainResult:
    """The rest of the setup, in the order the run needs it, then its epochs and its result."""
    model = net = prepared.model
    model.train()
    if parallel.world > 1:
        net = parallel.wrap(model, prepared.device, no_sync)
        model = net.module  # (with --sync-bn, its BatchNorm layers are now SyncBatchNorm)
    optimizer = make_optimizer(config, optimizer_groups(model))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss = load_loss(config.loss, model)
    probes = Probes(LossTerms(), [*(builtin_diagnostics() if diagnostics else []), *probes])
    probes.start(Run(config, model, optimizer, params, prepared.device, prepared.data.n_train,
                     parallel if parallel.world > 1 else None, loss.divide_after))
    metrics = load_metrics(config.metrics)
    feed = Feed(prepared.data, config, prepared.device, loss, parallel)
    notes = prepared.notes + coverage_warnings(model, optimizer)
    progress = Progress()
    if saved:  # the run goes on after its last finished epoch, at the b it had reached
        progress = restore(saved, model, optimizer, probes, parallel.rank, checkpointer.spec.path)
    b = progress.physical_batch or config.physical_batch
    if b != config.physical_batch:  # resumed after shrinking
        set_bn_momentum(model, at(config, b).bn_momentum)
    device_type = prepared.device.type
    # (a disabled torch.autocast still costs about 4 µs a micro-batch: none in fp32)
    amp = (lambda: torch.autocast(device_type, torch.bfloat16)) if config.precision == "bf16" else lambda: NO_CONTEXT
    t = Trainee(net, loss, optimizer, params, config.grad_clip, amp, parallel, probes,
                Retry(model, config, optimizer, probes, progress), b)
    resumed_after = progress.epoch
    measure = lambda: evaluate(model, feed.test(), loss, config.precision, metrics)
    _epochs(config, t, model, prepared.data, feed, progress, measure, on_epoch, checkpointer)
    return _result(config, t, model, prepared.data, feed, progress, notes, prepared.device, resumed_after)


def _epochs(config: TrainConfig, t: Trainee, model: nn.Module, data: Data, feed: Feed, progress: Progress,
            measure: Callable[[], dict[str, float]], on_epoch: EpochCallback | None,
            checkpointer: Checkpointer | None) -> None:
    """The epochs not run yet: each window one `window_step` at the schedule's LR, then the epoch's row."""
    for row in _replayed(progress) if on_epoch is not None else ():
        on_epoch(row)
    plan = [config.at_epoch(epoch) for epoch in range(1, config.epochs + 1)]  # one config unless batch_warmup
    steps = [feed.steps_per_epoch(now) for now in plan]
    total_steps, warmup, step, lr = sum(steps), warmup_steps(config, steps), progress.step, config.lr
    for epoch in range(progress.epoch + 1, config.epochs + 1):
        if progress.finished:
            break
        now = _settle(config, t, model, plan[epoch - 1])
        start, samples, evaluating = time.perf_counter(), 0, 0.0
        synced = (t.parallel.all_reduces.calls, t.parallel.all_reduces.bytes)
        for window in feed.epoch(epoch, now):
            lr = lr_at(now, step, total_steps, warmup)
            window_step(t, window, step, lr)
            step, samples = step + 1, samples + window.size
            if config.eval_every_steps and step % config.eval_every_steps == 0:
                evaluating += _evaluate_at(measure, progress, step, progress.samples + samples, on_epoch)
            check_interrupt()
            if step == config.max_steps:
                break
        row = _end_epoch(config, t, data, progress, measure, epoch, step, lr, samples, start, evaluating, synced)
        _save(t, model, progress, checkpointer)
        if on_epoch is not None:
            on_epoch(row)
    if checkpointer:
        checkpointer.wait()


def _replayed(progress: Progress) -> list[dict[str, float]]:
    """A resumed run's rows so far, in the order they came: each epoch's after the evaluations within it."""
    return sorted(progress.history + progress.evals, key=lambda row: (row.get("steps", row.get("step")),
                                                                      "epoch" in row))


def _settle(config: TrainConfig, t: Trainee, model: nn.Module, now: TrainConfig) -> TrainConfig:
    """An epoch's configuration in place: under batch_warmup its b, BatchNorm's momentum and AdamW's rules
    follow the epoch's B (the learning rate follows it through lr_at)."""
    if now is config and not config.batch_warmup:
        return now
    if not config.shrink_on_oom:
        t.b = now.physical_batch
    set_bn_momentum(model, now.bn_momentum)
    for group in t.optimizer.param_groups:
        if now.lr_rule in ADAM_RULES:
            group.update(betas=(now.beta1, now.beta2), eps=now.eps)
        if now.wd_rule == "timescale" and group["weight_decay"]:  # (a group of no decay keeps none)
            group["weight_decay"] = now.decay
    return now


def _evaluate_at(measure: Callable[[], dict[str, float]], progress: Progress, step: int, samples: int,
                 on_epoch: EpochCallback | None) -> float:
    """An evaluation within the epoch (eval_every_steps), kept by step as step_val_* (and the samples trained
    so far as step_samples); returns its time, which is not training time."""
    start = time.perf_counter()
    row = {"step": step, "step_samples": samples, **{f"step_{name}": value for name, value in measure().items()}}
    progress.evals.append(row)
    if on_epoch is not None:
        on_epoch(row)
    return time.perf_counter() - start


def _end_epoch(config: TrainConfig, t: Trainee, data: Data, progress: Progress,
               measure: Callable[[], dict[str, float]], epoch: int, step: int, lr: float, samples: int,
               start: float, evaluating: float, synced: tuple[int, int]) -> dict[str, float]:
    """The epoch's row (its one synchronization with the device), evaluated; the progress moves on. `evaluating`:
    the seconds of the evaluations within it (not training time); `synced`: the all-reduce counters at its start."""
    row = {"epoch": epoch, **t.probes.terms.epoch_end(epoch)}
    elapsed = time.perf_counter() - start - evaluating  # (after the synchronization: every kernel has run)
    if math.isfinite(row["train_loss"]):
        row.update(measure())
    else:
        progress.status = "diverged"
        row.update(val_loss=math.nan, val_acc=math.nan)
    epoch_time = time.perf_counter() - start
    row.update(current_lr=lr, steps=step, samples=progress.samples + samples, epoch_time_s=epoch_time,
               samples_per_s=samples / elapsed)
    if data.classification and data.y_test.dim() == 2:  # tokens
        val_loss = row["val_loss"]
        row["val_perplexity"] = math.exp(min(val_loss, 700.0)) if math.isfinite(val_loss) else math.nan
    if config.shrink_on_oom:  # how often a micro-batch ran out of memory, and the smallest b that did
        row.update(oom_retries=progress.oom_retries, oom_physical_batch=progress.oom_batch or math.nan)
    if t.parallel.world > 1:  # the epoch's gradient all-reduces
        row.update(allreduce_calls=t.parallel.all_reduces.calls - synced[0],
                   allreduce_bytes=t.parallel.all_reduces.bytes - synced[1])
    row.update(t.probes.epoch_end(epoch))
    progress.history.append(row)
    progress.epoch, progress.step = epoch, step
    progress.train_time += elapsed
    progress.wall_time += epoch_time
    progress.samples += samples
    progress.finished = progress.status == "diverged" or step == config.max_steps or epoch == config.epochs
    return row


def _save(t: Trainee, model: nn.Module, progress: Progress, checkpointer: Checkpointer | None) -> None:
    """The epoch's checkpoint, when one is due (by rank 0's clock under torchrun, with every rank's RNG states)."""
    if checkpointer and t.parallel.rank0(checkpointer.due(progress)):
        checkpointer.save(progress, model, t.optimizer, t.probes, t.parallel.every_rank(rng_states()))


def _result(config: TrainConfig, t: Trainee, model: nn.Module, data: Data, feed: Feed, progress: Progress,
            notes: list[str], device: torch.device, resumed_after: int) -> TrainResult:
    history = progress.history
    metrics = {**history[-1], "samples_per_s": progress.samples / progress.train_time,
               "wall_time_s": progress.wall_time}
    if config.shrink_on_oom:
        metrics["physical_batch_used"] = t.b
    if "peak_memory_bytes" in metrics:
        metrics["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in history)
    if progress.status == "ok":
        metrics.update(bn_population_error(model, feed.inputs(config.eval_batch)))
    health, health_epoch = verdict(progress.status, history, data.chance,
                                   data.num_classes if data.classification else None)
    dataset = {"name": config.dataset, "digest": data.digest, "train_size": data.n_train,
               "test_size": data.n_test}
    return TrainResult(config=config, status=progress.status, metrics=metrics, history=history, model=model,
                       device_name=device_name(device), dataset=dataset,
                       memory_source=memory_source(device),
                       warnings=notes + t.probes.notes(), health=health, health_epoch=health_epoch,
                       resumed_after=resumed_after)


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


def lr_at(config: TrainConfig, step: int, total_steps: int, warmup_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to config.lr, then constant or cosine."""
    if step < warmup_steps:
        return config.lr * (step + 1) / warmup_steps
    if config.schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / max(total_steps - warmup_steps, 1)))
    return config.lr


def warmup_steps(config: TrainConfig, steps: list[int]) -> int:
    """The optimizer steps of the first warmup_epochs epochs (`steps`: each epoch's), a fraction of the last."""
    return round(sum(min(max(config.warmup_epochs - i, 0.0), 1.0) * n for i, n in enumerate(steps)))


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
