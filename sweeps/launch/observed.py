"""What the tracer saw a script do (sweeps/launch/tracer/batchsweep_trace.py writes it): its optimizer steps, each
window's micro-batches, zero_grad, clip and scheduler calls, LRs and gradient norms, read back as dataclasses.
batchsweep reads a script's behaviour from here, never from what the script prints about itself."""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .tracer import FOLDER

# Window fingerprints that count as the same samples: the same values summed in another order, in float64.
SAME_DATA_WITHIN = 1e-9
# Why a launcher's processes may go unseen: said in one line where no process left a trace.
UNSEEN = ("batchsweep saw no optimizer step of the script: the tracer sees torch.optim optimizers (and subclasses of "
          "torch.optim.Optimizer) in Python processes that keep PYTHONPATH; a launcher that clears the environment, "
          "a script without torch, or an optimizer of its own that is no torch.optim.Optimizer cannot be observed")


def environment(folder: Path, stop: int = 0, save: bool = False, grads: tuple[int | str, ...] = (),
                losses: bool = False, data: bool = False, noise: bool = False,
                pythonpath: str | None = None) -> dict[str, str]:
    """The variables that put the tracer into a command's processes, writing into `folder`; `pythonpath`: the
    command's own (default: this process's), which the tracer's folder goes in front of."""
    pythonpath = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    env = {"BATCHSWEEP_TRACE": str(folder), "PYTHONPATH": os.pathsep.join(p for p in (str(FOLDER), pythonpath) if p)}
    if stop:
        env["BATCHSWEEP_TRACE_STOP"] = str(stop)
    if save:
        env["BATCHSWEEP_TRACE_SAVE"] = "1"
    if grads:
        env["BATCHSWEEP_TRACE_GRADS"] = ",".join(map(str, grads))
    if losses:
        env["BATCHSWEEP_TRACE_LOSS"] = "1"
    if data:
        env["BATCHSWEEP_TRACE_DATA"] = "1"
    if noise:
        env["BATCHSWEEP_TRACE_NOISE"] = "1"
    return env


@dataclass
class Step:
    """One optimizer step, with what happened since the one before (see the tracer's docstring for `events`)."""

    step: int
    events: str
    samples: list[int]  # per micro-batch (backward call)
    lrs: list[float | None]
    skipped: bool = False  # a GradScaler skipped it
    fingerprint: list[float] | None = None
    tokens: int | None = None
    shape: list[int] | None = None  # of the window's first model input
    grad_norm: float | None = None  # before any clipping
    clip: float | None = None
    losses: list[float] | None = None
    wall_s: float = 0.0
    micro_sq: list[float] | None = None  # each micro-batch's own gradient's squared norm, where measured
    optimizers: int = 1  # that have stepped so far: with more than one, a window holds the others' calls too

    @property
    def micro_batches(self) -> int:
        return self.events.count("B")

    def zero_grad_within(self) -> bool:
        """A zero_grad() between two backward() calls of the window: it throws away the ones before it."""
        first, last = self.events.find("B"), self.events.rfind("B")
        return "Z" in self.events[first + 1:last] if first >= 0 else False

    @property
    def loss(self) -> float | None:
        return sum(self.losses) if self.losses else None


@dataclass
class Trace:
    """The steps of the process that trained (rank 0 where there are ranks)."""

    steps: list[Step] = field(default_factory=list)
    folder: Path | None = None
    loaders: list[tuple[int, int]] = field(default_factory=list)  # (data set size, batch size) of its DataLoaders
    peak_allocated_bytes: int | None = None  # the CUDA allocator's peak from the first training forward on

    def observed(self) -> tuple[int, int] | None:
        """(b, k) as the script ran them: the most common micro-batch size and count over the steps after the first
        (a first window may differ: a warmup, a resumed run); None where no step was seen."""
        later = self.steps[1:] or self.steps
        if not later:
            return None
        k = Counter(s.micro_batches for s in later).most_common(1)[0][0]
        b = Counter(n for s in later for n in s.samples).most_common(1)
        return (b[0][0] if b else 0), k

    def samples_per_s(self) -> float | None:
        timed = self.steps[1:]  # the first step's time holds the script's start-up
        wall = sum(s.wall_s for s in timed)
        return sum(sum(s.samples) for s in timed) / wall if timed and wall > 0 else None

    def tokens_per_s(self) -> float | None:
        timed = [s for s in self.steps[1:] if s.tokens is not None]
        wall = sum(s.wall_s for s in timed)
        return sum(s.tokens for s in timed) / wall if timed and wall > 0 else None


def read(folder: Path) -> Trace | None:
    """The trace of the process that stepped: rank 0's where ranks ran, else the one with the most steps; None where
    no process of the command made an optimizer step that the tracer saw."""
    files = sorted(folder.glob("trace-*.jsonl"))
    ranked = [f for f in files if f.name.startswith("trace-r0-")]
    best = Trace(folder=folder)
    for path in ranked or files:
        trace = Trace(folder=folder)
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "loaders" in row:
                trace.loaders = [tuple(pair) for pair in row["loaders"]]
            elif "peak_allocated_bytes" in row:
                trace.peak_allocated_bytes = row["peak_allocated_bytes"]
            elif "step" in row:
                trace.steps.append(Step(**{k: v for k, v in row.items() if k in Step.__dataclass_fields__}))
        if len(trace.steps) > len(best.steps):
            best = trace
    return best if best.steps else None


def noise_scale(trace: Trace) -> tuple[float, bool] | str:
    """The gradient noise scale from the windows the tracer measured, as the trainer estimates it
    (trainers/noise.py): (B_simple, reliable), or why it cannot be told. Full windows only (k micro-batches of b,
    no zero_grad or clip between their backward calls, a step that was not skipped), and the training set's size
    from the DataLoader of batch size b, which the finite-set correction needs."""
    import torch

    from batchsweep.trainers import fold_noise, noise_scale as scale_of

    b, k = trace.observed() or (0, 0)
    if k < 2:
        return "it needs windows of 2 micro-batches or more"
    sizes = {n for n, batch in trace.loaders if batch == b}
    if len(sizes) != 1:
        return (f"the training set's size is not known: no DataLoader of batch size {b} was seen" if not sizes else
                f"the training set's size is not known: DataLoaders of batch size {b} over {sorted(sizes)} samples")
    full = [s for s in trace.steps if s.micro_sq and len(s.micro_sq) == k and s.samples == [b] * k
            and not s.skipped and not s.zero_grad_within() and "C" not in s.events[:s.events.rfind("B")]
            and s.grad_norm]
    if not full:
        return "no full window was measured"
    small = torch.tensor([sum(s.micro_sq) / k for s in full], dtype=torch.float64)
    big = torch.tensor([s.grad_norm ** 2 for s in full], dtype=torch.float64)
    ema, weight = fold_noise(torch.zeros(2, dtype=torch.float64), 0.0, small, big, b, b * k)
    scale = scale_of(ema, weight, sizes.pop())
    return scale if scale is not None else "the measured |G|^2 is not positive yet"


def same_data(a: Step, t: Step) -> bool:
    """Whether two windows held the same samples: as many of them, with the same fingerprint."""
    if sum(a.samples) != sum(t.samples) or (a.fingerprint is None) != (t.fingerprint is None):
        return False
    if a.fingerprint is None:
        return True
    return all(abs(x - y) <= SAME_DATA_WITHIN * max(abs(x), abs(y), 1e-300)
               for x, y in zip(a.fingerprint, t.fingerprint))
