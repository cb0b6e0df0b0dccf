"""What the loop measures, behind one seam. The loop calls one `Probes` object at fixed points (around a
micro-batch's forward, after its backward, before and after the optimizer step, at the end of an epoch and of
the run), and it calls each probe that acts there. Each probe keeps its own schedule (which steps it measures)
and returns its epoch's values for the history row. `train(config, probes=[...])` adds a user's own."""
from __future__ import annotations

import math
import weakref
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from .config import TrainConfig
from .health import StepStats, never_updated
from .losses import Terms
from .noise import NoiseScale

NO_CONTEXT = nullcontext()  # (reusable: none is built per micro-batch)


@dataclass
class Run:
    """What a probe may read: set up once, before the first step."""

    config: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]  # the optimizer's, in order
    device: torch.device
    n_train: int
    parallel: Any = None  # a batchsweep.trainers.distributed.Parallel under torchrun (None for one process)
    divide_after: bool = False  # a loss without counts(): micro-batch gradients are sums until the step


@dataclass
class Micro:
    """One micro-batch, after its backward: the step it belongs to, its window's size, its inputs and
    targets, and the loss terms' detached (sum, count)."""

    step: int
    window: int
    x: Any
    y: torch.Tensor
    terms: Terms


class Probe:
    """The seam. Every method is optional; none may change gradients, weights or RNG states."""

    def start(self, run: Run) -> None:
        self.run = run

    def forward(self, step: int):
        """A context around a micro-batch's forward and loss."""
        return nullcontext()

    def after_micro(self, micro: Micro) -> None:
        pass

    def before_step(self, step: int, window: int) -> None:
        """With the window's gradient in place, before clipping."""

    def retry(self, step: int, b: int) -> None:
        """The window of `step` runs again from its start, in micro-batches of b (one ran out of memory): forget
        what after_micro took from it."""

    def after_step(self, step: int) -> None:
        pass

    def epoch_end(self, epoch: int) -> dict[str, float]:
        return {}

    def notes(self) -> list[str]:
        """Warnings for the run's record, at its end."""
        return []

    def state(self) -> dict[str, Any]:
        """What the probe carries from one epoch into the next (tensors, numbers): a checkpoint keeps it."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take back `state()` after start(), when a run resumes from a checkpoint."""


@dataclass
class TermSum:
    """One loss term over an epoch so far: its sum (float64, on the device) and count, and the micro-batches'
    sums and counts (a count of tokens is a tensor) not yet added into them."""

    total: torch.Tensor
    count: Any = 0
    held: list = field(default_factory=list)
    held_counts: list = field(default_factory=list)

    def hold(self, total: torch.Tensor, count) -> None:
        self.held.append(total)
        if isinstance(count, torch.Tensor):
            self.held_counts.append(count)
        else:
            self.count += count

    def add_held(self) -> None:
        if self.held:
            self.total += torch.stack(self.held).sum(dtype=torch.float64)
            self.held = []
        if self.held_counts:
            # (in float64: a count may come as float32, exact only to 2**24, as the built-in loss's tokens do)
            self.count = self.count + torch.stack(self.held_counts).sum(dtype=torch.float64)
            self.held_counts = []


class LossTerms(Probe):
    """The epoch's mean of each loss term over its counted items: `train_loss` is their sum (the objective),
    and a loss with named terms adds `loss/<name>` each. Sums stay on the device until the epoch's end; a
    window's are taken at its step (a window that runs again after an out-of-memory is counted once). They are
    added in one reduction per HELD micro-batches, not one addition each: on a GPU that is a kernel launch a
    micro-batch less. Under torchrun they are summed over the ranks at the epoch's end."""

    HELD = 1024

    def start(self, run: Run) -> None:
        super().start(run)
        self.sums: dict[str, TermSum] = {}
        self.pending: list = []  # the window's micro-batches' terms, until its step

    def after_micro(self, micro: Micro) -> None:
        self.pending.append(micro.terms)

    def before_step(self, step: int, window: int) -> None:
        for terms in self.pending:
            for name, (total, count) in terms.items():
                entry = self.sums.get(name)
                if entry is None:
                    entry = self.sums[name] = TermSum(torch.zeros((), device=total.device, dtype=torch.float64))
                entry.hold(total.detach(), count)
                if len(entry.held) == self.HELD:
                    entry.add_held()
        self.pending = []

    def retry(self, step: int, b: int) -> None:
        self.pending = []

    def epoch_end(self, epoch: int) -> dict[str, float]:
        for entry in self.sums.values():
            entry.add_held()
        sums = {name: (entry.total, entry.count) for name, entry in self.sums.items()}
        if self.run.parallel:  # the sums and counts of every rank's shard (names in the same order on all)
            flat = torch.tensor([float(v) for entry in sums.values() for v in entry], dtype=torch.float64,
                                device=self.run.device)
            flat = self.run.parallel.all_sum(flat).tolist()
            sums = {name: flat[2 * i:2 * i + 2] for i, name in enumerate(sums)}
        means = {name: (float(total) / float(count) if float(count) else math.nan)
                 for name, (total, count) in sums.items()}
        self.sums = {}
        row = {"train_loss": sum(means.values())}
        if list(means) != ["loss"]:
            row.update({f"loss/{name}": value for name, value in means.items()})
        return row


class Probes:
    """The run's probes behind one object: the loop calls it at its fixed points, and it calls each probe that
    overrides the method (a call that does nothing still costs its Python, every micro-batch). `terms` (the
    loss terms, always there) comes first, then `more`; a checkpoint keeps them in that order."""

    def __init__(self, terms: LossTerms, more: list[Probe]):
        self.terms, self.all = terms, [terms, *more]

        def acting(name: str) -> list[Probe]:  # (its class's method, or one set on the probe itself)
            return [p for p in self.all if getattr(getattr(p, name), "__func__", None) is not getattr(Probe, name)]

        self._forward, self._after_micro = acting("forward"), acting("after_micro")
        self._before_step, self._after_step = acting("before_step"), acting("after_step")

    def __iter__(self) -> Iterator[Probe]:
        return iter(self.all)

    def start(self, run: Run) -> None:
        for probe in self.all:
            probe.start(run)

    def forward(self, step: int):
        """The probes' contexts around a micro-batch's forward (usually one or none: no ExitStack then)."""
        if not self._forward:
            return NO_CONTEXT
        if len(self._forward) == 1:
            return self._forward[0].forward(step)
        stack = ExitStack()
        for probe in self._forward:
            stack.enter_context(probe.forward(step))
        return stack

    def after_micro(self, micro: Micro) -> None:
        for probe in self._after_micro:
            probe.after_micro(micro)

    def before_step(self, step: int, window: int) -> None:
        for probe in self._before_step:
            probe.before_step(step, window)

    def after_step(self, step: int) -> None:
        for probe in self._after_step:
            probe.after_step(step)

    def retry(self, step: int, b: int) -> None:
        for probe in self.all:
            probe.retry(step, b)

    def epoch_end(self, epoch: int) -> dict[str, float]:
        """The epoch's values of every probe but the loss terms (the row takes theirs first)."""
        row = {}
        for probe in self.all[1:]:
            row.update(probe.epoch_end(epoch))
        return row

    def notes(self) -> list[str]:
        return [note for probe in self.all for note in probe.notes()]


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
        # Autograd keeps what this returns. The tensor itself, when it is the operation's output, would make a
        # cycle through its grad_fn that only a backward breaks: a graph dropped without one (a micro-batch
        # that ran out of memory) would then never be freed. An alias of the same storage breaks no cycle.
        saved = t.detach()
        weakref.finalize(saved, self._release, ptr)  # runs when autograd lets go of this saved tensor
        return saved

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


class PeakMemory(Probe):
    """`peak_memory_bytes`: the CUDA allocator's peak on a GPU; on a CPU the saved tensors' peak, counted in
    the run's first window only (every full window holds the same tensors, and the counting hooks cost a sixth
    of a micro-batch), plus parameters, gradients and optimizer state.

    `alone`: a fused member's peak, measured in a short run of its own (trainers/fused.py), reported as it is (the
    group's is not the member's); `saved_peak`: that run's saved tensors, kept in checkpoints as a solo run's."""

    def __init__(self, alone: float | None = None, saved_peak: int = 0):
        self.alone, self.saved_peak = alone, saved_peak

    def start(self, run: Run) -> None:
        super().start(run)
        self.on_cuda = run.device.type == "cuda"
        if self.on_cuda and self.alone is None:
            torch.cuda.reset_peak_memory_stats(run.device)
        self.saved = SavedTensorBytes(run.model)
        self.saved.peak = self.saved_peak
        self.static = 0

    def forward(self, step: int):
        return self.saved.hooks() if step == 0 and not self.on_cuda and self.alone is None else nullcontext()

    def retry(self, step: int, b: int) -> None:
        """The peak is that of the micro-batches that ran, not of the one that did not fit."""
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.run.device)
        self.saved.peak = self.saved.current

    def epoch_end(self, epoch: int) -> dict[str, float]:
        if self.alone is not None:
            return {"peak_memory_bytes": self.alone}
        if self.on_cuda:
            return {"peak_memory_bytes": float(torch.cuda.max_memory_allocated(self.run.device))}
        if not self.static:
            self.static = state_bytes(self.run.model, self.run.optimizer)
        return {"peak_memory_bytes": float(self.saved.peak + self.static)}

    def state(self) -> dict[str, Any]:
        return {"saved_peak": self.saved.peak}

    def load_state(self, state: dict[str, Any]) -> None:
        self.saved.peak = state["saved_peak"]


class Health(Probe):
    """Gradient norm, update ratio and dead tensors (trainers/health.py). A sampled step's statistics cost
    about a twelfth of a cnn1d micro-batch of 32 on a CPU: every step from k = 16, every ceil(16/k)-th step
    below (the means stay unbiased), about 0.5% of the time."""

    def start(self, run: Run) -> None:
        super().start(run)
        self.stats = StepStats(run.params)
        self.every = math.ceil(16 / run.config.accum_steps)

    def retry(self, step: int, b: int) -> None:
        self.every = -(-16 * b // self.run.config.effective_batch)

    def before_step(self, step: int, window: int) -> None:
        self.sampled = step % self.every == 0
        if self.sampled:
            self.stats.before_step()

    def after_step(self, step: int) -> None:
        if self.sampled:
            self.stats.after_step()

    def epoch_end(self, epoch: int) -> dict[str, float]:
        return self.stats.epoch()

    def notes(self) -> list[str]:
        idle = never_updated(self.run.model, self.stats)
        return [idle] if idle else []

    def state(self) -> dict[str, Any]:
        return {"ever_got_grad": self.stats.ever_got_grad}

    def load_state(self, state: dict[str, Any]) -> None:
        self.stats.ever_got_grad = state["ever_got_grad"].clone()


class Noise(Probe):
    """The gradient noise scale (trainers/noise.py), for k >= 2 (it needs micro-batches and a window that
    differ), on every other health step and full windows only: it costs a flat copy of the gradient and a
    norm per micro-batch. Not under torchrun: a rank's micro-batch gradients are its own until the window's
    all-reduce, so the two batch sizes the estimator compares are not what it assumes."""

    def start(self, run: Run) -> None:
        super().start(run)
        self.noise = None
        if self._can(run):
            self._measure(run.config.physical_batch)

    @staticmethod
    def _can(run: Run) -> bool:
        return run.config.world_size == 1 and not run.divide_after

    def _measure(self, b: int) -> None:
        B, previous = self.run.config.effective_batch, self.noise
        self.noise = NoiseScale(self.run.params, b, B, self.run.n_train) if b < B else None
        self.every = 2 * -(-16 * b // B)
        if previous is not None and self.noise is not None:  # the estimates do not depend on b: keep them
            self.noise.ema, self.noise.weight = previous.ema, previous.weight

    def retry(self, step: int, b: int) -> None:
        if self._can(self.run):
            self._measure(b)

    def notes(self) -> list[str]:
        if self.run.config.world_size > 1:
            return ["the noise scale is not measured under torchrun (a rank's micro-batch gradients are its own)"]
        if self.run.divide_after and self.run.config.accum_steps > 1:
            return ["the noise scale is not measured with a loss without counts(target): its micro-batch gradients "
                    "are not normalized until the window's count is known"]
        return []

    def _measures(self, step: int, window: int) -> bool:
        return self.noise is not None and step % self.every == 0 and window == self.run.config.effective_batch

    def after_micro(self, micro: Micro) -> None:
        if self._measures(micro.step, micro.window):
            self.noise.after_micro()

    def before_step(self, step: int, window: int) -> None:
        if self._measures(step, window):
            self.noise.step()

    def epoch_end(self, epoch: int) -> dict[str, float]:
        scale = self.noise.value() if self.noise is not None else None
        if scale is None:  # not a number while |G|^2 is not measurable, nor for k = 1
            return {}
        return {"noise_scale": scale[0], "noise_scale_reliable": float(scale[1])}

    def state(self) -> dict[str, Any]:
        return {} if self.noise is None else {"ema": self.noise.ema, "weight": self.noise.weight}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.noise is not None:
            self.noise.ema, self.noise.weight = state["ema"].to(self.noise.ema.device), state["weight"]


def diagnostics() -> list[Probe]:
    """The built-in measurements, fresh."""
    return [PeakMemory(), Health(), Noise()]
