"""The tracer's hooks: PyTorch's global hooks and the patches of torch's functions that call the record of the
process (batchsweep_trace_window.Tracer), installed once torch's module has executed, and taken out again."""
from __future__ import annotations

import atexit
import os
import sys

import batchsweep_trace_sites as sites
import batchsweep_trace_window as window
from batchsweep_trace_window import Tracer


def install_hooks(tracer: Tracer) -> None:
    """The hooks, once torch's module has executed (importing it from inside an import breaks torch's own)."""
    import torch
    from torch.nn.modules import module as modules
    from torch.optim import lr_scheduler, optimizer as optimizers

    sites.TORCH = os.path.dirname(torch.__file__) + os.sep
    # (torch.compiler.is_compiling from torch 2.3 on; before, Dynamo's own, where Dynamo has been imported)
    window.compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
        lambda: "torch._dynamo" in sys.modules and sys.modules["torch._dynamo"].is_compiling())

    def compiled_in_place(*args, **kwargs):
        tracer.compiled = True

    undo = tracer.undo
    if hasattr(torch.nn.Module, "compile"):  # (torch 2.2 on)
        wrap(torch.nn.Module, "compile", compiled_in_place, undo)

    tracer.global_hooks = [modules.register_module_forward_pre_hook(tracer.before_forward),
                           modules.register_module_forward_hook(tracer.after_forward, with_kwargs=True,
                                                                always_call=True)]
    undo += [optimizers.register_optimizer_step_pre_hook(tracer.before_step).remove,
             optimizers.register_optimizer_step_post_hook(tracer.after_step).remove]

    backward = torch.autograd.backward

    def traced_backward(tensors, *args, **kwargs):
        tracer.backward(tensors)
        try:
            return backward(tensors, *args, **kwargs)
        finally:
            tracer.after_backward()

    patch(torch.autograd, "backward", traced_backward, undo)  # Tensor.backward calls it through the module

    for cls in (torch.optim.Optimizer, torch.nn.Module):
        wrap(cls, "zero_grad", lambda *a, **k: tracer.zero_grad(), undo)
    # A scheduler's constructor steps it once (_initial_step), and SequentialLR and ChainedScheduler step their
    # children: only the outermost step that the script calls is one of its own.
    schedulers = [cls for cls in vars(lr_scheduler).values() if isinstance(cls, type) and
                  issubclass(cls, (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau))]
    for cls in schedulers:
        for name in ("__init__", "_initial_step", "step"):
            if name in vars(cls):
                quieted(cls, name, tracer, announce=name == "step")

    clip = torch.nn.utils.clip_grad.clip_grad_norm_

    def traced_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
        tracer.clipping(parameters, max_norm)
        total = clip(parameters, max_norm, *args, **kwargs)
        tracer.clipped(max_norm, total.detach() if isinstance(total, torch.Tensor) else total)
        return total

    patch(torch.nn.utils, "clip_grad_norm_", traced_clip, undo)
    patch(torch.nn.utils.clip_grad, "clip_grad_norm_", traced_clip, undo)

    # Accelerate's clip (the Trainer's) takes the norm by get_total_norm and scales by clip_grads_with_norm_, the
    # public name only: clip_grad_norm_ itself calls the private one, so one clip is not seen twice.
    scale = getattr(torch.nn.utils, "clip_grads_with_norm_", None)

    def traced_scale(parameters, max_norm, total_norm, *args, **kwargs):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
        tracer.clipping(parameters, max_norm)
        scale(parameters, max_norm, total_norm, *args, **kwargs)
        tracer.clipped(max_norm, total_norm.detach() if isinstance(total_norm, torch.Tensor) else total_norm)

    if scale is not None:  # (torch 2.6 on)
        patch(torch.nn.utils, "clip_grads_with_norm_", traced_scale, undo)

    scaler = getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler  # (torch.amp's from 2.3 on)
    scaler_step = scaler.step

    def traced_scaler_step(self, optimizer, *args, **kwargs):
        before = tracer.steps
        result = scaler_step(self, optimizer, *args, **kwargs)
        if tracer.steps == before:
            tracer.scaler_skipped(optimizer)
        return result

    patch(scaler, "step", traced_scaler_step, undo)
    wrap(torch.utils.data.DataLoader, "__iter__", tracer.loader, undo)
    if tracer.noise:
        sizes = (tuple, list, torch.Size)
        counted(torch, "randint", lambda a, k: next((x[0] for x in (k.get("size"), *a) if isinstance(x, sizes) and x),
                                                   None), tracer.drawn["randint"], undo)
        counted(torch, "randperm", lambda a, k: k.get("n", a[0] if a else None), tracer.drawn["randperm"], undo)
    atexit.register(tracer.end)
    undo.append(lambda: atexit.unregister(tracer.end))


def uninstall(tracer: Tracer) -> None:
    """Every hook and patch of install_hooks taken out again, last first (benchmarks/tracer_overhead.py switches the
    tracer on and off between blocks of windows of one process)."""
    for handle in tracer.global_hooks + tracer.own_hooks:
        handle.remove()
    tracer.global_hooks, tracer.own_hooks = [], []
    while tracer.undo:
        tracer.undo.pop()()


def patch(owner, name: str, value, undo: list) -> None:
    """owner.name = value, with how to put the original back."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    undo.append(lambda: setattr(owner, name, original))


def counted(module, name: str, size, counts: dict, undo: list) -> None:
    """module.name counts the sizes `size(args, kwargs)` gives of its calls."""
    original = getattr(module, name)

    def traced(*args, **kwargs):
        n = size(args, kwargs)
        if isinstance(n, int):
            counts[n] = counts.get(n, 0) + 1
        return original(*args, **kwargs)

    patch(module, name, traced, undo)


def quieted(cls, name: str, tracer: Tracer, announce: bool) -> None:
    """cls.name with the scheduler steps inside it left out; `announce`: it is a step, counted where outermost."""
    original = getattr(cls, name)

    def traced(*args, **kwargs):
        if announce:
            tracer.scheduler_step(args[0])
        tracer.scheduling += 1
        try:
            return original(*args, **kwargs)
        finally:
            tracer.scheduling -= 1

    traced.__wrapped__ = original
    patch(cls, name, traced, tracer.undo)


def wrap(cls, name: str, before, undo: list) -> None:
    """cls.name calls `before` first, with the same arguments."""
    original = getattr(cls, name)

    def traced(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)

    traced.__wrapped__ = original
    patch(cls, name, traced, undo)
