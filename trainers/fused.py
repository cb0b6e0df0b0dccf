"""Configurations that see the same micro-batches, trained as one: a forward and a backward per micro-batch for
all of them, each stepping at its own window's end.

The order of an epoch depends on the seed only (trainers/order.py), so configurations that share the model,
the data, b, the seed and the epochs feed the same micro-batches in the same order, whatever their k. Such
members may differ in k, the LR rule and base LR, warmup and schedule, weight decay and the optimizer's
settings. Each keeps its own parameters and its own torch.optim optimizer, the solo run's, stepped when its
window of k micro-batches ends, at its own schedule's LR: the members whose windows end at the same micro-batch
in one foreach update where their settings agree, into each one's own optimizer state (trainers/together.py).
The forward runs once for all members over their stacked parameters: as fused operators for an nn.Sequential
of known layers (trainers/stacked.py), otherwise through torch.func.vmap, BatchNorm as one batch_norm over their
channels side by side (trainers/stacked_norm.py); one backward of the members' summed
window shares gives each member exactly its own gradient (a sum's gradient is each term's). BatchNorm's
running statistics live in stacked buffers that each member's model views, so a member's evaluation is its
solo evaluation.

Configurations that train exactly alike (k = 1 under the linear or sqrt rule at B = base_batch is the none rule's
run: the same LR at every step) are one member, trained once; each keeps its own result, rows and checkpoints.
What can change a member's forward or its micro-batches is refused (`alone`); a forward that draws random
numbers (dropout) is refused at its first micro-batch, before any step (`NotFusable`), since a stacked forward
cannot draw what each solo run would."""
from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .build import load, resolve_device
from .checkpoint import Checkpointer, Checkpointing
from .config import TrainConfig
from .data import Data
from .errors import ConfigError
from .feed import Feed, Window
from .interrupt import check as check_interrupt
from .loop import (EpochCallback, Setup, TrainResult, end_epoch, end_window, lr_at, plan, replayed, result, save, set_up,
                   window_step)
from .losses import add_counts
from .models import batchnorm_layers
from .probes import Health, Micro, Noise, PeakMemory, Probe
from .stacked import fused_forward
from .stacked_norm import side_by_side
from .together import batched, step_together

# What decides a member's micro-batches and its forward: equal in every member of a group.
SHARED = ("model", "dataset", "loss", "metrics", "label_key", "norm", "physical_batch", "seed", "epochs", "dtype",
          "device", "precision", "shuffle", "eval_batch", "data_dir", "bn_momentum")


# On the CPU, fusing pays where each member's micro-batch is small: there a solo run is mostly the framework's
# per-operation overhead, which one stacked operation shares. Where a member's forward saves more than this for
# backward, the stacked tensors outgrow the caches (and vmap's BatchNorm runs as several passes over them).
# Through vmap, cnn1d on MNIST-1D (2 epochs, one thread, 2-core CPU) ran 1.05-1.6x faster fused at b = 32 (0.4
# MiB saved, 15 members), 1.05-1.15x at b = 64 (0.8 MiB, 3), 0.8-0.9x at b = 128 (1.6 MiB, 3) and 0.55-0.9x at
# b = 256 and 512; gpt on pytext at b = 32 (19 MiB, 3 members, k = 1) 0.70x. As fused operators
# (trainers/stacked.py): 2.2x at b = 32 (15), 1.45x at 64, 1.21x at 128, 1.02x at 256, 0.89x at 512 (3 each;
# docs/results/2026-12-07-fused-operators.md). (With the diagnostics off nothing is measured: such a group is
# fused.)
CPU_SAVED_MOST = 2**20


class NotFusable(ConfigError):
    """These configurations cannot train as one: each is to train alone."""


def alone(config: TrainConfig) -> str | None:
    """Why `config` must train alone (None: it can be a member)."""
    reasons = [(config.world_size > 1, "it trains on several processes"),
               (config.shrink_on_oom, "shrink_on_oom may change its b mid-run"),
               (bool(config.batch_warmup), "batch_warmup changes its B by epoch"),
               (config.eval_every_steps > 0, "it evaluates within epochs"),
               (config.max_steps > 0, "it stops at max_steps"),
               (config.drop_last, "drop_last leaves out micro-batches that depend on k"),
               (config.ghost_batch > 0, "ghost_batch changes its forward"),
               (config.channels_last, "channels_last"),
               (config.precision != "fp32", "bf16 autocast")]
    return next((why for bad, why in reasons if bad), None)


def group_key(config: TrainConfig) -> tuple | None:
    """Configurations with the same key (not None) can train as one."""
    return None if alone(config) else tuple(getattr(config, name) for name in SHARED)


@dataclass
class Member:
    """One configuration of the group, set up as `train` sets up one process, and where it stands in the epoch."""

    run: Setup  # its first configuration's
    steps: list[int]  # its optimizer steps in each epoch
    warmup: int
    windows: list[Window] = dataclasses.field(default_factory=list)  # the epoch's, of k micro-batches each
    step: int = 0
    lr: float = 0.0
    samples: int = 0  # trained this epoch
    counted: object = 0  # a loss without counts(): the items its window's terms counted so far
    weights: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # its model's parameters, by name


@dataclass
class Served:
    """A configuration of the group and the member that trains it: its own, or one that trains exactly as it
    would (`_training`), trained once and recorded as each configuration's own."""

    member: Member
    config: TrainConfig
    checkpointer: Checkpointer | None  # its own (the member's run writes its first configuration's)
    callback: EpochCallback | None
    stopped: Exception | None = None  # what its on_epoch raised: it ended there, alone


def train_fused(configs: list[TrainConfig], on_epoch: list[EpochCallback | None] | None = None,
                probes: list[list[Probe]] | None = None, diagnostics: bool = True, data: Data | None = None,
                checkpoints: list[Checkpointing | None] | None = None,
                saved_most: float = CPU_SAVED_MOST) -> list[TrainResult | Exception]:
    """Train every configuration of one group (equal `group_key`) as `train(config)` would, in one stacked
    forward and backward per micro-batch; each result is that member's. `on_epoch[i]`, `probes[i]` and
    `checkpoints[i]` are member i's: an exception that its on_epoch raises ends member i there, alone, and takes
    its place among the results (the others go on). Its diagnostics are a solo run's; its peak memory is its
    own, measured before the group starts in a run of one window alone at its b and k (the group's is not a
    member's). With checkpoints, each member's is written at the end of its epochs as `train` writes it (either
    can resume the other's), and members that all stand at the same epoch go on from there. Raises NotFusable
    (before any step) where they cannot train as one, or on the CPU where a member's micro-batch saves more than
    `saved_most` bytes for backward (CPU_SAVED_MOST)."""
    keys = {group_key(c) for c in configs}
    if None in keys or len(keys) > 1:
        why = next((alone(c) for c in configs if alone(c)), "they differ in " + ", ".join(
            name for name in SHARED if len({getattr(c, name) for c in configs}) > 1))
        raise NotFusable(f"these configurations cannot train as one: {why}")
    data = data or load(configs[0])
    if data.train_set is not None:
        raise NotFusable("only datasets of tensors train fused (this one is read through a DataLoader)")
    extra = probes or [[] for _ in configs]
    specs = checkpoints or [None] * len(configs)
    # Every member's peak before any member is built: on a GPU the allocator's peak counts whatever is resident,
    # and the members built before it (their weights, optimizer state, data) are no part of a solo run's.
    measured: dict[TrainConfig, tuple[float, int]] = {}
    # A configuration that trains exactly as an earlier one (k = 1 under linear or sqrt at B = base_batch is the
    # none rule's run) is trained once, by that one's member; one with probes of its own is a member itself.
    firsts: dict[TrainConfig, int] = {}
    own = [i if extra[i] else firsts.setdefault(_training(c), i) for i, c in enumerate(configs)]
    peaks = {i: _peak_alone(configs[i], data, measured) if diagnostics else None for i in sorted(set(own))}
    saved = max((peak.saved_peak for peak in peaks.values() if peak is not None), default=0)
    if saved > saved_most and resolve_device(configs[0].device).type == "cpu":
        raise NotFusable(f"on the CPU, members whose micro-batch saves {saved / 2**20:.1f} MiB for backward (more "
                         f"than {saved_most / 2**20:.1f}) train alone: such groups ran slower fused (docs/trainer.md)")
    members = {i: _member(configs[i], data, extra[i], peaks[i], specs[i]) for i in peaks}
    served = [_served(members[own[i]], own[i] == i, c, specs[i], (on_epoch or [None] * len(configs))[i])
              for i, c in enumerate(configs)]
    try:
        return _train(list(members.values()), served)
    finally:
        for s in served:
            if s.checkpointer:  # (stopped by an exception: the last write lands before anyone reads or removes it)
                s.checkpointer.join()


def _training(config: TrainConfig) -> TrainConfig:
    """What decides how `config` trains: itself, with an SGD rule that moves only the LR written as the LR it
    gives (the Adam rules and wd_rule = timescale move more than the LR)."""
    if config.lr_rule not in ("none", "linear", "sqrt") or config.wd_rule != "none":
        return config
    return dataclasses.replace(config, lr_rule="none", base_lr=config.lr)


def _served(member: Member, first: bool, config: TrainConfig, spec: Checkpointing | None,
            callback: EpochCallback | None) -> Served:
    """Configuration `config` as trained by `member` (`first`: the member's own): with its own checkpoints, which
    must stand where the member's stand (else the group is refused)."""
    if first:
        return Served(member, config, member.run.checkpointer, callback)
    checkpointer = Checkpointer(spec, config) if spec else None
    saved = checkpointer.load() if checkpointer else None
    if (saved["progress"]["epoch"] if saved else 0) != member.run.progress.epoch:
        raise NotFusable(f"their checkpoints stand at different epochs ({member.run.progress.epoch} and "
                         f"{saved['progress']['epoch'] if saved else 0})")
    return Served(member, config, checkpointer, callback)


def _train(members: list[Member], served: list[Served]) -> list[TrainResult | Exception]:
    """The group's epochs from where its members stand, then each configuration's result."""
    epochs = {m.run.progress.epoch for m in members if not m.run.progress.finished}
    if len(epochs) > 1:
        raise NotFusable(f"their checkpoints stand at different epochs ({', '.join(map(str, sorted(epochs)))})")
    for s in served:
        for row in replayed(s.member.run.progress) if s.callback is not None else ():
            _tell(s, row)
    active = [m for m in members if _live(m, served)]
    first = members[0]
    base = dataclasses.replace(first.run.config, accum_steps=1)  # its windows are the micro-batches
    feed = Feed(first.run.data, base, first.run.device, first.run.t.loss)
    forward = _stacked_forward(first.run.model)
    buffers = _stack_buffers(active) if active else {}
    for epoch in range(active[0].run.progress.epoch + 1 if active else base.epochs + 1, base.epochs + 1):
        start = time.perf_counter()
        micro = list(feed.epoch(epoch, base))
        for m in active:
            m.windows = _windows(micro, m.run.config.accum_steps)
            m.samples = 0
        for i, part in enumerate(micro):
            _micro_batch(active, forward, buffers, part, i, len(micro) - 1, epoch == 1 and i == 0)
            check_interrupt()
        trained = time.perf_counter()
        for m in active:  # each member's training time is the group's (the others' evaluations are not in it)
            row = end_epoch(m.run, epoch, m.step, m.lr, m.samples, start, time.perf_counter() - trained, (0, 0))
            for s in served:
                if s.member is m and s.stopped is None:
                    if s.checkpointer:
                        save(m.run, s.checkpointer)
                    _tell(s, row)
        if not all(_live(m, served) for m in active):  # a member that diverged or was stopped ends; the others go on
            active = [m for m in active if _live(m, served)]
            if not active:
                break
            buffers = _stack_buffers(active)
    for s in served:
        if s.checkpointer and not s.stopped:
            s.checkpointer.wait()
    results = {id(s.member): result(s.member.run) for s in served if not s.stopped}
    return [s.stopped or _own(results[id(s.member)], s.config) for s in served]


def _live(m: Member, served: list[Served]) -> bool:
    """Whether member `m` trains on: its run goes on and some configuration it trains was not stopped."""
    return not m.run.progress.finished and any(s.stopped is None for s in served if s.member is m)


def _tell(s: Served, row: dict[str, float]) -> None:
    """A configuration's row to its callback; what the callback raises ends that configuration alone."""
    if s.callback is None:
        return
    try:
        s.callback(dict(row))
    except Exception as exc:
        s.stopped = exc


def _own(r: TrainResult, config: TrainConfig) -> TrainResult:
    """The member's result as `config`'s (the model is the member's, read only from here)."""
    return r if r.config is config else dataclasses.replace(
        r, config=config, metrics=dict(r.metrics), history=[dict(row) for row in r.history], warnings=list(r.warnings))


def _member(config: TrainConfig, data: Data, extra: list[Probe], peak: PeakMemory | None,
            spec: Checkpointing | None) -> Member:
    """A member, set up by `train`'s own path (`peak`: its diagnostics, its peak memory measured alone; None: no
    diagnostics)."""
    run = set_up(config, data, [*([peak, Health(), Noise()] if peak is not None else []), *extra], spec)
    if getattr(run.t.loss.fn, "__self__", None) is run.model:
        raise NotFusable("a model's own loss method reads its own parameters, not the stacked ones")
    _, steps, warmup = plan(config, run.data.n_train)
    return Member(run, steps, warmup, step=run.progress.step, weights=dict(run.model.named_parameters()))


def _peak_alone(config: TrainConfig, data: Data, measured: dict[TrainConfig, tuple[float, int]]) -> PeakMemory:
    """The member's peak memory as its solo run measures it, from one window of its own (the planner's probe):
    on a CPU the first window's saved tensors and the state after a step, which is all a solo run counts; on a
    GPU the allocator's peak over that window and an evaluation. The
    learning rate and its schedule allocate nothing: members that differ only there share one measurement
    (`measured`, by the configuration without them)."""
    key = dataclasses.replace(config, lr_rule="none", base_lr=0.1, warmup_epochs=0.0, schedule="constant",
                              weight_decay=0.0, wd_rule="none", epochs=1, max_steps=1)
    if key not in measured:
        probe = PeakMemory()
        run = set_up(config, data, [probe], None)
        window_step(run.t, next(iter(run.feed.epoch(1, config))), 0, config.lr)
        if run.device.type == "cuda":  # a solo run's first epoch ends in its evaluation, which the allocator counts
            run.measure()
        measured[key] = probe.epoch_end(1)["peak_memory_bytes"], probe.saved.peak
    return PeakMemory(*measured[key])


def _windows(micro: list[Window], k: int) -> list[Window]:
    """The epoch's micro-batches (windows of b) grouped k at a time: a member's windows, with their counts."""
    grouped = []
    for i in range(0, len(micro), k):
        parts, counts = micro[i:i + k], None
        for part in parts:
            counts = add_counts(counts, part.counts)
        grouped.append(Window(sum(p.size for p in parts), counts, sum(p.rows for p in parts), None))
    return grouped


def _stacked_forward(model: nn.Module):
    """The members' forward in one call: the model's, over stacked parameters and buffers (their first dim): as
    fused operators where the model has them (trainers/stacked.py), otherwise through vmap."""
    fused = fused_forward(model)
    if fused is not None:
        return fused

    def one(params, buffers, x):
        return torch.func.functional_call(model, (params, buffers), (x,))

    stacked = torch.func.vmap(one, in_dims=(0, 0, None), randomness="error")
    # BatchNorm as one batch_norm over the members' channels (trainers/stacked_norm.py); the mode sees every
    # torch call of the forward, so only where there is BatchNorm.
    norm = side_by_side if batchnorm_layers(model) else contextlib.nullcontext

    def forward(params, buffers, x):
        # An op with no batching rule (attention on the CPU) runs member by member, exact as before; torch's note
        # of it would print once per study on the user's terminal.
        with warnings.catch_warnings(), norm():
            warnings.filterwarnings("ignore", "There is a performance drop because we have not yet implemented the "
                                    "batching rule")
            return stacked(params, buffers, x)

    return forward


def _stack_buffers(members: list[Member]) -> dict[str, torch.Tensor]:
    """The members' buffers stacked, each member's model then holding a view of its own slice (so that the
    stacked forward's in-place updates of BatchNorm's statistics are the member's own)."""
    stacked = {}
    for name, _ in members[0].run.model.named_buffers():
        stacked[name] = torch.stack([m.run.model.get_buffer(name) for m in members])
        owner, _, leaf = name.rpartition(".")
        for i, m in enumerate(members):
            m.run.model.get_submodule(owner)._buffers[leaf] = stacked[name][i]
    return stacked


def _micro_batch(active: list[Member], forward, buffers: dict[str, torch.Tensor], part: Window, i: int,
                 last: int, first: bool) -> None:
    """Micro-batch i of the epoch for every active member: one stacked forward and backward, then each member
    whose window ends here steps, as `window_step` does for one."""
    (x, y), = part.cut(part.rows)
    if isinstance(x, Mapping):
        raise NotFusable("only tensor inputs train fused")
    params = {name: torch.stack([m.weights[name] for m in active]) for name in active[0].weights}
    try:
        out = forward(params, buffers, x)
    except RuntimeError as exc:
        if first:  # nothing has stepped yet: the caller trains them alone
            raise NotFusable(f"its forward cannot be stacked ({str(exc).splitlines()[0]})") from None
        raise
    shares, terms = [], []
    for j, m in enumerate(active):
        window = m.windows[i // m.run.config.accum_steps]
        if i % m.run.config.accum_steps == 0:  # the window's first micro-batch: the schedule
            m.lr = lr_at(m.run.config, m.step, sum(m.steps), m.warmup)
            for group in m.run.t.optimizer.param_groups:
                group["lr"] = m.lr
        with m.run.t.probes.forward(m.step):
            terms.append(m.run.t.loss.terms(out[j], y))
        shares.append(m.run.t.loss.share(terms[j], window.counts))
    sum(shares[1:], shares[0]).backward()
    ending = []
    for j, m in enumerate(active):
        k = m.run.config.accum_steps
        window = m.windows[i // k]
        m.run.t.probes.after_micro(Micro(m.step, window.size, x, y, terms[j]))
        if m.run.t.loss.divide_after:
            m.counted = m.counted + next(iter(terms[j].values()))[1]
        if i % k == k - 1 or i == last:  # its window ends (the epoch's last may hold fewer than k)
            ending.append((m, window))
    _step(ending)


def _step(ending: list[tuple[Member, Window]]) -> None:
    """The members whose windows end here step: those `batched` allows in one update, the others each alone."""
    together = [batched(m.run.t) for m, _ in ending]
    step_together([(m.run.t, m.step, window.size) for (m, window), both in zip(ending, together) if both])
    for (m, window), both in zip(ending, together):
        if not both:
            end_window(m.run.t, m.step, window.size, m.counted)
        m.step, m.samples, m.counted = m.step + 1, m.samples + window.size, 0
