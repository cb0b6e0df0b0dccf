"""batchsweep's tracer: what a training script does, seen from inside its own process through PyTorch's global
hooks, with no edit to the script. sitecustomize.py (beside this file, on PYTHONPATH) installs it in every Python
process of a command that batchsweep launches, children included; it needs torch and nothing else, so that it
runs in whatever interpreter the command names.

It writes one JSON line per optimizer step into $BATCHSWEEP_TRACE/trace-<pid>.jsonl:
    {"step": 3, "events": "ZFBFBCS", "samples": [8, 8], "fingerprint": [s, s2], "lrs": [0.1],
     "grad_norm": 1.7, "clip": 1.0, "skipped": false, "wall_s": 0.012, ...}
(the steps of every optimizer, each window holding what happened since the step before, whichever optimizer made
it; "opt" numbers them where more than one stepped), and at the process's end the model ({"trained": [...],
"random_modules": [...], "random_draws": [...]}), the DataLoaders it iterated ({"loaders": [[size, batch], ...]}),
the places of its calls ({"sites": [...]}) and on a GPU the allocator's peak.
`events` are what happened since the step before, in order: F a training forward of a model (a root module call
with parameters, in training mode, with grad enabled), B backward(), Z zero_grad(), C clip_grad_norm_(), L a
scheduler step (a scheduler's own construction, and the steps a SequentialLR or ChainedScheduler makes of its
children, are not the script's), S the optimizer step (K: a step that a GradScaler skipped); `at` names, for each
event but F, the place in the script that made the call (an index into "sites": the caller's file and line outside
torch). `samples` are the first dimension of the first model's first tensor input at each micro-batch (the forwards
before each backward), `fingerprint` the sum and the sum of squares of those inputs over the window, in float64: the
same samples give the same two numbers. The first model is the first module called in training mode with grad
enabled and parameters, outside any other module's call; the models whose weights are saved are those of the modules
so called whose parameters the optimizer trains (a frozen encoder called first is not one), chosen at the first step
(global hooks find them until then; then a hook of the first one's own follows it, so that no other module pays).

Variables (all optional but the first):
    BATCHSWEEP_TRACE        the folder it writes into
    BATCHSWEEP_TRACE_STOP   stop the process (exit status 0) after this many optimizer steps
    BATCHSWEEP_TRACE_SAVE   "1": save the model's state dict at its first training forward (start.pt, the weights
                            before any update) and at the stop or the process's end (state.pt)
    BATCHSWEEP_TRACE_GRADS  steps (1, 3, ...) whose window gradient, before any clipping, is saved (grad-<s>.pt);
                            "last": the last step's, whichever it is (a copy is kept at every step)
                            (ranks other than 0 save theirs as start-r<rank>.pt, state-r<rank>.pt, ...)
    BATCHSWEEP_TRACE_LOSS   "1": record each backward's loss (a synchronization per micro-batch on a GPU)
    BATCHSWEEP_TRACE_DATA   "1": the fingerprint of each window's inputs
    BATCHSWEEP_TRACE_NOISE  "1": each micro-batch's own gradient's squared norm (`micro_sq`), for the noise scale,
                            in one window of NOISE_EVERY (not across ranks)
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import json
import os
import sys
import time
import weakref

FLUSH_EVERY = 32  # steps held before their figures are read (a .item() on a GPU waits for the step's kernels)
# The noise scale's windows: one in this many. A measured micro-batch costs a copy of the gradient and two passes
# over it (three foreach operations), as the trainer's (trainers/noise.py): about 15% of a micro-batch of the
# example GPT loop, so a few windows are measured, as the trainer does (about 2% a micro-batch on average).
NOISE_EVERY = 8
TORCH = os.sep + "torch" + os.sep  # torch's folder, once it is imported: calls from inside it are not the script's
RANDOM_WINDOWS = 3  # windows over which the default generators are watched for draws in a forward or before a step


class Tracer:
    def __init__(self, folder: str):
        self.folder = folder
        self.path = None  # trace-[r<rank>-]<pid>.jsonl, named at the first step, once any process group is up
        self.rank = None  # where there are ranks, this process's (a string), named with the path
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
        # With the noise scale: how a loop without a DataLoader samples. The first dimensions of torch.randint's
        # draws (batches drawn with replacement, as minimal GPT trainers draw them) and torch.randperm's sizes (an
        # epoch over a permutation of N samples), each with its count.
        self.drawn: dict[str, dict[int, int]] = {"randint": {}, "randperm": {}}
        self.cuda = None  # the model's GPU, where it trains on one
        self.global_hooks: list = []  # removed once the model is found
        self.own_hooks: list = []  # the first model's own
        self.undo: list = []  # what puts each patch of install_hooks back (uninstall)
        self.depth = 0  # nesting of module calls: 0 outside any
        self.model = None  # the first module seen training: its inputs are the windows' samples
        self.roots: list = []  # every module called outermost in training, until the models are chosen
        self.models = None  # chosen at the first step: the roots whose parameters the optimizer trains
        self.trained: list[str] = []  # the names of the parameters it trains (what the audit compares)
        self.random_modules: list[str] = []
        self.random_fields: list[str] = []  # a transformers config's dropout fields above 0
        self.draws: set = set()  # "forward" where a default generator moved in the first model's training forward
        self.generators = None  # their states before the forward (or after the last backward) being watched
        self.optimizers = weakref.WeakKeyDictionary()  # index by first step; an optimizer let go is not kept alive
        self.stepped = 0  # optimizers that have stepped: the next one's index
        self.opt = 0  # the index of the optimizer stepping now
        self.scheduling = 0  # inside a scheduler's construction or step: its children's steps are not the script's
        self.schedulers = weakref.WeakKeyDictionary()  # by first step
        self.sites: dict[str, int] = {}  # "file:line" of a call: its index
        self.steps = 0  # of every optimizer
        self.compiled = False  # a module compiled in place (module.compile()), whose hooks run in its graph
        self.pending: list[dict] = []
        self.ended = False
        self._window()
        self.last = None  # the end of the step before (the first step: from its first forward)

    def _window(self) -> None:
        self.events: list[str] = []
        self.at: list[int] = []  # per event but F: the index of its site
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
        if compiling():
            return
        self.depth += 1

    def after_forward(self, module, args, kwargs, output) -> None:
        """A global hook, until the model is found: every module's call, of which the outermost count."""
        if compiling():  # (a module compiled in place runs its hooks inside the graph: they are left out there)
            return
        self.depth -= 1
        if self.depth or not module.training:
            return
        import torch

        if not torch.is_grad_enabled() or next(module.parameters(), None) is None:
            return  # evaluation, or a loss module
        if module is self.model or any(module is root for root in self.roots):
            return  # (the first model's own hook has it)
        self.roots.append(module)
        if self.model is not None:
            return
        self.model = module
        device = next(module.parameters()).device
        if device.type == "cuda":  # the allocator's peak from here on: training's, as the trainer measures it
            self.cuda = device
            torch.cuda.reset_peak_memory_stats(device)
        # The first model's own hook: once the models are chosen, the global ones go.
        self.watching = module.register_forward_pre_hook(self.watch_forward)
        self.own_hooks = [module.register_forward_hook(self.model_forward, with_kwargs=True), self.watching]
        self.model_forward(module, args, kwargs, output)

    def watch_forward(self, module, args) -> None:
        """In the first windows: the generators' states before a training forward, to see whether it draws."""
        import torch

        if compiling():
            return
        if self.steps >= RANDOM_WINDOWS:
            self.watching.remove()
        elif module.training and torch.is_grad_enabled():
            self.generators = generator_states(self.cuda)

    def drew(self, where: str) -> None:
        """Whether a default generator moved since the states were taken (dropout, a random augmentation)."""
        if self.generators is not None and generator_states(self.cuda) != self.generators:
            self.draws.add(where)
        self.generators = None

    def choose(self) -> None:
        """At the first step (or clip): the models and their weights before any update. Every root's state is saved
        (a frozen encoder's BatchNorm statistics say how it normalized); the weights compared are the parameters that
        require grad, wherever they are (a frozen encoder's are not)."""
        import torch

        self.models = self.roots[:]
        for handle in self.global_hooks:
            handle.remove()
        self.global_hooks = []
        # (every name a tied weight has in the state dict: GPT-2's lm_head.weight is its wte.weight)
        self.trained = [name for name, p in self.named_parameters(aliases=True) if p.requires_grad]
        dropout = torch.nn.modules.dropout._DropoutNd
        self.random_modules = [f"{name or 'model'}: {type(sub).__name__}(p={getattr(sub, 'p', None) or sub.drop_prob})"
                               for i, model in enumerate(self.models) for name, sub in model.named_modules(
                                   prefix=f"{i}" if len(self.models) > 1 else "")
                               if sub.training and (isinstance(sub, dropout) and sub.p > 0 or
                                                    "DropPath" in type(sub).__name__ and getattr(sub, "drop_prob", 0))]
        # A transformers model's config names the fields that set them (resid_pdrop, hidden_dropout_prob, ...).
        configs = [getattr(model, "config", None) for model in self.models]
        self.random_fields = sorted({f"{key}={value}" for config in configs if hasattr(config, "to_dict")
                                     for key, value in config.to_dict().items() if ("dropout" in key or "pdrop" in key)
                                     and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0})
        if self.save:
            self._save_state("start.pt")

    def named_parameters(self, aliases: bool = False):
        """The models' parameters, named as in their state dicts (numbered where there are several models);
        `aliases`: a parameter shared by several modules under each of its names."""
        many = len(self.models or ()) > 1
        for i, model in enumerate(self.models or ()):
            for name, p in model.named_parameters(remove_duplicate=not aliases):
                yield (f"{i}.{name}" if many else name), p

    def model_forward(self, module, args, kwargs, output) -> None:
        import torch

        if compiling() or not module.training or not torch.is_grad_enabled():
            return
        if self.last is None:
            self.last = time.perf_counter()
        if self.steps < RANDOM_WINDOWS:
            self.drew("forward")
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

    def event(self, mark: str) -> None:
        self.events.append(mark)
        self.at.append(self.site())

    def site(self, suffix: str = "") -> int:
        """The index of the caller's place outside torch and this file: "file:line"."""
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or
                                     frame.f_code.co_filename == __file__):
            frame = frame.f_back
        where = "?" if frame is None else f"{relative(frame.f_code.co_filename)}:{frame.f_lineno}{suffix}"
        return self.sites.setdefault(where, len(self.sites))

    def backward(self, tensors) -> None:
        import torch

        self.event("B")
        self.samples.append(self.forward_samples or 0)
        self.forward_samples = None
        if self.losses and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self.loss_values.append(tensors.detach().double().reshape(()))

    def after_backward(self) -> None:
        """In a measured window: this micro-batch's own gradient, the accumulated one less the one before."""
        if not self.noise or self.model is None or (self.steps + 1) % NOISE_EVERY:
            return
        import torch

        models = self.models or [self.model]
        grads = [p.grad for m in models for p in m.parameters() if p.grad is not None]
        if not grads or (self.before is not None and len(self.before) != len(grads)):
            self.micro_sq.append(None)  # (a tensor that got its first gradient now: this window is not measured)
            return
        with torch.no_grad():
            own = grads if self.before is None else torch._foreach_sub(grads, self.before)
            self.micro_sq.append(squares(own))
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
        self.event("Z")

    def scheduler_step(self, scheduler) -> None:
        """A scheduler's step, its place named with the scheduler where it is not the first one seen: two
        schedulers stepped on one line once a window each are not one stepped twice."""
        if self.scheduling:
            return
        if scheduler not in self.schedulers:
            self.schedulers[scheduler] = len(self.schedulers)
        self.events.append("L")
        n = self.schedulers[scheduler]
        self.at.append(self.site(f" (scheduler {n + 1})" if n else ""))

    def clipping(self, parameters, max_norm) -> None:
        """Before clip_grad_norm_ runs: the gradient it is about to cut is the window's."""
        self.event("C")
        if self.models is None:
            self.choose()
        self._gradient()

    def clipped(self, max_norm, total) -> None:
        self.clip = (float(max_norm), total)

    def ranked(self) -> None:
        """The trace's file, named by the rank: torchrun's and accelerate's RANK, or the process group's where the
        ranks were started otherwise (mp.spawn passes them as arguments). Across ranks no noise scale is measured:
        a micro-batch's gradient is the rank's own only until the window's all-reduce."""
        import torch

        rank, world = os.environ.get("RANK"), int(os.environ.get("WORLD_SIZE", "1"))
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed:
            rank, world = str(torch.distributed.get_rank()), torch.distributed.get_world_size()
        self.noise = self.noise and world == 1
        self.path = os.path.join(self.folder, f"trace-{'r' + rank + '-' if rank else ''}{os.getpid()}.jsonl")
        self.rank = rank

    def saved(self, name: str) -> str:
        """Where a file the tracer saves goes: "state.pt" for the one process or rank 0, "state-r1.pt" for rank 1
        (every rank's weights are kept: ranks whose weights part never all-reduced some gradient)."""
        if self.path is None:
            self.ranked()
        stem, dot, ext = name.rpartition(".")
        return os.path.join(self.folder, name if self.rank in (None, "0") else f"{stem}-r{self.rank}{dot}{ext}")

    def before_step(self, optimizer, args, kwargs) -> None:
        if self.path is None:
            self.ranked()
        self.known(optimizer)
        self.lrs = [value(group.get("lr")) for group in optimizer.param_groups]
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
        if self.models is None:
            self.choose()
        if "C" not in self.events:
            self._gradient()
        self.norm = None if "C" in self.events else grad_norm(optimizer)

    def after_step(self, optimizer, args, kwargs) -> None:
        self._end_window("S")

    def known(self, optimizer) -> None:
        if optimizer not in self.optimizers:
            self.optimizers[optimizer] = self.stepped
            self.stepped += 1
        self.opt = self.optimizers[optimizer]

    def scaler_skipped(self, optimizer) -> None:
        self.known(optimizer)
        if self.models is None:  # (a first step skipped: the weights are still the start's)
            self.choose()
        self.lrs = [value(group.get("lr")) for group in optimizer.param_groups]
        self.norm = None if "C" in self.events else grad_norm(optimizer)
        self._end_window("K")

    # -- records --------------------------------------------------------------------------------------------------
    def _end_window(self, mark: str) -> None:
        self.steps += 1
        self.event(mark)
        now = time.perf_counter()
        row = {"step": self.steps, "events": "".join(self.events), "at": self.at, "samples": self.samples,
               "fingerprint": self.sums, "tokens": self.tokens, "shape": self.shape, "lrs": self.lrs,
               "skipped": mark == "K",
               "grad_norm": self.clip[1] if self.clip else self.norm, "clip": self.clip[0] if self.clip else None,
               "losses": self.loss_values or None, "wall_s": now - (self.last or now),
               "micro_sq": self.micro_sq if len(self.micro_sq) == len(self.samples) and None not in self.micro_sq
               else None,
               "opt": self.opt if self.stepped > 1 else None}
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
        if self.path is None:
            self.ranked()
        with open(self.path, "a") as f:
            for row in self.pending:
                f.write(json.dumps({key: plain(value) for key, value in row.items() if value is not None}) + "\n")
        self.pending = []

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.steps and "B" in self.events:  # backward calls after the last step, which no step took
            self.pending.append({"dangling": "".join(self.events)})
        if self.steps:
            self.pending.append({"trained": self.trained, "random_modules": self.random_modules,
                                 "random_fields": self.random_fields,
                                 "random_draws": sorted(self.draws), "sites": list(self.sites),
                                 "compiled": self.compiled})
        if self.loaders and self.steps:
            self.pending.append({"loaders": sorted(self.loaders, key=str)})
        if self.noise and self.steps:
            self.pending.append({"drawn": self.drawn})
        if self.cuda is not None and self.steps:
            import torch

            self.pending.append({"peak_allocated_bytes": torch.cuda.max_memory_allocated(self.cuda)})
        self.flush()
        if self.save and self.model is not None:
            self._save_state("state.pt")
        if self.kept is not None and self.kept[0] == self.steps:
            import torch

            torch.save(self.kept[1], self.saved(f"grad-{self.steps}.pt"))

    def _save_state(self, name: str) -> None:
        import torch

        many = len(self.models or ()) > 1
        state = {(f"{i}.{key}" if many else key): value.detach().cpu().clone()
                 for i, model in enumerate(self.models or ()) for key, value in model.state_dict().items()}
        if state:
            torch.save(state, self.saved(name))

    def _gradient(self) -> None:
        """The window's gradient as it is now (before a clip, or before the step), where it is asked for."""
        import torch

        step = self.steps + 1
        if not self.models or not (step in self.grads or self.last_grads):
            return
        grads = {name: p.grad.detach().cpu().clone() for name, p in self.named_parameters() if p.grad is not None}
        if step in self.grads:
            torch.save(grads, self.saved(f"grad-{step}.pt"))
        if self.last_grads:
            self.kept = (step, grads)


def first_tensor(args, kwargs):
    """The model's input: its first tensor argument, or its first tensor keyword (input_ids, x, ...)."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def compiling() -> bool:
    """Whether Dynamo is tracing the call (set to torch's own test once torch is imported)."""
    return False


def value(lr):
    """An LR as it is now: one held in a tensor, which a scheduler changes in place, copied (on its device)."""
    return lr.detach().clone() if hasattr(lr, "detach") else lr


def generator_states(cuda) -> tuple:
    """The default generators' states: the CPU's, and the GPU's where the model trains on one."""
    import torch

    states = [torch.random.get_rng_state()]
    if cuda is not None:
        states.append(torch.cuda.get_rng_state(cuda))
    return tuple(bytes(state.numpy()) for state in states)


def relative(path: str) -> str:
    """A script's path as the user knows it: from the current folder where it is inside it."""
    here = os.getcwd() + os.sep
    return path[len(here):] if path.startswith(here) else path


def grad_norm(optimizer):
    """The 2-norm of the gradients the optimizer is about to apply (read when written)."""
    import torch

    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    with torch.no_grad():
        return Squares(squares([g.detach() for g in grads]), root=True)


class Squares(list):
    """Sums of squares, one 0-d float64 tensor per device, added up as Python floats when the row is written: a
    model spread over devices (device_map="auto", an offloaded embedding) has gradients on each, and no tensor of
    one device is stacked with another's inside the script's backward() or step(). `root`: the 2-norm."""

    def __init__(self, parts, root: bool = False):
        super().__init__(parts)
        self.root = root

    def read(self) -> float:
        total = sum(float(part) for part in self)
        return total ** 0.5 if self.root else total


def squares(tensors) -> Squares:
    """The tensors' total sum of squares, per device: one foreach norm over each device's tensors (a foreach norm
    over tensors of several devices is not one: torch 2.14 returned 2e+36 for a CPU tensor of ones beside a meta
    tensor)."""
    import torch

    by_device: dict = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    return Squares(torch.stack(torch._foreach_norm(group)).double().pow(2).sum() for group in by_device.values())


def plain(value):
    """A row's value as JSON takes it: tensors read here, once per FLUSH_EVERY steps."""
    if isinstance(value, Squares):
        return value.read()
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

    global TORCH, compiling
    TORCH = os.path.dirname(torch.__file__) + os.sep
    # (torch.compiler.is_compiling from torch 2.3 on; before, Dynamo's own, where Dynamo has been imported)
    compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
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


# Not files a trial could share with another: devices (/dev/null), the kernel's views of processes and devices.
NOT_FILES = ("/dev/", "/proc/", "/sys/")


def watch_writes(folder: str):
    """Each file this process writes, once, as a line of writes-<pid>.txt, written at once: the sweep compares
    them between trials that run at the same time. Seen: what open() opens for writing (numpy, json, logging,
    pickle) and the target of os.rename and os.replace (an atomic save); torch.save writes a path through its
    own C++ writer, which open() never sees, so `watch_saves` wraps it. Returns the function that records one."""
    seen, out = set(), []

    def record(name) -> None:
        name = os.path.abspath(os.fsdecode(name))
        if "\n" in name or name in seen or name.startswith(NOT_FILES):
            return
        seen.add(name)
        if not out:
            out.append(os.open(os.path.join(folder, f"writes-{os.getpid()}.txt"),
                               os.O_WRONLY | os.O_CREAT | os.O_APPEND))
        os.write(out[0], os.fsencode(name + "\n"))

    def hook(event, args):
        if event == "os.rename" and isinstance(args[1], (str, bytes)) and args[3] in (None, -1):
            record(args[1])  # (relative to the working folder: a dst_dir_fd is not followed)
        elif event == "open" and isinstance(args[1], str) and any(c in args[1] for c in "wax+"):
            if isinstance(args[0], (str, bytes)):  # (not a file descriptor; os.open's mode is None: the write of
                record(args[0])                    # writes-<pid>.txt above never comes back here)

    sys.addaudithook(hook)
    return record


def watch_saves(record) -> None:
    """torch.save to a path (not to a file object, which open() made) is recorded as written."""
    import torch

    save = torch.save

    @functools.wraps(save)
    def saving(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            record(f)
        return save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = saving


def start() -> None:
    folder = os.environ.get("BATCHSWEEP_TRACE")
    if not folder or not os.path.isdir(folder):
        return
    record = watch_writes(folder)
    tracer = Tracer(folder)

    def after_torch() -> None:
        watch_saves(record)
        installed(tracer)

    if "torch" in sys.modules:
        after_torch()
    else:
        sys.meta_path.insert(0, AfterTorch(after_torch))


def installed(tracer: Tracer) -> None:
    """The hooks, or where this torch lacks what they need, one line saying why in the trace folder: the script
    runs unobserved rather than fail inside its own `import torch`, and none of the hooks put in before the one
    that failed stays (half a tracer would write windows that miss calls)."""
    try:
        install_hooks(tracer)
    except Exception as exc:  # (an older torch: a hook API it does not have)
        import torch

        uninstall(tracer)
        with open(os.path.join(tracer.folder, f"unobservable-{os.getpid()}.txt"), "w") as f:
            f.write(f"the tracer cannot observe torch {torch.__version__}: {type(exc).__name__}: {exc}\n")
