"""Micro-batches that shrink on out-of-memory (`--physical-batch auto`, as MosaicML Composer does): halve b and
double k so that B stays, put back what the failed attempt changed, and run the same window again. b never
grows back within a run."""
from __future__ import annotations

import gc
from dataclasses import replace

import torch
from torch import nn

from .config import TrainConfig


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
    """What a window changes before its step, kept at its start so that it can run again as if for the first
    time: the buffers (BatchNorm's running statistics) and the RNG states (dropout); the gradients are zeroed."""

    def __init__(self, model: nn.Module):
        self.model = model

    def mark(self) -> None:
        self.buffers = [b.detach().clone() for b in self.model.buffers()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def rollback(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for live, kept in zip(self.model.buffers(), self.buffers):
                live.copy_(kept)
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        gc.collect()  # the failed micro-batch's activations, held by the exception's frames until now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
