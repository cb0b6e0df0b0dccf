"""Evaluation: the test set's loss, accuracy and top-5, and the config's own metrics, each a (sum, count)
added up over the eval batches and divided once at the end."""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .batches import aligned, forward
from .errors import ConfigError
from .imports import load_factory
from .losses import IGNORE_INDEX, Loss, builtin, unloggable

Metric = Callable[[Any, torch.Tensor], dict[str, tuple]]  # (output, target) -> {name: (sum, count)}
OWN = ("acc", "top5", "loss", "perplexity")  # names a metric function may not take: batchsweep logs them


@torch.inference_mode()
def evaluate(model: nn.Module, batches: Iterable[tuple[Any, torch.Tensor]], loss: Loss | None = None,
             precision: str = "fp32", metrics: list[Metric] = ()) -> dict[str, float]:
    """In eval mode (the previous mode restored), over `batches` of (inputs, target): `val_loss`, the mean loss
    over the counted items (the sum of the terms' means); `val_acc` over them (samples, or tokens), and
    `val_top5` with 10 classes or more, for integer targets (NaN for others); `val_<name>` for each term of
    each metric function. Every sum stays on the device until the end."""
    loss = loss or Loss(builtin, "built-in")
    was_training = model.training
    model.eval()
    terms, measured = Sums(), Sums()
    for inputs, target in batches:
        with torch.autocast(target.device.type, torch.bfloat16, enabled=precision == "bf16"):
            output = forward(model, inputs)
            terms.add(loss.terms(output, target))
        measured.add(accuracy(output, target, loss.shift))
        for metric in metrics:
            own = metric(output, target)
            clash = set(own) & set(OWN)
            if clash:
                raise ConfigError(f"metric {getattr(metric, '__name__', metric)} returns {clash.pop()!r}, a name "
                                  f"batchsweep logs itself: rename it")
            odd = unloggable(own)
            if odd:
                raise ConfigError(f"metric {getattr(metric, '__name__', metric)} returns {odd}")
            measured.add(own)
    model.train(was_training)
    row = {"val_loss": sum(terms.means().values()), "val_acc": math.nan}
    return {**row, **{f"val_{name}": value for name, value in measured.means().items()}}


class Sums(dict):
    """(sum, count) pairs added up by name."""

    def add(self, pairs: dict[str, tuple]) -> None:
        for name, (total, count) in pairs.items():
            old = self.get(name, (0, 0))
            # (in float64: a count may come as float32, exact only to 2**24, as the built-in loss's tokens do)
            self[name] = tuple(before + (now.double() if torch.is_tensor(now) else now)
                               for before, now in zip(old, (total, count)))

    def means(self) -> dict[str, float]:
        return {name: float(total) / float(count) if float(count) else math.nan
                for name, (total, count) in self.items()}


def accuracy(output, target: torch.Tensor, shift: int) -> dict[str, tuple]:
    """Accuracy over the samples or counted tokens of integer targets, and top-5 with 10 classes or more, of
    the logits the built-in loss scores."""
    out, target = aligned(output, target, shift)
    if target.is_floating_point() or not torch.is_tensor(out) or out.dim() != target.dim() + 1:
        return {}
    counted = target != IGNORE_INDEX
    items = counted.sum()
    found = {"acc": (((out.argmax(-1) == target) & counted).sum(), items)}
    if out.shape[-1] >= 10:
        top = (out.topk(5, dim=-1).indices == target.unsqueeze(-1)).any(-1)
        found["top5"] = ((top & counted).sum(), items)
    return found


def load_metrics(specs: str) -> list[Metric]:
    """The metric functions named in `specs` (comma-separated package.module:fn)."""
    return [load_factory(spec.strip(), "metrics") for spec in specs.split(",") if spec.strip()]
