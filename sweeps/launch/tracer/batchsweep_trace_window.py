"""The tracer's record of one process (batchsweep_trace.py starts it): what the script did between two optimizer
steps, from the hooks' calls, written as a JSON line per step, and the model's weights and windows' gradients
saved where asked. The hooks that call it are batchsweep_trace_hooks.py's; the tensors it reads,
batchsweep_trace_tensors.py's; the places of the script's calls, batchsweep_trace_sites.py's."""
from __future__ import annotations

import json
import os
import time
import weakref

from batchsweep_trace_sites import Sites
from batchsweep_trace_tensors import first_tensor, generator_states, grad_norm, plain, randomness, squares, value

FLUSH_EVERY = 32  # steps held before their figures are read (a .item() on a GPU waits for the step's kernels)
# The noise scale's windows: one in this many. A measured micro-batch costs a copy of the gradient and two passes
# over it (three foreach operations), as the trainer's (trainers/noise.py): about 15% of a micro-batch of the
# example GPT loop, so a few windows are measured, as the trainer does (about 2% a micro-batch on average).
NOISE_EVERY = 8
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
        # Bytes: the weights after each of the first steps and their windows' gradients (state-<s>.pt, grad-<s>.pt)
        # are saved while twice the state dict's size a step fits in them; the audit reads a run to step s there.
        self.keep = int(os.environ.get("BATCHSWEEP_TRACE_KEEP") or 0)
        self.keep_steps = 0  # how many, once the models are chosen
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
        self.watching_others: list = []  # the other models' draws watched in the first windows
        self.undo: list = []  # what puts each patch of install_hooks back (uninstall)
        self.depth = 0  # nesting of module calls: 0 outside any
        self.model = None  # the first module seen training: its inputs are the windows' samples
        self.roots: list = []  # every module called outermost in training, until the models are chosen
        self.models = None  # chosen at the first step: the roots whose parameters the optimizer trains
        self.trained: list[str] = []  # the names of the parameters it trains (what the audit compares)
        self.random_modules: list[str] = []
        self.random_fields: list[str] = []  # a transformers config's dropout fields above 0
        # Where a default generator moved in the first windows ("forward": in a model's training forward; "step":
        # between a forward, or the step before, and the next forward: an augmentation, a batch drawn there), and
        # which: {"forward": {"torch", "random"}, ...}
        self.draws: dict[str, set] = {}
        self.generators = None  # their states before the forward being watched
        self.between = None  # their states after the last forward or step, in the first windows
        self.optimizers = weakref.WeakKeyDictionary()  # index by first step; an optimizer let go is not kept alive
        self.stepped = 0  # optimizers that have stepped: the next one's index
        self.opt = 0  # the index of the optimizer stepping now
        self.scheduling = 0  # inside a scheduler's construction or step: its children's steps are not the script's
        self.schedulers = weakref.WeakKeyDictionary()  # by first step
        self.sites = Sites()  # the places of the script's calls
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
            for handle in (self.watching, *self.watching_others):
                handle.remove()
        elif module.training and torch.is_grad_enabled():
            self.generators = generator_states(self.cuda)
            self.moved("step", self.between, self.generators)

    def other_forward(self, module, args, output) -> None:
        if self.steps < RANDOM_WINDOWS and module.training and not compiling():
            self.drew()

    def drew(self) -> None:
        """After a watched forward: which default generators it moved (dropout, a LayerDrop), and the states that
        the next forward's are compared with (what the step draws between them)."""
        now = generator_states(self.cuda)
        self.moved("forward", self.generators, now)
        self.generators, self.between = None, now

    def moved(self, where: str, before, now) -> None:
        for name, state in (before or {}).items():
            if now.get(name) != state:
                self.draws.setdefault(where, set()).add(name)

    def choose(self) -> None:
        """At the first step (or clip): the models and their weights before any update. Every root's state is saved
        (a frozen encoder's BatchNorm statistics say how it normalized); the weights compared are the parameters that
        require grad, wherever they are (a frozen encoder's are not)."""
        self.models = self.roots[:]
        for handle in self.global_hooks:
            handle.remove()
        self.global_hooks = []
        # The other models' forwards draw too (a head the loop calls apart): watched as the first one's is.
        self.watching_others = [handle for model in self.models if model is not self.model for handle in (
            model.register_forward_pre_hook(self.watch_forward), model.register_forward_hook(self.other_forward))]
        # (every name a tied weight has in the state dict: GPT-2's lm_head.weight is its wte.weight)
        self.trained = [name for name, p in self.named_parameters(aliases=True) if p.requires_grad]
        self.random_modules, self.random_fields = randomness(self.models)
        if self.save:
            self._save_state("start.pt")
        if self.keep:  # (a window's gradient is no larger than the trained weights)
            size = sum(t.numel() * t.element_size() for model in self.models for t in model.state_dict().values())
            self.keep_steps = self.keep // max(2 * size, 1)

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
            self.drew()
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
        self.at.append(self.sites.index())

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
        self.at.append(self.sites.index(f" (scheduler {n + 1})" if n else ""))

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
        if self.steps < RANDOM_WINDOWS:  # (draws between the last forward and the step, as noise added to the
            self.between = generator_states(self.cuda)  # gradients, are no input's: not counted)

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
        if self.steps <= self.keep_steps:
            self._save_state(f"state-{self.steps}.pt")
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
            # Listed again at the end (cheap, once): a dropout whose p rises after the first step is random too.
            late = [m for m in randomness(self.models or [])[0] if m not in self.random_modules]
            self.pending.append({"trained": self.trained, "random_modules": self.random_modules,
                                 "random_late": late,
                                 "random_fields": self.random_fields,
                                 "random_draws": sorted(self.draws),
                                 "random_generators": {where: sorted(names) for where, names in self.draws.items()},
                                 "sites": list(self.sites.names),
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
        if not self.models or not (step in self.grads or self.last_grads or step <= self.keep_steps):
            return
        grads = {name: p.grad.detach().cpu().clone() for name, p in self.named_parameters() if p.grad is not None}
        if step in self.grads or step <= self.keep_steps:
            torch.save(grads, self.saved(f"grad-{step}.pt"))
        if self.last_grads:
            self.kept = (step, grads)


def compiling() -> bool:
    """Whether Dynamo is tracing the call (set to torch's own test once torch is imported)."""
    return False

