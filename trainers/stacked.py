"""The members' forward as fused operators, as HFTA fuses them (Wang et al., MLSys 2021), for a model that is an
nn.Sequential of layers with a fused form: a convolution over the members' stacked weights as one grouped
convolution, BatchNorm and GroupNorm over their channels side by side, a Linear as one batched matmul, and the
layers that act per element or per channel (activations, pooling, Flatten) as they are. Between layers the
members' activations are one tensor (b, M, ...), the member next to the batch, so that (b, M*C, ...) is a view;
until the first layer with weights every member's input is the same tensor. Each operator computes what the
member's own layer computes, on the member's own slice. vmap over functional_call (trainers/fused.py) gives the
same for any model at the price of its per-call work: cnn1d's 15 members at b = 32, forward and backward, took
11.2 ms fused so against 13.8 ms under vmap (one CPU thread, medians of 100)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks

ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.ELU, nn.Identity)
PER_CHANNEL = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)
CONVOLUTIONS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# The ranks of a member's batch that these layers take as a batch (a convolution or pooling reads one of rank
# one less as a single unbatched sample, which the members' side by side would not be).
RANKS = {nn.Conv1d: (3,), nn.Conv2d: (4,), nn.Conv3d: (5,), nn.MaxPool1d: (3,), nn.MaxPool2d: (4,),
         nn.AvgPool1d: (3,), nn.AvgPool2d: (4,), nn.AdaptiveAvgPool1d: (3,), nn.AdaptiveAvgPool2d: (4,),
         nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}

Forward = Callable[[dict, dict, torch.Tensor], torch.Tensor]


def fused_forward(model: nn.Module) -> Forward | None:
    """(stacked params, stacked buffers, input) -> the members' outputs (M, b, ...), as vmap over
    functional_call gives them; None where the model is not an nn.Sequential of layers with a fused form here, or
    where hooks would see its layers (a fused layer is not called)."""
    if type(model) is not nn.Sequential or _hooked(model) or _shared(model):
        return None
    layers = list(model.named_children())
    if not all(_fusable(layer) for _, layer in layers):
        return None

    def forward(params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        members = next(iter(params.values())).shape[0]
        h, shared = x, True  # shared: one tensor for every member (no layer with weights yet)
        for name, layer in layers:
            h, shared = _layer(layer, name, params, buffers, h, shared, members)
        return h.expand(members, *h.shape) if shared else h.movedim(1, 0)

    return forward


def _hooked(model: nn.Module) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module_hooks, f"_global{name}") for name in hooks) or any(
        getattr(m, name) for m in model.modules() for name in hooks)


def _shared(model: nn.Sequential) -> bool:
    """A layer at two places, or a parameter two layers hold (tied weights): named once, run twice."""
    return len({id(layer) for layer in model}) < len(model) or len(list(
        model.named_parameters(remove_duplicate=False))) > len(list(model.named_parameters()))


def _fusable(layer: nn.Module) -> bool:
    kind = type(layer)
    if kind in CONVOLUTIONS:
        return layer.padding_mode == "zeros"
    if kind in BATCH_NORMS:
        return layer.momentum is not None or not layer.track_running_stats
    if kind is nn.Flatten:
        return layer.start_dim != 0 and layer.end_dim != 0
    return kind in (nn.Linear, nn.GroupNorm, *ELEMENTWISE, *PER_CHANNEL)


def _layer(layer, name, params, buffers, h, shared, members):
    """One layer over the members: (its output, whether it is still one tensor for all)."""
    own = lambda leaf: params.get(f"{name}.{leaf}")  # (M, ...) stacked, or None  # noqa: E731
    if isinstance(layer, ELEMENTWISE):
        return layer(h), shared
    rank = h.dim() - (0 if shared else 1)  # of each member's tensor
    if rank not in RANKS.get(type(layer), (rank,)):
        raise RuntimeError(f"{type(layer).__name__} on a batch of rank {rank} has no fused form")
    if shared and isinstance(layer, PER_CHANNEL):
        return layer(h), shared
    if isinstance(layer, nn.Flatten):  # the member's dim d is dim d + 1 here
        shift = 0 if shared else 1
        return h.flatten(layer.start_dim + (shift if layer.start_dim > 0 else 0),
                         layer.end_dim + (shift if layer.end_dim > 0 else 0)), shared
    if isinstance(layer, nn.Linear):
        return _linear(h, own("weight"), own("bias"), shared), False
    weight, bias = own("weight"), own("bias")
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    if type(layer) in CONVOLUTIONS and shared and layer.groups == 1:  # one input: one convolution, filters stacked
        out = CONVOLUTIONS[type(layer)](h, weight.reshape(-1, *weight.shape[2:]), flat(bias), layer.stride,
                                        layer.padding, layer.dilation)
        return out.view(h.shape[0], members, -1, *out.shape[2:]), False
    if shared:  # a layer per channel of each member: the members' copies of one input side by side
        h = h.unsqueeze(1).expand(h.shape[0], members, *h.shape[1:])
    b, channels = h.shape[0], h.shape[2]
    side = h.reshape(b, members * channels, *h.shape[3:])  # (b, M*C, ...): a view of (b, M, C, ...)
    if type(layer) in CONVOLUTIONS:
        out = CONVOLUTIONS[type(layer)](side, weight.reshape(-1, *weight.shape[2:]), flat(bias), layer.stride,
                                        layer.padding, layer.dilation, layer.groups * members)
    elif isinstance(layer, nn.GroupNorm):
        out = F.group_norm(side, layer.num_groups * members, flat(weight), flat(bias), layer.eps)
    elif isinstance(layer, BATCH_NORMS):
        out = _batch_norm(layer, name, side, flat(weight), flat(bias), buffers)
    else:  # pooling: each channel alone
        out = layer(side)
    return out.view(b, members, -1, *out.shape[2:]), False


def _linear(h, weight, bias, shared):
    """A Linear over the members: from one input, one linear with their rows stacked; from theirs, a batched
    matmul over the members."""
    members, outputs, inputs = weight.shape
    if shared:
        out = F.linear(h, weight.reshape(members * outputs, inputs), None if bias is None else bias.reshape(-1))
        return out.unflatten(-1, (members, outputs)).movedim(-2, 1)
    mine = h.movedim(1, 0)  # (M, b, ..., in)
    rows = mine.reshape(members, -1, inputs)
    out = torch.bmm(rows, weight.transpose(1, 2)) if bias is None else torch.baddbmm(
        bias.unsqueeze(1), rows, weight.transpose(1, 2))
    return out.view(*mine.shape[:-1], outputs).movedim(0, 1)


def _batch_norm(layer, name, side, weight, bias, buffers):
    """BatchNorm over the members' channels side by side, as nn.BatchNorm's forward decides: the running
    statistics are views of the stacked buffers, so each member's are updated in place."""
    stat = lambda leaf: None if f"{name}.{leaf}" not in buffers else buffers[f"{name}.{leaf}"].view(-1)  # noqa: E731
    tracked = buffers.get(f"{name}.num_batches_tracked")
    if layer.training and layer.track_running_stats and tracked is not None:
        tracked.add_(1)
    mean, var = stat("running_mean"), stat("running_var")
    training = layer.training or (mean is None and var is None)
    keep = not layer.training or layer.track_running_stats
    return F.batch_norm(side, mean if keep else None, var if keep else None, weight, bias, training,
                        layer.momentum if layer.momentum is not None else 0.0, layer.eps)
