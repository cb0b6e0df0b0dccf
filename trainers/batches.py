"""Samples and outputs as models and datasets shape them, at the edge of the loop.

A sample (and a collated batch) is an (input, target) pair, or a mapping whose `label_key` entry ("labels",
as in transformers) is the target and whose other entries are the model's keyword arguments. An output is a
tensor of logits, an object with `.logits` (transformers' ModelOutput), or a tuple whose first element is the
logits. A causal language model scores position t against label t+1 (`label_shift`), as transformers' own
loss does with labels that are the inputs."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from .errors import ConfigError


def split(batch: Any, label_key: str) -> tuple[Any, Any]:
    """(inputs, target) of a sample or a collated batch."""
    if isinstance(batch, Mapping):
        if label_key not in batch:
            raise ConfigError(f"a sample is a mapping without the label key {label_key!r} (it has "
                              f"{', '.join(map(str, batch))}): set label_key to the entry that holds the target")
        return {k: v for k, v in batch.items() if k != label_key}, batch[label_key]
    inputs, target = batch
    return inputs, target


def forward(model: nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def apply(inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` on the input tensor, or on every tensor of a mapping (other entries pass as they are)."""
    if isinstance(inputs, Mapping):
        return {k: fn(v) if torch.is_tensor(v) else v for k, v in inputs.items()}
    return fn(inputs)


def rows(inputs: Any) -> int:
    if isinstance(inputs, Mapping):
        return len(next(v for v in inputs.values() if torch.is_tensor(v)))
    return len(inputs)


def cut(inputs: Any, target: torch.Tensor, size: int) -> list[tuple[Any, torch.Tensor]]:
    """A batch as parts of `size` rows (the last may be shorter)."""
    starts = range(0, rows(inputs), size)
    return [(apply(inputs, lambda t, s=s: t[s:s + size]), target[s:s + size]) for s in starts]


def shape(inputs: Any) -> Any:
    """One sample's input shape, or for a mapping the shapes of its tensors by key."""
    if isinstance(inputs, Mapping):
        return {k: tuple(torch.as_tensor(v).shape) for k, v in inputs.items()}
    return tuple(torch.as_tensor(inputs).shape)


def logits(output: Any) -> Any:
    """The logits of an output: itself, its `.logits`, or a tuple's first element (anything else as it is)."""
    if torch.is_tensor(output):
        return output
    found = getattr(output, "logits", None)
    if torch.is_tensor(found):
        return found
    if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
        return output[0]
    return output


def label_shift(model: nn.Module) -> int:
    """1 for a causal language model whose labels are its inputs (position t predicts label t+1), else 0: a
    model's own `label_shift` attribute, else a transformers model that generates and is not an
    encoder-decoder."""
    own = getattr(model, "label_shift", None)
    if own is not None:
        return int(own)
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    if config is not None and callable(can_generate) and not getattr(config, "is_encoder_decoder", False):
        try:
            return int(bool(can_generate()))
        except Exception:  # a model class that answers only on an instance with a generation config
            return 0
    return 0


def aligned(output: Any, target: torch.Tensor, shift: int) -> tuple[Any, torch.Tensor]:
    """(logits, target) position by position: with a shift, the last position's logits and the first label
    are dropped, so that only the labels the shift keeps count."""
    out = logits(output)
    if shift and torch.is_tensor(out) and out.dim() >= 3:
        return out[:, :-shift], target[:, shift:]
    return out, target
