"""batchsweep's tracer: what a training script does, seen from inside its own process through PyTorch's global
hooks, with no edit to the script. sitecustomize.py (beside this file, on PYTHONPATH) installs it in every Python
process of a command that batchsweep launches, children included; it needs torch and nothing else, so that it
runs in whatever interpreter the command names.

It writes one JSON line per optimizer step into $BATCHSWEEP_TRACE/trace-<pid>.jsonl:
    {"step": 3, "events": "ZFBFBCS", "samples": [8, 8], "fingerprint": [s, s2], "lrs": [0.1],
     "grad_norm": 1.7, "clip": 1.0, "skipped": false, "wall_s": 0.012, ...}
(steps of the first optimizer that steps; a second one's, a GAN's say, are not windows), and at the process's end
the DataLoaders it iterated ({"loaders": [[size, batch], ...]}) and on a GPU the allocator's peak.
`events` are what happened since the step before, in order: F a training forward of a model (a root module call
with parameters, in training mode, with grad enabled), B backward(), Z zero_grad(), C clip_grad_norm_(), L a
scheduler step, S the optimizer step (K: a step that a GradScaler skipped). `samples` are the first dimension of
the model's first tensor input at each micro-batch (the forwards before each backward), `fingerprint` the sum and
the sum of squares of those inputs over the window, in float64: the same samples give the same two numbers. The
model is the first module called in training mode with grad enabled and parameters, outside any other module's
call (global hooks find it; then a hook of its own follows it, so that no other module pays for a hook).

Variables (all optional but the first):
    BATCHSWEEP_TRACE        the folder it writes into
    BATCHSWEEP_TRACE_STOP   stop the process (exit status 0) after this many optimizer steps
    BATCHSWEEP_TRACE_SAVE   "1": save the model's state dict at its first training forward (start.pt, the weights
                            before any update) and at the stop or the process's end (state.pt)
    BATCHSWEEP_TRACE_GRADS  steps (1, 3, ...) whose window gradient, before any clipping, is saved (grad-<s>.pt);
                            "last": the last step's, whichever it is (a copy is kept at every step)
    BATCHSWEEP_TRACE_LOSS   "1": record each backward's loss (a synchronization per micro-batch on a GPU)
    BATCHSWEEP_TRACE_DATA   "1": the fingerprint of each window's inputs
    BATCHSWEEP_TRACE_NOISE  "1": each micro-batch's own gradient's squared norm (`micro_sq`), for the noise scale,
                            in one window of NOISE_EVERY (not across ranks)
"""
from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import sys
import time

FLUSH_EVERY = 32  # steps held before their figures are read (a .item() on a GPU waits for the step's kernels)
# The noise scale's windows: one in this many. A measured micro-batch costs a copy of the gradient and two passes
# over it (three foreach operations), as the trainer's (trainers/noise.py): about 15% of a micro-batch of the
# example GPT loop, so a few windows are measured, as the trainer does (about 2% a micro-batch on average).
NOISE_EVERY = 8


class Tracer:
    def __init__(self, folder: str):
        self.folder = folder
        rank = os.environ.get("RANK")  # torchrun's, accelerate's
        self.path = os.path.join(folder, f"trace-{'r' + rank + '-' if rank else ''}{os.getpid()}.jsonl")
        self.stop = int(os.environ.get("BATCHSWEEP_TRACE_STOP") or 0)
        self.save = os.environ.get("BATCHSWEEP_TRACE_SAVE") == "1"
        wanted = [s.strip() for s in os.environ.get("BATCHSWEEP_TRACE_GRADS", "").split(",") if s.strip()]
        self.grads = {int(s) for s in wanted if s != "last"}
        self.last_grads = "last" in wanted  # the last step's, whichever it is: kept at each step, saved at the end
        self.kept = None  # (step, gradients) of the latest step, where last_grads
        self.losses = os.environ.get("BATCHSWEEP_TRACE_LOSS") == "1"
        self.data = os.environ.get("BATCHSWEEP_TRACE_DATA") == "1"
        # Each micro-batch's own gradient's squared norm, for the noise scale: not across ranks, whose micro-batch
        # gradients are their own until the window's all-reduce.
        self.noise = os.environ.get("BATCHSWEEP_TRACE_NOISE") == "1" and int(os.environ.get("WORLD_SIZE", "1")) == 1
        self.before = None  # in a measured window: the accumulated gradient as of the backward before
        self.loaders: set = set()  # (len(dataset), batch_size) of each DataLoader iterated
        self.cuda = None  # the model's GPU, where it trains on one
        self.global_hooks: list = []  # removed once the model is found
        self.depth = 0  # nesting of module calls: 0 outside any
        self.model = None  # the first module seen training: its state dict is what is saved
        self.optimizers: list = []  # by first step: the index is a step's "opt"
        self.steps = 0  # of the first optimizer
        self.pending: list[dict] = []
        self.ended = False
        self._window()
        self.last = None  # the end of the step before (the first step: from its first forward)

    def _window(self) -> None:
        self.events: list[str] = []
        self.samples: list[int] = []
        self.forward_samples = None  # of the current micro-batch: its first training forward's
        self.shape = None  # of the window's first input
        self.sums = None  # [sum, sum of squares] of the window's inputs (tensors until written)
        self.tokens = None
        self.loss_values: list = []
        self.micro_sq: list = []  # per micro-batch: its own gradient's squared norm (BATCHSWEEP_TRACE_NOISE)
        self.before = None
        self.clip = None  # (max_norm, total norm before clipping) of the window's last clip

    # -- the hooks ------------------------------------------------------------------------------------------------
    def before_forward(self, module, args) -> None:
        self.depth += 1

    def after_forward(self, module, args, kwargs, output) -> None:
        """A global hook, until the model is found: every module's call, of which the outermost count."""
        self.depth -= 1
        if self.depth or not module.training:
            return
        import torch

        if not torch.is_grad_enabled() or next(module.parameters(), None) is None:
            return  # evaluation, or a loss module
        self.model = module  # its weights before any update: the first training forward comes before it
        if self.save:
            self._save_state("start.pt")
        device = next(module.parameters()).device
        if device.type == "cuda":  # the allocator's peak from here on: training's, as the trainer measures it
            self.cuda = device
            torch.cuda.reset_peak_memory_stats(device)
        # From here on the model's own hook: global ones would put every submodule's call through them.
        for handle in self.global_hooks:
            handle.remove()
        module.register_forward_hook(self.model_forward, with_kwargs=True)
        self.model_forward(module, args, kwargs, output)

    def model_forward(self, module, args, kwargs, output) -> None:
        import torch

        if not module.training or not torch.is_grad_enabled():
            return
        if self.last is None:
            self.last = time.perf_counter()
        x = first_tensor(args, kwargs)
        self.events.append("F")
        if x is None:
            return
        if self.forward_samples is None:
            self.forward_samples = int(x.shape[0]) if x.dim() else 1
        if self.shape is None:
            self.shape = list(x.shape)
        if self.data:
            with torch.no_grad():
                v = x.detach().double()
                sums = torch.stack([v.sum(), (v * v).sum()])
            self.sums = sums if self.sums is None else self.sums + sums
        labels = kwargs.get("labels")  # per token where they have a sequence dimension (a class per sample: none)
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
            counted = (labels != -100).sum()
            self.tokens = counted if self.tokens is None else self.tokens + counted

    def backward(self, tensors) -> None:
        import torch

        self.events.append("B")
        self.samples.append(self.forward_samples or 0)
        self.forward_samples = None
        if self.losses and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self.loss_values.append(tensors.detach().double().reshape(()))

    def after_backward(self) -> None:
        """In a measured window: this micro-batch's own gradient, the accumulated one less the one before."""
        if not self.noise or self.model is None or (self.steps + 1) % NOISE_EVERY:
            return
        import torch

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads or (self.before is not None and len(self.before) != len(grads)):
            self.micro_sq.append(None)  # (a tensor that got its first gradient now: this window is not measured)
            return
        with torch.no_grad():
            own = grads if self.before is None else torch._foreach_sub(grads, self.before)
            self.micro_sq.append(torch.stack([n.double() for n in torch._foreach_norm(own)]).pow(2).sum())
            if self.before is None:
                self.before = [g.clone() for g in grads]
            else:
                torch._foreach_copy_(self.before, grads)

    def loader(self, loader) -> None:
        """A DataLoader's iteration starts: its data set's size and batch, the size the noise scale corrects for."""
        # (accelerate's prepared loader, as transformers' Trainer builds it, keeps its batch in its batch sampler)
        batch = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        try:
            self.loaders.add((len(loader.dataset), batch))
        except TypeError:  # an iterable data set has no length
            pass

    def zero_grad(self) -> None:
        self.events.append("Z")

    def scheduler_step(self) -> None:
        self.events.append("L")

    def clipping(self, parameters, max_norm) -> None:
        """Before clip_grad_norm_ runs: the gradient it is about to cut is the window's."""
        self.events.append("C")
        self._gradient()

    def clipped(self, max_norm, total) -> None:
        self.clip = (float(max_norm), total)

    def before_step(self, optimizer, args, kwargs) -> None:
        if optimizer not in self.optimizers:
            self.optimizers.append(optimizer)
        if self.optimizers.index(optimizer):
            return  # another optimizer's (a GAN's second, say): the first one's steps are the windows
        self.lrs = [group.get("lr") for group in optimizer.param_groups]
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # (args[0] is the optimizer)
        if closure is None:
            self._at_step(optimizer)
            return None

        def traced_closure():  # Lightning's: the window's last forward and backward run inside step()
            loss = closure()
            self._at_step(optimizer)
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": traced_closure}
        return (args[0], traced_closure, *args[2:]), kwargs

    def _at_step(self, optimizer) -> None:
        """The window's gradient is complete: kept where asked for, and its norm (unless a clip took both)."""
        if "C" not in self.events:
            self._gradient()
        self.norm = None if "C" in self.events else grad_norm(optimizer)

    def after_step(self, optimizer, args, kwargs) -> None:
        if self.optimizers.index(optimizer):
            return
        self._end_window("S")

    def scaler_skipped(self, optimizer) -> None:
        self.lrs = [group.get("lr") for group in optimizer.param_groups]
        self.norm = None if "C" in self.events else grad_norm(optimizer)
        self._end_window("K")

    # -- records --------------------------------------------------------------------------------------------------
    def _end_window(self, mark: str) -> None:
        self.steps += 1
        self.events.append(mark)
        now = time.perf_counter()
        row = {"step": self.steps, "events": "".join(self.events), "samples": self.samples,
               "fingerprint": self.sums, "tokens": self.tokens, "shape": self.shape, "lrs": self.lrs,
               "skipped": mark == "K",
               "grad_norm": self.clip[1] if self.clip else self.norm, "clip": self.clip[0] if self.clip else None,
               "losses": self.loss_values or None, "wall_s": now - (self.last or now),
               "micro_sq": self.micro_sq if len(self.micro_sq) == len(self.samples) and None not in self.micro_sq
               else None,
               "optimizers": len(self.optimizers) if len(self.optimizers) > 1 else None}
        self.last = now
        self.pending.append(row)
        self._window()
        if self.stop and self.steps >= self.stop:
            self.end()
            os._exit(0)  # the script's own end would train on: its cleanup is not ours to run
        if len(self.pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        with open(self.path, "a") as f:
            for row in self.pending:
                f.write(json.dumps({key: plain(value) for key, value in row.items() if value is not None}) + "\n")
        self.pending = []

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.loaders and self.steps:
            self.pending.append({"loaders": sorted(self.loaders, key=str)})
        if self.cuda is not None and self.steps:
            import torch

            self.pending.append({"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.cuda)})
        self.flush()
        if self.save and self.model is not None:
            self._save_state("state.pt")
        if self.kept is not None and self.kept[0] == self.steps:
            import torch

            torch.save(self.kept[1], os.path.join(self.folder, f"grad-{self.steps}.pt"))

    def _save_state(self, name: str) -> None:
        import torch

        if self.model is not None:
            state = {key: value.detach().cpu().clone() for key, value in self.model.state_dict().items()}
            torch.save(state, os.path.join(self.folder, name))

    def _gradient(self) -> None:
        """The window's gradient as it is now (before a clip, or before the step), where it is asked for."""
        import torch

        step = self.steps + 1
        if self.model is None or not (step in self.grads or self.last_grads):
            return
        grads = {name: p.grad.detach().cpu().clone() for name, p in self.model.named_parameters()
                 if p.grad is not None}
        if step in self.grads:
            torch.save(grads, os.path.join(self.folder, f"grad-{step}.pt"))
        if self.last_grads:
            self.kept = (step, grads)


def first_tensor(args, kwargs):
    """The model's input: its first tensor argument, or its first tensor keyword (input_ids, x, ...)."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def grad_norm(optimizer):
    """The 2-norm of the gradients the optimizer is about to apply, as a tensor (read when written)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    with torch.no_grad():
        norms = torch._foreach_norm([g.detach() for g in grads])
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device).double() for n in norms]))


def plain(value):
    """A row's value as JSON takes it: tensors read here, once per FLUSH_EVERY steps."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


# -- installation -------------------------------------------------------------------------------------------------
def install_hooks(tracer: Tracer) -> None:
    """The hooks, once torch's module has executed (importing it from inside an import breaks torch's own)."""
    import torch
    from torch.nn.modules import module as modules
    from torch.optim import lr_scheduler, optimizer as optimizers

    tracer.global_hooks = [modules.register_module_forward_pre_hook(tracer.before_forward),
                           modules.register_module_forward_hook(tracer.after_forward, with_kwargs=True,
                                                                always_call=True)]
    optimizers.register_optimizer_step_pre_hook(tracer.before_step)
    optimizers.register_optimizer_step_post_hook(tracer.after_step)

    backward = torch.autograd.backward

    def traced_backward(tensors, *args, **kwargs):
        tracer.backward(tensors)
        try:
            return backward(tensors, *args, **kwargs)
        finally:
            tracer.after_backward()

    torch.autograd.backward = traced_backward  # Tensor.backward calls it through the module

    for cls in (torch.optim.Optimizer, torch.nn.Module):
        wrap(cls, "zero_grad", lambda *a, **k: tracer.zero_grad())
    for cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
        wrap(cls, "step", lambda *a, **k: tracer.scheduler_step())

    clip = torch.nn.utils.clip_grad.clip_grad_norm_

    def traced_clip(parameters, max_norm, *args, **kwargs):
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
        tracer.clipping(parameters, max_norm)
        total = clip(parameters, max_norm, *args, **kwargs)
        tracer.clipped(max_norm, total.detach() if isinstance(total, torch.Tensor) else total)
        return total

    torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = traced_clip

    scaler_step = torch.amp.GradScaler.step

    def traced_scaler_step(self, optimizer, *args, **kwargs):
        before = tracer.steps
        result = scaler_step(self, optimizer, *args, **kwargs)
        if tracer.steps == before and (not tracer.optimizers or tracer.optimizers[0] is optimizer):
            tracer.scaler_skipped(optimizer)
        return result

    torch.amp.GradScaler.step = traced_scaler_step
    wrap(torch.utils.data.DataLoader, "__iter__", tracer.loader)
    atexit.register(tracer.end)


def wrap(cls, name: str, before) -> None:
    """cls.name calls `before` first, with the same arguments."""
    original = getattr(cls, name)

    def traced(*args, **kwargs):
        before(*args, **kwargs)
        return original(*args, **kwargs)

    traced.__wrapped__ = original
    setattr(cls, name, traced)


class AfterTorch(importlib.abc.MetaPathFinder):
    """Runs `then` once torch's module has executed: its spec's loader is wrapped for that one import."""

    def __init__(self, then):
        self.then = then

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                spec.loader = module.__loader__ = loader  # torch sees its own loader afterwards
                loader.exec_module(module)
                then()

        spec.loader = Loader()
        return spec


def watch_writes(folder: str) -> None:
    """Each file this process opens for writing with open() (torch.save, numpy, json, logging), once, as a line of
    writes-<pid>.txt, written at once: the sweep compares them between trials that run at the same time."""
    seen, out = set(), []

    def hook(event, args):
        if event != "open" or not isinstance(args[1], str) or not any(c in args[1] for c in "wax+"):
            return  # (os.open's mode is None: its own write below comes back here and stops)
        name = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes)) else None  # (not a file descriptor)
        if name is None or "\n" in name or os.path.abspath(name) in seen:
            return
        seen.add(os.path.abspath(name))
        if not out:
            out.append(os.open(os.path.join(folder, f"writes-{os.getpid()}.txt"),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        os.write(out[0], os.fsencode(os.path.abspath(name) + "\n"))

    sys.addaudithook(hook)


def start() -> None:
    folder = os.environ.get("BATCHSWEEP_TRACE")
    if not folder or not os.path.isdir(folder):
        return
    watch_writes(folder)
    tracer = Tracer(folder)
    if "torch" in sys.modules:
        install_hooks(tracer)
    else:
        sys.meta_path.insert(0, AfterTorch(lambda: install_hooks(tracer)))
