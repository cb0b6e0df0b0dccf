"""The members of a fused group whose windows end at the same micro-batch, stepped together: torch.optim's own
foreach update (SGD, AdamW) once over every member whose param group has the same settings, instead of one
`optimizer.step()` a member. On the CPU a small model's step is mostly torch.optim's per-call and per-tensor
work (cnn1d: 11 tensors, about 0.2 ms a step). Each member's state stays in its own optimizer (state[p]:
momentum_buffer; exp_avg, exp_avg_sq, step), initialized by that optimizer's own `_init_group`, so that its
checkpoint, its resume and its probes are a solo run's; its probes see before_step and after_step in a solo
run's order."""
from __future__ import annotations

import torch
from torch.optim import adam, optimizer, sgd

from .loop import Trainee


# Where AdamW is Adam with decoupled weight decay (recent torch), it shares Adam's _init_group and update; before,
# its members step alone.
KINDS = ((torch.optim.SGD, torch.optim.AdamW) if issubclass(torch.optim.AdamW, torch.optim.Adam)
         else (torch.optim.SGD,))


def batched(t: Trainee) -> bool:
    """Whether a window end of `t` can be part of a batched update: SGD or AdamW with none of the settings that
    change torch.optim's path (fused, capturable, differentiable), no clipping, a loss divided before its
    backward, and no step hooks (which a batched update would not call). Otherwise its own `end_window`."""
    opt = t.optimizer
    return (type(opt) in KINDS and not t.clip and not t.loss.divide_after
            and not (opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                     or optimizer._global_optimizer_pre_hooks or optimizer._global_optimizer_post_hooks)
            and not any(g["fused"] or g["differentiable"] or g.get("capturable") for g in opt.param_groups))


def step_together(ends: list[tuple[Trainee, int, int]]) -> None:
    """Each (trainee, step, window size) of `ends` (all `batched`) steps once and zeroes its gradients, as
    `end_window` steps one."""
    for t, step, size in ends:
        t.probes.before_step(step, size)
    # By optimizer and settings: the kind, one param group's settings, each member's (optimizer, param group).
    updates: dict[tuple, tuple[type, dict, list]] = {}
    for t, _, _ in ends:
        for group in t.optimizer.param_groups:
            settings = tuple((name, value) for name, value in group.items() if name != "params")
            kind = type(t.optimizer)
            updates.setdefault((kind, settings), (kind, group, []))[2].append((t.optimizer, group))
    with torch.no_grad():
        for kind, group, members in updates.values():
            (_sgd if kind is torch.optim.SGD else _adamw)(group, members)
    for t, step, _ in ends:
        t.probes.after_step(step)
        t.optimizer.zero_grad(set_to_none=True)


def _sgd(group: dict, members: list) -> None:
    params, grads, buffers, owners, sparse = [], [], [], [], False
    for opt, own in members:
        start = len(params)
        sparse |= opt._init_group(own, params, grads, buffers)
        owners += [opt] * (len(params) - start)
    sgd.sgd(params, grads, buffers, has_sparse_grad=sparse, foreach=True, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"], nesterov=group["nesterov"],
            maximize=group["maximize"])
    if group["momentum"]:  # a first step's buffers are new: into each member's state, as SGD.step puts them
        for opt, p, buffer in zip(owners, params, buffers):
            opt.state[p]["momentum_buffer"] = buffer


def _adamw(group: dict, members: list) -> None:
    lists = [[] for _ in range(6)]  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps
    complex_ = False
    for opt, own in members:  # (creates a first step's state in the member's optimizer)
        complex_ |= opt._init_group(own, *lists)
    beta1, beta2 = group["betas"]
    adam.adam(*lists, foreach=True, has_complex=complex_, decoupled_weight_decay=group["decoupled_weight_decay"],
              amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
