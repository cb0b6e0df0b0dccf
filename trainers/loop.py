"""Train one configuration with exact gradient accumulation, and measure it.

Read from the top: the window step (one optimizer step over k micro-batches, nanoGPT's accumulation loop), then
`train`: the setup of one run as one straight path (`set_up`: checkpoint, device, data and model, optimizer,
ranks, loss, probes, feed, resume), the epochs that call the step, the end of an epoch and of the run; last, the
schedule. How the parts are built (device, data, model, optimizer) is trainers/build.py."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .batches import forward
from .build import device_name, make_optimizer, memory_source, optimizer_groups, prepare
from .checkpoint import Checkpointer, Checkpointing, Progress, restore, rng_states
from .config import ADAM_RULES, TrainConfig
from .data import Data
from .distributed import NO_CONTEXT, OneProcess, launched_rank, setup
from .evaluation import evaluate, load_metrics
from .feed import Feed, Window
from .health import coverage_warnings, verdict
from .interrupt import check as check_interrupt
from .losses import Loss, load_loss
from .models import bn_population_error, set_bn_momentum
from .order import steps_per_epoch
from .probes import LossTerms, Micro, Probe, Probes, Run
from .probes import diagnostics as builtin_diagnostics
from .shrink import Retry, at


@dataclass
class Trainee:
    """What the window step works on: a model and what steps it (each member of a fused group has its own, whose
    windows end in `end_window`)."""

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
    run = set_up(config, data, [*(builtin_diagnostics() if diagnostics else []), *probes], checkpoint, no_sync)
    finished = False
    try:
        _epochs(run, on_epoch)
        trained = result(run)
        finished = True
        return trained
    finally:
        if run.checkpointer:  # stopped by on_epoch (pruned, say): the last write lands before anyone reads or removes it
            run.checkpointer.join()
        run.t.parallel.close(finished)


@dataclass
class Setup:
    """One run, set up: what its epochs, their ends and its result work on."""

    config: TrainConfig
    t: Trainee
    model: nn.Module  # the model itself (t.net may be its DDP wrapper)
    data: Data  # on the device
    device: torch.device
    feed: Feed
    measure: Callable[[], dict[str, float]]  # the evaluation on the test set
    progress: Progress
    notes: list[str]
    checkpointer: Checkpointer | None
    resumed_after: int  # the epoch of the checkpoint it resumed from (0: it did not)


def set_up(config: TrainConfig, data: Data | None, probes: list[Probe], checkpoint: Checkpointing | None,
           no_sync: bool = True) -> Setup:
    """The setup of one run, one straight path in the order it needs it: the checkpoint, the device, data and
    model, the optimizer, the ranks, the loss, the probes, the feed, the resume and the retry path. `probes`:
    every probe beside the loss terms, the diagnostics included."""
    checkpointer = Checkpointer(checkpoint, config, writes=launched_rank() == 0) if checkpoint else None
    # Read before preparing the data (a checkpoint of another configuration is refused at once); under torchrun,
    # once every rank has arrived (rank 0's last write, of a run before in this process, has landed).
    saved = checkpointer.load() if checkpointer and config.world_size == 1 else None
    prepared = prepare(config, data)
    model = net = prepared.model
    model.train()
    # Before DDP wraps the model, as nanoGPT does (--sync-bn's SyncBatchNorm layers keep these same parameters).
    optimizer = make_optimizer(config, optimizer_groups(model))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    parallel = setup(config, prepared.device)
    if checkpointer and parallel.world > 1:
        saved = checkpointer.load()
    try:
        if parallel.world > 1:
            net = parallel.wrap(model, prepared.device, no_sync)
            model = net.module  # (with --sync-bn, its BatchNorm layers are now SyncBatchNorm)
        loss = load_loss(config.loss, model)
        probes = Probes(LossTerms(), probes)
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
        retry = Retry(model, config, optimizer, probes, progress)
        device_type = prepared.device.type
        # (a disabled torch.autocast still costs about 4 µs a micro-batch: none in fp32)
        amp = (lambda: torch.autocast(device_type, torch.bfloat16)) if config.precision == "bf16" else lambda: NO_CONTEXT
        t = Trainee(net, loss, optimizer, params, config.grad_clip, amp, parallel, probes, retry, b)
        measure = lambda: evaluate(model, feed.test(), loss, config.precision, metrics)
        return Setup(config, t, model, prepared.data, prepared.device, feed, measure, progress, notes, checkpointer,
                     progress.epoch)
    except BaseException:
        parallel.close(False)
        raise


def _epochs(run: Setup, on_epoch: EpochCallback | None) -> None:
    """The epochs not run yet: each window one `window_step` at the schedule's LR, then the epoch's row."""
    config, t, progress = run.config, run.t, run.progress
    for row in replayed(progress) if on_epoch is not None else ():
        on_epoch(row)
    configs, steps, warmup = plan(config, run.data.n_train)
    total_steps, step, lr = sum(steps), progress.step, config.lr
    for epoch in range(progress.epoch + 1, config.epochs + 1):
        if progress.finished:
            break
        now = _settle(config, t, run.model, configs[epoch - 1])
        start, samples, evaluating = time.perf_counter(), 0, 0.0
        synced = (t.parallel.all_reduces.calls, t.parallel.all_reduces.bytes)
        for window in run.feed.epoch(epoch, now):
            lr = lr_at(now, step, total_steps, warmup)
            window_step(t, window, step, lr)
            step, samples = step + 1, samples + window.size
            if config.eval_every_steps and step % config.eval_every_steps == 0:
                evaluating += _evaluate_at(run.measure, progress, step, progress.samples + samples, on_epoch)
            check_interrupt()
            if step == config.max_steps:
                break
        row = end_epoch(run, epoch, step, lr, samples, start, evaluating, synced)
        save(run)
        if on_epoch is not None:
            on_epoch(row)
    if run.checkpointer:
        run.checkpointer.wait()


def plan(config: TrainConfig, n: int) -> tuple[list[TrainConfig], list[int], int]:
    """Each epoch's configuration (one unless batch_warmup), its optimizer steps over n samples, and the
    warmup's steps: what the schedule reads."""
    configs = [config.at_epoch(epoch) for epoch in range(1, config.epochs + 1)]
    steps = [steps_per_epoch(now, n) for now in configs]
    return configs, steps, warmup_steps(config, steps)


def replayed(progress: Progress) -> list[dict[str, float]]:
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


def end_epoch(run: Setup, epoch: int, step: int, lr: float, samples: int, start: float, evaluating: float,
              synced: tuple[int, int]) -> dict[str, float]:
    """The epoch's row (its one synchronization with the device), evaluated; the progress moves on. `evaluating`:
    the seconds of the evaluations within it (not training time); `synced`: the all-reduce counters at its start."""
    config, t, progress = run.config, run.t, run.progress
    row = {"epoch": epoch, **t.probes.terms.epoch_end(epoch)}
    elapsed = time.perf_counter() - start - evaluating  # (after the synchronization: every kernel has run)
    if math.isfinite(row["train_loss"]):
        row.update(run.measure())
    else:
        progress.status = "diverged"
        row.update(val_loss=math.nan, val_acc=math.nan)
    epoch_time = time.perf_counter() - start
    row.update(current_lr=lr, steps=step, samples=progress.samples + samples, epoch_time_s=epoch_time,
               samples_per_s=samples / elapsed)
    if run.data.classification and run.data.y_test.dim() == 2:  # tokens
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


def save(run: Setup, checkpointer: Checkpointer | None = None) -> None:
    """The epoch's checkpoint, when one is due (by rank 0's clock under torchrun, with every rank's RNG states),
    by the run's checkpointer, or by `checkpointer` (a configuration that a fused member trains for it)."""
    t, checkpointer = run.t, checkpointer or run.checkpointer
    if checkpointer and t.parallel.rank0(checkpointer.due(run.progress)):
        checkpointer.save(run.progress, run.model, t.optimizer, t.probes, t.parallel.every_rank(rng_states()))


def result(run: Setup) -> TrainResult:
    config, data, progress, history = run.config, run.data, run.progress, run.progress.history
    metrics = {**history[-1], "samples_per_s": progress.samples / progress.train_time,
               "wall_time_s": progress.wall_time}
    if config.shrink_on_oom:
        metrics["physical_batch_used"] = run.t.b
    if "peak_memory_bytes" in metrics:
        metrics["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in history)
    if progress.status == "ok":
        metrics.update(bn_population_error(run.model, run.feed.inputs(config.eval_batch)))
    health, health_epoch = verdict(progress.status, history, data.chance,
                                   data.num_classes if data.classification else None)
    dataset = {"name": config.dataset, "digest": data.digest, "train_size": data.n_train,
               "test_size": data.n_test}
    return TrainResult(config=config, status=progress.status, metrics=metrics, history=history, model=run.model,
                       device_name=device_name(run.device), dataset=dataset,
                       memory_source=memory_source(run.device),
                       warnings=run.notes + run.t.probes.notes(), health=health, health_epoch=health_epoch,
                       resumed_after=run.resumed_after)


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
