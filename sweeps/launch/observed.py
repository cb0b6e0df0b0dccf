"""What the tracer saw a script do (sweeps/launch/tracer/batchsweep_trace.py writes it): its optimizer steps, each
window's micro-batches, zero_grad, clip and scheduler calls, LRs and gradient norms, read back as dataclasses.
batchsweep reads a script's behaviour from here, never from what the script prints about itself."""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from .tracer import FOLDER

# Window fingerprints that count as the same samples: the same values summed in another order, in float64.
SAME_DATA_WITHIN = 1e-9
# Why a launcher's processes may go unseen: said in one line where no process left a trace.
UNSEEN = ("batchsweep saw no optimizer step of the script: the tracer sees torch.optim optimizers (and subclasses of "
          "torch.optim.Optimizer) in Python processes that keep PYTHONPATH; a launcher that clears the environment, "
          "a script without torch, or an optimizer of its own that is no torch.optim.Optimizer cannot be observed")


def environment(folder: Path, stop: int = 0, save: bool = False, grads: tuple[int | str, ...] = (), keep: int = 0,
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
    if keep:
        env["BATCHSWEEP_TRACE_KEEP"] = str(keep)
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
    opt: int = 0  # which optimizer stepped (by first step), where more than one did
    at: list[int] | None = None  # per event but F: the index of the place in the script that made the call

    @property
    def micro_batches(self) -> int:
        return self.events.count("B")

    @property
    def stepped(self) -> int:
        """The backward() calls whose gradients reached the step: those after the window's last zero_grad()."""
        return self.events[self.events.rfind("Z") + 1:].count("B")

    @property
    def dropped(self) -> int:
        """The backward() calls that a zero_grad() threw away before this step."""
        return self.micro_batches - self.stepped

    def repeated(self, mark: str) -> bool:
        """Whether one place in the script made this kind of call twice in the window: one scheduler stepped per
        micro-batch, not two schedulers stepped once each (by count alone where no places were recorded)."""
        places = [where for event, where in zip((e for e in self.events if e != "F"), self.at or []) if event == mark]
        return len(places) != len(set(places)) if self.at else self.events.count(mark) > 1

    def zero_grad_within(self) -> bool:
        """A zero_grad() between two backward() calls of the window: it throws away the ones before it."""
        first, last = self.events.find("B"), self.events.rfind("B")
        return "Z" in self.events[first + 1:last] if first >= 0 else False

    def site(self, mark: str, sites: list[str], nth: int = 0) -> str | None:
        """Where the script made the window's nth call of this kind ("file:line"), where the tracer recorded it."""
        calls = [i for i, event in enumerate(e for e in self.events if e != "F") if event == mark]
        if self.at is None or nth >= len(calls) or calls[nth] >= len(self.at) or self.at[calls[nth]] >= len(sites):
            return None
        return sites[self.at[calls[nth]]]

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
    trained: list[str] | None = None  # the names of the parameters the optimizer trains, in the saved state
    random_modules: list[str] = field(default_factory=list)  # modules in training mode that draw (dropout)
    random_draws: list[str] = field(default_factory=list)  # where a default generator moved: "forward", "step"
    random_generators: dict[str, list[str]] = field(default_factory=dict)  # which, there: "torch", "random", "numpy"
    random_fields: list[str] = field(default_factory=list)  # a transformers config's dropout fields above 0
    random_late: list[str] = field(default_factory=list)  # modules random by kind at the run's end only (p raised)
    sites: list[str] = field(default_factory=list)  # the places ("file:line") of the script's calls
    dangling: str = ""  # the events after the last step: backward() calls that never stepped
    drawn: dict[str, dict[int, int]] = field(default_factory=dict)  # torch.randint's first dims, randperm's sizes
    compiled: bool = False  # a module compiled in place: its forwards are not seen

    def optimizers(self) -> list[int]:
        """The optimizers that stepped, by first step (a GAN's two, say)."""
        return sorted({s.opt for s in self.steps})

    def observed(self, opt: int = 0) -> tuple[int, int] | None:
        """(b, k) as the script ran them with optimizer `opt` (each optimizer's steps are its own windows): the most
        common micro-batch size and count over the steps after the first (a first window may differ: a warmup, a
        resumed run); None where no step was seen."""
        steps = [s for s in self.steps if s.opt == opt]
        later = steps[1:] or steps
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


def unobservable(folder: Path) -> str | None:
    """Why the tracer could not install itself in a process of the command (an older torch), where it said so."""
    said = sorted(folder.glob("unobservable-*.txt"))
    return said[0].read_text().strip() if said else None


def read(folder: Path) -> Trace | None:
    """The trace of the process that stepped: rank 0's where ranks ran, else the one with the most steps; None where
    no process of the command made an optimizer step that the tracer saw."""
    files = sorted(folder.glob("trace-*.jsonl"))
    ranked = [f for f in files if f.name.startswith("trace-r0-")]
    best = Trace(folder=folder)
    for path in ranked or files:
        trace = parse(path)
        if len(trace.steps) > len(best.steps):
            best = trace
    return best if best.steps else None


def ranks(folder: Path) -> dict[int, Trace]:
    """Each rank's trace, by rank (trace-r<rank>-<pid>.jsonl), where the command ran ranks that stepped."""
    traces = {int(path.name.split("-")[1][1:]): parse(path) for path in sorted(folder.glob("trace-r*-*.jsonl"))}
    return {rank: trace for rank, trace in sorted(traces.items()) if trace.steps}


def merged(traces: dict[int, Trace]) -> list[Step]:
    """Rank 0's steps with what every rank's window held added up: the i-th micro-batches' sizes, the fingerprints
    and the tokens of all ranks. Ranks may hold other samples at (b, k) than at (b*k, 1) (Accelerate deals a
    rank every N-th micro-batch) while the window as a whole, which DDP's mean of the ranks' gradients steps on,
    holds the same."""
    from itertools import zip_longest

    ranks = list(traces.values())
    steps = []
    for rows in zip(*(t.steps for t in ranks)):
        prints = [r.fingerprint for r in rows]
        tokens = [r.tokens for r in rows]
        steps.append(replace(rows[0], samples=[sum(n) for n in zip_longest(*(r.samples for r in rows), fillvalue=0)],
                             fingerprint=None if None in prints else [sum(p[i] for p in prints) for i in range(2)],
                             tokens=None if None in tokens else sum(tokens)))
    return steps


def parse(path: Path) -> Trace:
    """One process's trace file."""
    trace = Trace(folder=path.parent)
    for line in path.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "loaders" in row:
            trace.loaders = [tuple(pair) for pair in row["loaders"]]
        elif "peak_allocated_bytes" in row:
            trace.peak_allocated_bytes = row["peak_allocated_bytes"]
        elif "trained" in row:
            trace.trained, trace.sites = row["trained"], row["sites"]
            trace.random_modules, trace.random_draws = row["random_modules"], row["random_draws"]
            trace.compiled, trace.random_fields = row.get("compiled", False), row.get("random_fields", [])
            trace.random_generators = row.get("random_generators", {})
            trace.random_late = row.get("random_late", [])
        elif "dangling" in row:
            trace.dangling = row["dangling"]
        elif "drawn" in row:
            trace.drawn = {kind: {int(n): c for n, c in counts.items()} for kind, counts in row["drawn"].items()}
        elif "step" in row:
            trace.steps.append(Step(**{k: v for k, v in row.items() if k in Step.__dataclass_fields__}))
    return trace


def noise_scale(trace: Trace) -> tuple[float, bool] | str:
    """The gradient noise scale from the windows the tracer measured, as the trainer estimates it
    (trainers/noise.py): (B_simple, reliable), or why it cannot be told. Full windows only (k micro-batches of b,
    no zero_grad or clip between their backward calls, a step that was not skipped). How the micro-batches were
    drawn decides the finite-set correction (DESIGN: windows without replacement from N samples read |G|^2 low by
    tr(S)/(N-1)): from a DataLoader of batch size b over N samples, or an epoch over torch.randperm(N), with it;
    drawn by torch.randint with replacement, independent samples, without it."""
    import torch

    from batchsweep.trainers import fold_noise, noise_scale as scale_of

    b, k = trace.observed() or (0, 0)
    if k < 2:
        return "it needs windows of 2 micro-batches or more"
    n = training_set(trace, b)
    if isinstance(n, str):
        return n
    full = [s for s in trace.steps if s.opt == 0 and s.micro_sq and len(s.micro_sq) == k and s.samples == [b] * k
            and not s.skipped and not s.zero_grad_within() and "C" not in s.events[:s.events.rfind("B")]
            and s.grad_norm]
    if not full:
        return "no full window was measured"
    small = torch.tensor([sum(s.micro_sq) / k for s in full], dtype=torch.float64)
    big = torch.tensor([s.grad_norm ** 2 for s in full], dtype=torch.float64)
    ema, weight = fold_noise(torch.zeros(2, dtype=torch.float64), 0.0, small, big, b, b * k)
    if n is None:  # independent draws: E|G_b|^2 = |G|^2 + tr(S)/b as it is
        g2, trace_s = (ema / weight).tolist()
        return (trace_s / g2, True) if g2 > 0 else "the measured |G|^2 is not positive yet"
    scale = scale_of(ema, weight, n)
    return scale if scale is not None else "the measured |G|^2 is not positive yet"


def training_set(trace: Trace, b: int) -> int | None | str:
    """The N that windows were drawn from without replacement; None where micro-batches were drawn with replacement
    (torch.randint of b, at least one a micro-batch); why, where the sampling is not known."""
    sizes = {n for n, batch in trace.loaders if batch == b}
    if len(sizes) == 1:
        return sizes.pop()
    if sizes:
        return f"the training set's size is not known: DataLoaders of batch size {b} over {sorted(sizes)} samples"
    perms = set(trace.drawn.get("randperm", {}))
    micro = sum(s.micro_batches for s in trace.steps)
    if trace.drawn.get("randint", {}).get(b, 0) >= micro:
        return None
    if len(perms) == 1:
        return perms.pop()
    if perms:
        return f"the training set's size is not known: permutations of {sorted(perms)} samples were drawn"
    return (f"the training set's size is not known: no DataLoader of batch size {b}, no torch.randperm and no "
            f"torch.randint of {b} samples was seen")


def window_losses(trace: Trace) -> list[tuple[int, float]]:
    """(step, the sum of the losses backwarded in its window) for each step of the first optimizer: for a script
    that divides by k or by the window's count, the window's mean loss."""
    return [(s.step, s.loss) for s in trace.steps if s.opt == 0 and s.loss is not None and not s.skipped]


def train_loss(losses: list[tuple[int, float]]) -> float:
    """The loss at the end of training: the mean over the last tenth of the windows (at least 1, at most 50), not
    one noisy window's."""
    last = [loss for _, loss in losses[-min(50, max(1, len(losses) // 10)):]]
    return sum(last) / len(last)


def same_data(a: Step, t: Step) -> bool:
    """Whether two windows held the same samples: as many of them, with the same fingerprint."""
    if sum(a.samples) != sum(t.samples) or (a.fingerprint is None) != (t.fingerprint is None):
        return False
    if a.fingerprint is None:
        return True
    return all(abs(x - y) <= SAME_DATA_WITHIN * max(abs(x), abs(y), 1e-300)
               for x, y in zip(a.fingerprint, t.fingerprint))
