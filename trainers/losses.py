"""Losses as (sum, count): the sum of per-item losses over the items that count (samples, or tokens that
are not IGNORE_INDEX) and their number, or a dict of such named terms. The loop divides each term by its
count over the whole window, never by k, so a window's gradient is exactly the gradient of the mean over
all its counted items, whatever each micro-batch holds.

The counts must be known before the window's first backward. They come from the targets, as the
transformers library counts a window's tokens first: a loss may carry `counts(target)` (a number, or a dict
by term); without one, every term is assumed to count samples, which the first micro-batch checks.
"""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F

from .errors import ConfigError
from .imports import load_factory

IGNORE_INDEX = -100  # a target that does not count (padding), as in torch's cross_entropy
Count = Union[int, torch.Tensor]
Terms = dict[str, tuple[torch.Tensor, Count]]


def builtin(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Count]:
    """Cross-entropy for integer targets (one class per sample, or per token with IGNORE_INDEX for padding),
    squared error for float targets (per sample)."""
    if target.is_floating_point():
        return (output - target.view_as(output)).pow(2).sum(), len(target)
    if target.dim() > 1:  # tokens: flattened (the reshapes cost a micro-batch of samples a few µs for nothing)
        output, target = output.reshape(-1, output.shape[-1]), target.reshape(-1)
    return F.cross_entropy(output, target, ignore_index=IGNORE_INDEX, reduction="sum"), builtin_counts(target)


def builtin_counts(target: torch.Tensor) -> Count:
    if target.is_floating_point() or target.dim() == 1:
        return len(target)  # a Python number: no kernel, no synchronization
    return (target != IGNORE_INDEX).sum()


builtin.counts = builtin_counts


class Loss:
    """A loss function under the (sum, count) contract, with the counts of a window's targets."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        self.counter = getattr(fn, "counts", None)
        self.checked = self.counter is not None  # assumed per-sample counts are checked once

    def counts(self, target: torch.Tensor) -> Count | dict[str, Count]:
        return self.counter(target) if self.counter is not None else len(target)

    def terms(self, output, target: torch.Tensor) -> Terms:
        value = self.fn(output, target)
        if isinstance(value, tuple) and len(value) == 2:  # one term (checked first: this runs every micro-batch)
            terms = {"loss": value}
        elif isinstance(value, dict) and value and all(isinstance(t, tuple) and len(t) == 2 for t in value.values()):
            terms = value
        else:
            raise ConfigError(f"loss {self.name} must return (loss_sum, count) or a dict of such named terms, got "
                              f"{type(value).__name__}")
        if not self.checked:
            self.checked = True
            for term, (_, count) in terms.items():
                if int(count) != len(target):
                    raise ConfigError(
                        f"loss {self.name} counted {int(count)} items of term {term!r} in a micro-batch of "
                        f"{len(target)} samples: give the function a counts(target) attribute that returns the "
                        f"items that count, so that each window is normalized by its own total before backward")
        return terms


def window_count(counts: Count | dict[str, Count], term: str) -> Count:
    return counts[term] if isinstance(counts, dict) else counts


def window_share(terms: Terms, counts: Count | dict[str, Count]) -> torch.Tensor:
    """A micro-batch's part of its window's objective: each term's sum divided by the term's count over the
    whole window (never by k), the terms added, for one backward."""
    if len(terms) == 1 and not isinstance(counts, dict):  # the usual case, without the general one's lists
        (total, _), = terms.values()
        return total / counts
    parts = [total / window_count(counts, name) for name, (total, _) in terms.items()]
    return sum(parts[1:], parts[0])  # (sum's start, 0, would cost one more kernel)


def add_counts(a, b):
    """The counts of two parts of a window added (numbers, tensors or dicts of them)."""
    if a is None:
        return b
    if isinstance(a, dict):
        return {k: a[k] + b[k] for k in a}
    return a + b


def counts_samples(counts, n: int) -> bool:
    """Whether counts (a number, tensor or dict) are n for every term: known without reading the targets."""
    values = counts.values() if isinstance(counts, dict) else [counts]
    return all(type(v) is int and v == n for v in values)


def load_loss(spec: str, model) -> Loss:
    """`auto`: the model's own `loss` method when it has one, else the built-in; or a package.module:fn."""
    if spec != "auto":
        return Loss(load_factory(spec, "loss"), spec)
    own = getattr(model, "loss", None)
    if callable(own):
        return Loss(own, f"{type(model).__name__}.loss")
    return Loss(builtin, "cross-entropy/squared error")
