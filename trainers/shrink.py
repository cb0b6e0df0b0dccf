"""Micro-batches that shrink on out-of-memory (`--physical-batch auto`, as MosaicML Composer does): halve b and
double k so that B stays, put back what the failed attempt changed, and run the same window again. b never
grows back within a run."""
from __future__ import annotations

import gc
from dataclasses import replace
import torch
from torch import nn

from .config import TrainConfig
from .models import set_bn_momentum


def smaller(b: int, B: int) -> int:
    """The largest divisor of B that is at most b / 2 (b halves, and B is still b * k); out of memory at
    b = 1 is final."""
    if b == 1:
        raise torch.OutOfMemoryError("out of memory with micro-batches of one sample: nothing left to shrink")
    return max(d for d in range(1, b // 2 + 1) if B % d == 0)


def at(config: TrainConfig, b: int) -> TrainConfig:
    """The configuration at micro-batches of b, the effective batch kept (BatchNorm's momentum rules follow k)."""
    return replace(config, physical_batch=b, accum_steps=config.effective_batch // b)


class Retry:
    """The loop's one retry path. With shrink_on_oom, what a window changes before its step is kept at its start
    (the buffers, such as BatchNorm's running statistics, and the RNG states, for dropout), so that after an
    out-of-memory it runs again as if for the first time, its gradients zeroed, at a smaller b. Without it, an
    out-of-memory is raised as it is. `progress` counts the retries (a checkpoint keeps them)."""

    def __init__(self, model: nn.Module, config: TrainConfig, optimizer: torch.optim.Optimizer, probes, progress):
        self.model, self.config, self.optimizer, self.probes = model, config, optimizer, probes
        self.progress, self.on = progress, config.shrink_on_oom

    def mark(self) -> None:
        """At a window's start (or its next attempt)."""
        if not self.on:
            return
        self.buffers = [b.detach().clone() for b in self.model.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def smaller(self, b: int) -> int:
        """In the handler of a micro-batch of b that ran out of memory: the b to run the window at next (without
        shrink_on_oom, or at b = 1, the error is raised)."""
        if not self.on:
            raise  # the out-of-memory being handled, as it is
        return smaller(b, self.config.effective_batch)

    def again(self, failed: int, b: int, step: int) -> int:
        """Out of the handler (the failed micro-batch's frames let go: now its memory can be freed), the window put
        back as it was at its start, to run again at b; returns b."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, kept in zip(self.model.buffers(), self.buffers):
                live.copy_(kept)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        gc.collect()  # the failed micro-batch's activations
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        set_bn_momentum(self.model, at(self.config, b).bn_momentum)
        progress = self.progress
        progress.oom_batch, progress.physical_batch = failed, b
        progress.oom_retries += 1
        self.probes.retry(step, b)
        return b
