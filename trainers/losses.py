"""Losses as (sum, count): the sum of per-item losses over the items that count (samples, or tokens that
are not IGNORE_INDEX) and their number, or a dict of such named terms. The loop divides each term by its
count over the whole window, never by k, so a window's gradient is exactly the gradient of the mean over
all its counted items, whatever each micro-batch holds.

With `counts(target)` (a number, or a dict by term) the window's counts are known before its first backward,
from the targets, as the transformers library counts a window's tokens first, and each micro-batch's sums are
divided as they come. Without it the loss's own counts are enough: the window's micro-batches backward their
plain sums, the counts are added up (over the ranks under torchrun), and the gradients are divided by the total
before the step (`divide_after`). That is exact to rounding, not bitwise the same as dividing first. Its terms
must then count the same items, which the first micro-batch checks.

The built-in loss scores the model's logits (trainers/batches.py: a tensor, `.logits`, a tuple's first
element) against the labels the causal shift keeps; a loss of the user's or the model's own is given the
output and the target as they are.
"""
from __future__ import annotations

import re
from typing import Callable, Union

import torch
import torch.nn.functional as F

from .batches import aligned, label_shift
from .errors import ConfigError
from .imports import load_factory

IGNORE_INDEX = -100  # a target that does not count (padding), as in torch's cross_entropy
SUM = 2  # at::Reduction::Sum, for aten ops called directly
Count = Union[int, torch.Tensor]
Terms = dict[str, tuple[torch.Tensor, Count]]
# A loss term's or a metric function's name becomes an MLflow metric's and a report column's: MLflow takes no
# other characters.
NAME = re.compile(r"\w[\w.\- :]{0,199}")


def unloggable(names) -> str | None:
    """What to say of the first of `names` that MLflow cannot log, or None where it takes them all."""
    odd = next((name for name in names if not (isinstance(name, str) and NAME.fullmatch(name))), None)
    return None if odd is None else (f"{odd!r}, a name MLflow cannot log: use letters, digits, spaces and _ - . : "
                                     f"(at most 200)")


def builtin(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, Count]:
    """Cross-entropy for integer targets (one class per sample, or per token with IGNORE_INDEX for padding),
    squared error for float targets (per sample)."""
    # (shape[0], not len(): a tensor's __len__ runs Python code, a third of a µs every micro-batch)
    if target.is_floating_point():
        return (output - target.view_as(output)).pow(2).sum(), target.shape[0]
    if target.dim() == 1:
        return F.cross_entropy(output, target, ignore_index=IGNORE_INDEX, reduction="sum"), target.shape[0]
    return token_cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) over the tokens that are not IGNORE_INDEX, from cross-entropy's own two kernels: its
    log-softmax, then nll_loss_forward, which returns the count of the targets it did not ignore beside the
    sum. Counting them apart would be two more kernels a micro-batch. Bitwise F.cross_entropy's sum, autocast's
    cast to float32 included."""
    if logits.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(logits.device.type):
        logits = logits.float()
    return torch.ops.aten.nll_loss_forward(F.log_softmax(logits, -1), target, None, SUM, IGNORE_INDEX)


def builtin_counts(target: torch.Tensor) -> Count:
    if target.is_floating_point() or target.dim() == 1:
        return len(target)  # a Python number: no kernel, no synchronization
    return (target != IGNORE_INDEX).sum()


builtin.counts = builtin_counts


class Loss:
    """A loss function under the (sum, count) contract, with the counts of a window's targets."""

    def __init__(self, fn: Callable, name: str, shift: int = 0):
        self.fn, self.name = fn, name
        self.shift = shift  # the model's causal shift: the built-in loss and accuracy score the labels it keeps
        self.counter = getattr(fn, "counts", None)
        self.divide_after = self.counter is None  # the window's count is the sum of the loss's own counts
        self.checked = not self.divide_after  # that its terms count alike is checked once

    def counts(self, target: torch.Tensor) -> Count | dict[str, Count]:
        if self.counter is None:
            return len(target)
        shifted = self.fn is builtin and self.shift and target.dim() > 1
        return self.counter(target[:, self.shift:] if shifted else target)

    def counts_rows(self, target: torch.Tensor) -> bool:
        """Whether the counts of any targets like these are their number of rows, known without reading them:
        the built-in loss on one target a sample, or a loss that counts for itself."""
        return self.counter is None or (self.counter is builtin_counts and (target.is_floating_point()
                                                                           or target.dim() == 1))

    def share(self, terms: Terms, counts: Count | dict[str, Count]) -> torch.Tensor:
        """A micro-batch's part of its window's objective, for one backward: with the counts known first, each
        term divided by its window count; otherwise the terms' plain sums."""
        if not self.divide_after:
            return window_share(terms, counts)
        totals = [total for total, _ in terms.values()]
        return sum(totals[1:], totals[0])

    def terms(self, output, target: torch.Tensor) -> Terms:
        if self.fn is builtin:
            output, target = aligned(output, target, self.shift)
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
            odd = unloggable(terms)
            if odd:
                raise ConfigError(f"loss {self.name} names a term {odd}")
            counted = {term: int(count) for term, (_, count) in terms.items()}
            if len(set(counted.values())) > 1:
                raise ConfigError(
                    f"loss {self.name}'s terms count different items in one micro-batch ("
                    f"{', '.join(f'{t}: {c}' for t, c in counted.items())}): give the function a counts(target) "
                    f"attribute that returns each term's count, so that each is normalized by its own window total")
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
    shift = label_shift(model)
    if spec != "auto":
        return Loss(load_factory(spec, "loss"), spec, shift)
    own = getattr(model, "loss", None)
    if callable(own) and not isinstance(own, torch.nn.Module):  # (a model may hold its loss as a module)
        return Loss(own, f"{type(model).__name__}.loss", shift)
    return Loss(builtin, "cross-entropy/squared error", shift)
